"""Shared test fixtures.

Real traces live outside the repository, in ``../shared/traces`` beside the
checkout (or the folder named by ``SHADOWPREFILL_TRACES``). A test that needs them
asks :func:`shared_traces`: when they are absent it is SKIPPED with a reason that
says where to get them, except under ``CI=true``, where a missing trace is a
failure (CI has the traces; a skip there would hide that the test never ran).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Where each shared trace set comes from, for the skip reason.
TRACE_SOURCES = {
    "azure-llm-2023": "the Azure LLM inference traces 2023 from https://github.com/Azure/AzurePublicDataset",
}


def traces_root() -> Path:
    """``$SHADOWPREFILL_TRACES`` if set, else ``../shared/traces`` beside the checkout."""
    env = os.environ.get("SHADOWPREFILL_TRACES")
    return Path(env) if env else ROOT.parent / "shared" / "traces"


def require_traces(subdir: str, *files: str) -> Path:
    """The folder ``traces_root()/subdir`` holding ``files``; skip (fail under CI=true) if any is missing."""
    folder = traces_root() / subdir
    missing = [f for f in files if not (folder / f).is_file()]
    if not missing:
        return folder
    source = TRACE_SOURCES.get(subdir, subdir)
    msg = (f"real traces absent ({', '.join(missing)} not in {folder}): get {source} into "
           f"../shared/traces/{subdir}/ beside the checkout, or set SHADOWPREFILL_TRACES=DIR holding {subdir}/")
    if os.environ.get("CI") == "true":
        pytest.fail(f"{msg} (CI=true: the traces must be present)", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def shared_traces() -> Callable[..., Path]:
    """``shared_traces(subdir, *files)``: see :func:`require_traces`."""
    return require_traces
