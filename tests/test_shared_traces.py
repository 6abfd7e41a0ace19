"""The rule for tests that need the real traces (tests/conftest.py): absent traces
skip them with a reason saying where to get them, except under CI=true, where
they fail. Checked by running one such test in a subprocess with the traces
pointed at an empty folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL_TRACE_TEST = "tests/test_traces.py::test_azure_code_trace_loads"


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["SHADOWPREFILL_TRACES"] = str(tmp_path)  # holds no traces
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", REAL_TRACE_TEST, "-q", "-rs", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_absent_traces_skip_with_where_to_get_them(tmp_path) -> None:
    proc = _run(tmp_path, None)
    assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout
    assert "github.com/Azure/AzurePublicDataset" in proc.stdout and "../shared/traces/azure-llm-2023/" in proc.stdout


def test_absent_traces_fail_under_ci(tmp_path) -> None:
    proc = _run(tmp_path, "true")
    assert proc.returncode == 1 and "1 error" in proc.stdout, proc.stdout
    assert "CI=true: the traces must be present" in proc.stdout
