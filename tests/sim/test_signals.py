"""Stopping a command stops its workers: SIGTERM to ``shadowprefill sweep --jobs 2``
or Ctrl-C (SIGINT to its process group) while runs are in flight leaves no worker
process alive (before, SIGTERM left every pool worker running, orphaned)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # state, ppid, ...


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(int(st[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


# Ten simulated hours per run: the fastest policy here takes ~25 CPU-s a run (one hour took ~2.5 s once the
# simulator got faster, and then a pool that only closed finished its runs inside the test's 20 s: mutant
# orphan-workers survived), so runs abandoned at once and runs finished are told apart.
SWEEP = ["sweep", "--pairs", "Q7/L70", "--policies", "no-shadow,harvest-slo-host,oracle-host", "--seeds", "0,1",
         "--latency", "roofline", "--duration", "36000", "--warmup", "5", "--instances", "1",
         "--capacity", "Qwen2.5-7B=4,Llama-3.1-70B=2", "--jobs", "2", "--format", "csv"]


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_stopping_sweep_stops_every_worker(how: str, tmp_path: Path) -> None:
    log = (tmp_path / "log.txt").open("w")
    # As a terminal starts a foreground command: SIGINT at its default. A background job of a
    # non-interactive shell (how CI may run us) inherits SIGINT ignored, and Python then keeps it ignored.
    proc = subprocess.Popen([sys.executable, "-m", "shadowcore.cli", *SWEEP, "--out", str(tmp_path / "out")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509 (no threads yet)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            workers = _descendants(proc.pid)
        assert len(workers) >= 2, (tmp_path / "log.txt").read_text()
        time.sleep(0.5)  # the workers are inside their runs
        workers = _descendants(proc.pid)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        stopped = time.monotonic()
        rc = proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [w for w in workers if _alive(w)]
        assert survivors == [], f"workers still running after {how}: {survivors}"
        # at once: the runs in flight are abandoned, not finished (each takes far longer)
        assert time.monotonic() - stopped < 20  # a run here takes 25 s or more; a loaded machine needs seconds to stop
        assert rc == (143 if how == "sigterm" else 130), (tmp_path / "log.txt").read_text()
        if how == "ctrl-c":
            assert (tmp_path / "log.txt").read_text().rstrip().endswith("shadowprefill sweep: interrupted")
    finally:
        for pid in [proc.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
