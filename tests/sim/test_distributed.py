"""Grid execution: part files round-trip a run exactly, a rerun resumes (runs
only what is missing), and a local Ray cluster gives exactly the local-process
results (issue 17 item 3)."""

from __future__ import annotations

import os

import pytest
from shadow_sim.experiments import distributed, runner
from shadow_sim.experiments.distributed import ResultStore, task_key
from shadow_sim.experiments.spec import Experiment
from shadow_sim.experiments.sweep import run_grid

from shadowcore.config import PluginRef
from shadowcore.errors import ConfigError

BASE = {"latency": "roofline", "instances_per_model": 1, "duration_s": 20.0, "warmup_s": 5.0, "drain_s": 5.0,
        "session_rate_per_s": 0.4}
CAPACITY = {"Qwen2.5-7B": 4.0, "Llama-3.1-70B": 2.0}
REFS = [PluginRef("no-shadow"), PluginRef("harvest-slo-host")]


def _grid(**kw):
    return run_grid(BASE, ["Q7/L70"], REFS, [0, 1], ["peak"], jobs=1, progress=False, capacity=CAPACITY, **kw)


@pytest.fixture(scope="module")
def local():
    return _grid()


def test_part_file_round_trips_a_run_exactly(tmp_path):
    ex = Experiment.from_dict({**BASE, "models": ["Qwen2.5-7B", "Llama-3.1-70B"]})
    task = runner.tasks_for(ex, [PluginRef("harvest-slo-host")], [0], ["peak"], CAPACITY)[0]
    record = runner.run_task(task)
    store = ResultStore(tmp_path)
    store.save(task, record)
    assert store.load(task) == record
    other = runner.tasks_for(ex, [PluginRef("harvest-slo-host", {"beta": 0.3})], [0], ["peak"], CAPACITY)[0]
    assert task_key(other) != task_key(task) and store.load(other) is None


def test_rerun_resumes_from_parts(tmp_path, monkeypatch, local):
    store = ResultStore(tmp_path / "parts")
    assert _grid(store=store) == local
    parts = sorted(store.folder.glob("*.parquet"))
    assert len(parts) == 4
    ran = []
    real = runner.run_task
    monkeypatch.setattr(runner, "run_task", lambda t: ran.append(t) or real(t))
    assert _grid(store=store) == local and ran == []  # everything reused
    parts[0].unlink()
    assert _grid(store=store) == local and len(ran) == 1  # only the missing run


def test_local_ray_cluster_equals_local_processes(tmp_path, local):
    if os.environ.get("CI") != "true":
        pytest.importorskip("ray", reason="Ray is not installed: pip install 'shadowprefill[ray]'")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        store = ResultStore(tmp_path / "parts")
        assert _grid(ray_address="local", store=store) == local
        assert len(list(store.folder.glob("*.parquet"))) == 4
    finally:
        ray.shutdown()


def test_tables_are_shipped_into_an_empty_cache(tmp_path, monkeypatch):
    tables = {"abc123": {"tables.npz": b"npz", "meta.json": b"{}"}}
    monkeypatch.setenv("SHADOWPREFILL_CACHE", str(tmp_path))
    assert distributed.install_tables(tables) == 1
    assert (tmp_path / "vidur" / "abc123" / "tables.npz").read_bytes() == b"npz"
    assert distributed.install_tables(tables) == 0  # already there


def test_missing_ray_is_one_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ConfigError, match="needs Ray"):
        distributed.connect("auto")


@pytest.mark.parametrize(("address", "needle"), [("127.0.0.1:1", "cannot reach"), ("nowhere", "HOST:PORT")])
def test_unreachable_address_is_one_clear_error(address, needle):
    pytest.importorskip("ray")
    with pytest.raises(ConfigError, match=needle):
        distributed.connect(address)
