"""The KV manager alone at real load: record every call a scale run makes to
its KV managers, then replay them on this checkout's ``shadowcore/kv.py``
and on another version's, in turns, and print the CPU seconds of each.

    python benchmarks/kv_replay.py                                  # harvest-slo-host, 60 s, against main
    python benchmarks/kv_replay.py --policy no-shadow --against HEAD~2 --reps 8

The run is ``benchmarks/scale.py``'s (8 instances at rho 0.7, ``--duration``
seconds of arrivals); the trace (the calls from outside the manager, with
their arguments, per instance) stays in memory. Both versions must return
the same for every call (checked once, before timing: a differential check
on the real workload, with each manager's counters and idle orders at the
end). The replay isolates the manager from the engine, so a
change of a few percent in kv.py shows through the run's noise; the figure
is the minimum over ``--reps`` (alternating order), in CPU seconds, on a
shared machine a floor rather than a mean.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_METHODS = ("allocate", "extend", "extend_private", "release", "release_and_cache", "match_prefix",
            "shadow_room_blocks", "class_of", "is_cached", "in_host", "idle_order", "idle_since",
            "pool_owner", "move_private")
_PROPERTIES = ("num_host_blocks", "num_idle_blocks", "num_cached_blocks", "eviction_count", "num_shadow_blocks",
               "num_evicted_blocks")


def record(policy: str, duration_s: float) -> list[tuple]:
    """The calls of one scale run to its KV managers, as (manager index, name, arguments), in order."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale

    from shadowcore import kv

    manager = kv.KVClassManager
    trace: list[tuple] = []
    index: dict[int, int] = {}
    depth = [0]  # calls the manager makes to itself are not recorded
    post_init = manager.__attrs_post_init__

    def recorded_post_init(self) -> None:
        post_init(self)
        index[id(self)] = len(index)
        trace.append((index[id(self)], "__new__", (self.num_blocks, self.block_size, self.policy,
                                                   self.kv_bytes_per_token), {}))

    def copy(arg):  # a range is immutable: kept (a private allocation's hashes are one)
        return [tuple(x) if isinstance(x, tuple) else x for x in arg] if isinstance(arg, (list, tuple)) else arg

    def wrap(f, name):
        def method(self, *args, **kwargs):
            if depth[0]:
                return f(self, *args, **kwargs)
            trace.append((index[id(self)], name, tuple(map(copy, args)), kwargs))
            depth[0] += 1
            try:
                return f(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return method

    keys: dict[int, tuple] = {}  # cached_prefix_blocks' keys by identity: (key, its index, (stamp, hashes))

    def wrap_prefix(f):  # recorded with the key as an index and the hashes it stands for (one list per stamp)
        def method(self, key, stamp, hashes_of):
            if not depth[0]:
                entry = keys.get(id(key))
                if entry is None or entry[2][0] != stamp:
                    entry = keys[id(key)] = (key, len(keys) if entry is None else entry[1],
                                             (stamp, list(hashes_of(self.block_size))))
                trace.append((index[id(self)], "cached_prefix_blocks", (entry[1], stamp, entry[2][1]), {}))
            depth[0] += 1
            try:
                return f(self, key, stamp, hashes_of)
            finally:
                depth[0] -= 1
        return method

    def wrap_property(p, name):
        def getter(self):
            if not depth[0]:
                trace.append((index[id(self)], "." + name, (), {}))
            return p.fget(self)
        return property(getter)

    prefix = getattr(manager, "cached_prefix_blocks", None)
    saved = {n: getattr(manager, n) for n in (*_METHODS, *_PROPERTIES, "__attrs_post_init__")}
    try:
        manager.__attrs_post_init__ = recorded_post_init
        if prefix is not None:
            manager.cached_prefix_blocks = wrap_prefix(prefix)
        for n in _METHODS:
            setattr(manager, n, wrap(saved[n], n))
        for n in _PROPERTIES:
            setattr(manager, n, wrap_property(saved[n], n))
        scale.one_run(policy, 8, 0.7, duration_s, 0)
    finally:
        for n, v in saved.items():
            setattr(manager, n, v)
        if prefix is not None:
            manager.cached_prefix_blocks = prefix
    return trace


def _convert(mod, trace: list[tuple]) -> list[tuple]:
    """The trace with the recording's KV classes and policies as ``mod``'s; keyword arguments ``mod``'s
    methods do not take are dropped (``allocate(private=True)``: the same result without it)."""
    import inspect

    from shadowcore import kv

    def kw(name: str, kwargs: dict) -> dict:
        if not kwargs:
            return kwargs
        params = inspect.signature(getattr(mod.KVClassManager, name)).parameters
        return {k: v for k, v in kwargs.items() if k in params}

    def conv(x):
        if isinstance(x, kv.KVClass):
            return mod.KVClass(x.value)
        if isinstance(x, kv.KVClassPolicy):
            host = None if x.host is None else mod.HostTierParams(x.host.capacity_bytes, x.host.pcie_bytes_per_s)
            return mod.KVClassPolicy(x.shadow_cap_fraction, x.cold_age_s, host, x.eviction_order)
        return x

    keys: dict[int, object] = {}

    def prefix(args: tuple) -> tuple[str, tuple]:  # a remembered lookup: as it is, or match_prefix's blocks
        k, stamp, hashes = args
        if hasattr(mod.KVClassManager, "cached_prefix_blocks"):
            return "cached_prefix_blocks", (keys.setdefault(k, object()), stamp, lambda _, h=hashes: h)
        return "match_prefix_blocks", (hashes,)

    return [(i, *prefix(args), {}) if n == "cached_prefix_blocks" else (i, n, tuple(map(conv, args)), kw(n, kwargs))
            for i, n, args, kwargs in trace]


def _plain(v):
    import attrs

    if attrs.has(type(v)):
        return attrs.astuple(v)
    if isinstance(v, dict):
        return {getattr(k, "value", k): n for k, n in v.items()}
    return getattr(v, "value", v)


def _host_order(m) -> list[tuple[int, str]]:
    """The host tier's blocks and classes, least recent first (older versions: its dict of spill tokens)."""
    if hasattr(m, "host_order"):
        return [(h, c.value) for h, c in m.host_order()]
    if m.num_host_blocks:  # (the property settles the owed evictions first)
        return [(h, v[0].value) for h, v in m._host.items()]
    return []


def _final_state(mod, m) -> tuple:
    """What a caller can see of a manager at the end (the counters the engine reads as attributes too, and the
    host tier's order)."""
    return (m.num_free_blocks, m.eviction_count, m.num_shadow_blocks, _plain(m.num_evicted_blocks),
            m.num_shadow_blocks_used, m.num_reloaded_blocks, m.num_cached_blocks, m.num_host_blocks,
            m.num_idle_blocks, m.idle_order(mod.KVClass.SHADOW), m.idle_order(mod.KVClass.NORMAL), _host_order(m))


def replay(mod, ops: list[tuple], collect: bool = False) -> tuple[float, list]:
    """CPU seconds of the calls on fresh managers of ``mod`` (and, if ``collect``, their results followed by
    each manager's final state)."""
    managers, results = [], []
    t0 = time.process_time()
    for i, name, args, kwargs in ops:
        if name == "__new__":
            managers.append(mod.KVClassManager(*args))
            continue
        m = managers[i]
        if name[0] == ".":
            v = getattr(m, name[1:])
        elif name == "match_prefix_blocks":  # a version without cached_prefix_blocks: the lookup it stands for
            v = m.match_prefix(*args).num_blocks
        else:
            v = getattr(m, name)(*args, **kwargs)
        if collect:
            results.append(_plain(v))
    cpu_s = time.process_time() - t0
    if collect:
        results += [_final_state(mod, m) for m in managers]
    return cpu_s, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="harvest-slo-host")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (scale.py's)")
    parser.add_argument("--against", default="main", help="git ref of the other kv.py (default: main)")
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tools"))  # tools/ is not a package
    from kv_diff import load_module

    t0 = time.process_time()
    trace = record(args.policy, args.duration)
    print(f"recorded {len(trace)} calls of {args.policy} ({args.duration:g} s of arrivals) "
          f"in {time.process_time() - t0:.1f} CPU-s")
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "kv_other.py"
        other.write_text(subprocess.run(["git", "show", f"{args.against}:shadowcore/kv.py"], cwd=ROOT, check=True,
                                        capture_output=True, text=True).stdout)
        versions = {args.against: load_module(other, "kv_replay_other"),
                    "this checkout": load_module(ROOT / "shadowcore" / "kv.py", "kv_replay_this")}
    ops = {name: _convert(mod, trace) for name, mod in versions.items()}
    del trace
    gc.collect()
    gc.freeze()  # the trace: not scanned by every collection of the replays
    results = [replay(mod, ops[name], collect=True)[1] for name, mod in versions.items()]
    if results[0] != results[1]:
        k = next(k for k, (a, b) in enumerate(zip(*results)) if a != b)
        print(f"kv_replay: the versions differ at call {k}: {results[0][k]} vs {results[1][k]}")
        return 1
    print(f"results identical over {len(results[0])} calls and final states")
    del results
    times: dict[str, list[float]] = {name: [] for name in versions}
    names = list(versions)
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            gc.collect()
            times[name].append(replay(versions[name], ops[name])[0])
    base = min(times[args.against])
    for name in names:
        print(f"{name:>16}: CPU-s min {min(times[name]):.3f} ({min(times[name]) / base:.2f}x)  "
              f"all {[round(t, 3) for t in times[name]]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
