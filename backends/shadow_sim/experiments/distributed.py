"""Running a grid's tasks: incremental, resumable results and the Ray executor.

:class:`ResultStore` keeps one Parquet part file per finished task under
``<out>/parts/``, written as the task finishes (so a stopped sweep keeps what
it finished); a rerun into the same folder loads those and runs only the rest.
A part is found by the task's key: a SHA-256 of the task's full ``repr`` (the
experiment with every field, policy and arguments, seed, window, capacities,
label) and :data:`PART_VERSION`, so a changed task never reuses an old part.
Results are exact across a round trip (float64 columns, floats in JSON by
``repr``): a resumed grid's comparison equals the uninterrupted one.

:func:`run_ray` runs tasks as Ray tasks: a progress bar over tasks as they
finish, ``max_retries`` for lost workers, and the Vidur latency tables the
tasks need built once on the driver and shipped through Ray's object store
(a worker whose cache lacks them writes them into its own cache before it
runs), so no worker trains or profiles tables itself. Ray is imported only here
and only when asked for; missing Ray or an unreachable address is one
:class:`~shadowcore.errors.ConfigError`.

Invariant: every task in, one record out, in task order (as
:func:`shadow_sim.experiments.runner.execute`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from shadow_sim.experiments.metrics import Call, RunRecord
from shadow_sim.experiments.runner import Task, run_task, with_progress
from shadowcore.errors import ConfigError

#: Bumped when a part file's layout or a task's meaning changes (2: Harvest-SLO's credit
#: accrues only on routed iterations, issue 16, so older parts of those policies are stale).
PART_VERSION = 2
_CALL_FIELDS = tuple(f.name for f in attrs.fields(Call))
_RUN_FIELDS = ("policy", "seed", "window", "normal_prompt_tokens", "shadow_tokens", "shadow_tokens_used",
               "energy_j", "energy_per_good_request_j", "makespan_s")


def task_key(task: Task) -> str:
    return hashlib.sha256(f"{PART_VERSION}\n{task!r}".encode()).hexdigest()[:24]


@attrs.define
class ResultStore:
    """Part files of finished tasks in ``folder`` (``<out>/parts``)."""

    folder: Path = attrs.field(converter=Path)

    def path(self, task: Task) -> Path:
        return self.folder / f"{task_key(task)}.parquet"

    def load(self, task: Task) -> RunRecord | None:
        p = self.path(task)
        if not p.exists():
            return None
        import pyarrow.parquet as pq

        table = pq.read_table(p)
        meta = json.loads(table.schema.metadata[b"shadowprefill"])
        if meta.get("task") != repr(task):  # a key collision or a hand-edited folder: never reuse
            return None
        cols = table.to_pydict()
        calls = tuple(Call(*(cols[f][i] for f in _CALL_FIELDS)) for i in range(table.num_rows))
        return RunRecord(calls=calls, measured_sessions=frozenset(meta["measured_sessions"]),
                         normal_met=tuple(meta["normal_met"]), summary=meta["summary"],
                         notices=tuple(meta.get("notices", ())), **{f: meta[f] for f in _RUN_FIELDS})

    def save(self, task: Task, record: RunRecord) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.folder.mkdir(parents=True, exist_ok=True)
        cols = {f: [getattr(c, f) for c in record.calls] for f in _CALL_FIELDS}
        types = {f: (pa.string() if f in ("session_id", "model") else pa.bool_() if f == "is_switch"
                     else pa.float64() if f.endswith("_s") else pa.int64()) for f in _CALL_FIELDS}
        meta = {"version": PART_VERSION, "task": repr(task), "measured_sessions": sorted(record.measured_sessions),
                "normal_met": list(record.normal_met), "summary": dict(record.summary),
                "notices": list(record.notices), **{f: getattr(record, f) for f in _RUN_FIELDS}}
        schema = pa.schema([(f, types[f]) for f in _CALL_FIELDS], metadata={"shadowprefill": json.dumps(meta)})
        table = pa.Table.from_pydict(cols, schema=schema)
        target = self.path(task)
        tmp = target.with_suffix(".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, target)  # a part is whole or absent
        return target


def split_done(tasks: Sequence[Task], store: ResultStore | None) -> tuple[dict[int, RunRecord], list[int]]:
    """Records already in ``store`` by task index, and the indices still to run."""
    done: dict[int, RunRecord] = {}
    if store is not None:
        for i, t in enumerate(tasks):
            r = store.load(t)
            if r is not None:
                done[i] = r
    return done, [i for i in range(len(tasks)) if i not in done]


def execute_grid(tasks: Sequence[Task], *, jobs: int = 1, progress: bool = False, store: ResultStore | None = None,
                 ray_address: str | None = None, max_retries: int = 3) -> list[RunRecord]:
    """Every task's record in task order: from ``store`` where finished, else run
    (``jobs`` local processes, or on Ray at ``ray_address``) and saved as each finishes."""
    done, todo = split_done(tasks, store)
    if done and progress and store is not None:
        print(f"resuming: {len(done)} of {len(tasks)} runs already in {store.folder}", file=sys.stderr)
    executor = None
    if ray_address is not None:
        def executor(ts, cb):
            return run_ray(ts, ray_address, on_done=cb, max_retries=max_retries)
    new = with_progress([tasks[i] for i in todo], jobs, progress, on_done=store.save if store else None,
                        executor=executor)
    done.update(zip(todo, new, strict=True))
    return [done[i] for i in range(len(tasks))]


# ----------------------------------------------------------------------------- Ray
def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray", "ray", "needs Ray: pip install 'shadowprefill[ray]'") from None
    return ray


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """A TCP connect to ``[ray://]host:port`` first: Ray itself retries an
    unreachable GCS for minutes before it gives up."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError("--ray", address, "must be auto, local, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError("--ray", address, f"cannot reach a Ray cluster there ({e.strerror or e})") from None


def connect(address: str, num_cpus: int | None = None) -> Any:
    """``ray.init`` at ``address`` ("local": a new local cluster; "auto": the running one)."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    if address not in ("local", "auto"):
        _reachable(address)
    try:
        if address == "local":
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("--ray", address, f"cannot reach a Ray cluster there ({first})") from None
    return ray


def latency_tables(tasks: Sequence[Task]) -> dict[str, dict[str, bytes]]:
    """The Vidur table folders the tasks use, built here once: {folder name: {file: bytes}}."""
    from shadow_sim.latency import latency_model

    out: dict[str, dict[str, bytes]] = {}
    seen = set()
    for t in tasks:
        sc = t.experiment.sim_scenario(t.seed)
        for m in sc.models:
            key = (m, sc.device, sc.tp_of(m), sc.latency)
            if key in seen:
                continue
            seen.add(key)
            lm = latency_model(m, sc.device, sc.tp_of(m), kind=sc.latency)
            path = getattr(lm, "table_path", None)
            if path is not None:
                out[path.name] = {f.name: f.read_bytes() for f in path.iterdir() if f.is_file()}
    return out


def install_tables(tables: dict[str, dict[str, bytes]]) -> int:
    """Write shipped tables into this process's cache where missing; how many folders were written."""
    from shadow_sim.vidur_latency import default_cache_dir

    root = default_cache_dir()
    written = 0
    for name, files in tables.items():
        target = root / name
        if (target / "tables.npz").exists():
            continue
        tmp = root / f".ship-{name}-{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        for fname, data in files.items():
            (tmp / fname).write_bytes(data)
        try:
            os.replace(tmp, target)
            written += 1
        except OSError:  # another worker won the race
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    return written


def _run_shipped(task: Task, tables: dict[str, dict[str, bytes]]) -> RunRecord:
    install_tables(tables)
    return run_task(task)


def run_ray(tasks: Sequence[Task], address: str, *, on_done: Callable[[Task, RunRecord], None] | None = None,
            max_retries: int = 3, num_cpus: int | None = None) -> list[RunRecord]:
    """Run ``tasks`` on Ray; records in task order; ``on_done`` as each finishes (driver side)."""
    ray = connect(address, num_cpus)
    tables_ref = ray.put(latency_tables(tasks))
    remote = ray.remote(max_retries=max_retries)(_run_shipped)
    pending = {remote.remote(t, tables_ref): i for i, t in enumerate(tasks)}
    results: list[RunRecord | None] = [None] * len(tasks)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            i = pending.pop(ref)
            results[i] = ray.get(ref)
            if on_done:
                on_done(tasks[i], results[i])
    return [r for r in results if r is not None]


__all__ = ["PART_VERSION", "ResultStore", "connect", "execute_grid", "install_tables", "latency_tables", "run_ray", "split_done",
           "task_key"]
