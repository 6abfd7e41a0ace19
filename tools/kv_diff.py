"""Differential check of shadowcore/kv.py against another version of it.

    python tools/kv_diff.py                      # this checkout's kv.py against main's, 3000 random sequences
    python tools/kv_diff.py --against HEAD~3 --seeds 500
    python tools/kv_diff.py --old /path/to/kv.py --sparse

A refactor of the KV manager's internals (issue 17) must leave everything a
caller or a result can see unchanged. Both versions run the same random
operation sequences (allocations of chains that share heads, normal and
shadow owners, private chains (``allocate(private=True)``, in half the
sequences), releases, finishes through ``release_and_cache``, decode
growth through ``extend_private``, extensions, room and prefix queries (of
private chains too, from their first block), host-tier queries, a
tight pool, with and without a host tier, both eviction orders); every
return value is compared, and after each step the full observable state:
counters, per block its class, references, idle time and coldness, each
class's idle order, the owners, the host tier's blocks in LRU order and
class. ``--sparse`` compares the state only now and then (about 3 steps in
10), so owed evictions pile up between comparisons as they do in a run.
Exit status 1 and the first difference (seed, step, operation, field) when
the versions disagree.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_module(path: Path, name: str):
    """Import the file at ``path`` as module ``name`` (two versions of kv.py side by side)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _host_items(kv) -> list[tuple[int, str]]:
    if hasattr(kv, "host_order"):  # the tier's blocks and classes in LRU order (private runs included)
        return [(h, c.value) for h, c in kv.host_order()]
    # older versions: the host tier's value is a KVClass (an OrderedDict LRU) or a spill token whose first item is one
    return [(h, (v[0] if isinstance(v, tuple) else v).value) for h, v in kv._host.items()]


def _state(kv, mod) -> tuple:
    if hasattr(kv, "_settle"):
        kv._settle()  # owed evictions (every query makes them first; the raw fields read here do not)
    blocks = {}
    for h in list(kv._blocks):
        ref = kv._blocks[h][1]
        blocks[h] = (kv.class_of(h).value, ref, kv.idle_since(h) if ref == 0 else None,
                     kv._cold(h) if ref == 0 else None)
    owners = {o: (w.kv_class.value, list(w.hashes), w.num_private_blocks) for o, w in kv._owners.items()}
    return (kv.num_free_blocks, kv.eviction_count, kv.num_shadow_blocks,
            {c.value: n for c, n in kv.num_evicted_blocks.items()}, kv.num_shadow_blocks_used,
            kv.num_reloaded_blocks, _host_items(kv), kv.idle_order(mod.KVClass.SHADOW),
            kv.idle_order(mod.KVClass.NORMAL), blocks, owners, kv._num_cold_idle, kv.num_idle_blocks,
            kv.num_cached_blocks, kv.num_host_blocks)


def _chain(c: int, n: int) -> list[int] | range:
    """Block hashes of chain ``c``: chains 0-3 share their first 5 blocks;
    chains from ``_PRIVATE`` on are private ones (one allocation each), a
    ``range`` as a count-only history gives."""
    if c >= _PRIVATE:
        return range(c * 1000, c * 1000 + n)
    return [i if c < 4 and i < 5 else c * 1000 + i for i in range(n)]


#: Chain ids from here on are allocated once each with ``private=True`` (nothing else names them).
_PRIVATE = 100


def _alloc_out(a):
    return None if a is None else (a.num_device_hit_blocks, a.num_host_hit_blocks, a.num_new_blocks, a.reload_s,
                                   a.num_shadow_blocks_used)


def run(seed: int, old, new, sparse: bool) -> str | None:
    """One random sequence on both versions; the first difference, or None."""
    rng = random.Random(seed)
    check_rng = random.Random(-seed - 1)
    host = rng.random() < 0.6
    num_blocks = rng.choice([8, 16, 32, 64])
    policy = {"shadow_cap_fraction": rng.choice([0.25, 0.5, 1.0]), "cold_age_s": rng.choice([0.0, 1.0, 2.0]),
              "eviction_order": rng.choice(["shadow-first", "lru"])}
    host_blocks = rng.choice([1, 3, 6, 20, 100])
    private_kv = rng.random() < 0.5  # half the sequences also allocate private chains (allocate(private=True))
    kvs = []
    for mod in (old, new):
        params = mod.HostTierParams(capacity_bytes=host_blocks * 16 * 131072.0) if host else None
        kvs.append((mod, mod.KVClassManager(num_blocks, 16, mod.KVClassPolicy(host=params, **policy))))
    owners: list[tuple[str, int, bool]] = []  # (owner id, chain, shadow)
    fresh_chains: list[int] = []  # private chains allocated so far (a lookup from their first block may name them)
    now = 0.0
    num_steps = rng.randint(1, 120)
    for n in range(num_steps):
        now += rng.choice([0.0, 0.0, 0.5, 1.0, 3.0])
        op = rng.choice(["alloc", "alloc", "release", "finish", "finish", "grow", "extend", "room", "match"]
                        + (["grow"] * 4 if sparse else []) + (["match", "host"] if fresh_chains else []))
        outs = []
        if op == "alloc":
            c, length, private, shadow = rng.randint(0, 7), rng.randint(0, 40), rng.randint(0, 3), rng.random() < 0.3
            fresh = private_kv and not shadow and rng.random() < 0.5  # a normal request's fresh prompt
            if fresh:
                c = _PRIVATE + n  # a chain of its own
            for mod, kv in kvs:
                cls = mod.KVClass.SHADOW if shadow else mod.KVClass.NORMAL
                outs.append(_alloc_out(kv.allocate(f"o{n}", _chain(c, length), private, cls, now, private=fresh)))
            if outs[0] is not None:
                owners.append((f"o{n}", c, shadow))
                if fresh:
                    fresh_chains.append(c)
        elif op == "release" and owners:
            owner = owners.pop(rng.randrange(len(owners)))
            for _, kv in kvs:
                kv.release(owner[0], now)
        elif op == "finish" and owners:
            owner = owners.pop(rng.randrange(len(owners)))
            k = len(kvs[0][1]._owners[owner[0]].hashes)
            hashes = _chain(owner[1], k + rng.randint(0, 30))
            if rng.random() < 0.1:  # not the owner's chain: the general way
                hashes = _chain(rng.randint(0, 7), rng.randint(0, 40))
            for _, kv in kvs:
                kv.release_and_cache(owner[0], hashes, f"commit{n}", now)
        elif op == "grow":
            normal = [o for o in owners if not o[2]]
            if normal:
                needs = list({rng.choice(normal)[0]: rng.randint(1, 4) for _ in range(rng.randint(1, 3))}.items())
                outs = [kv.extend_private(needs, now) for _, kv in kvs]
        elif op == "extend" and owners:
            owner = rng.choice(owners)
            k = len(kvs[0][1]._owners[owner[0]].hashes)
            hashes = _chain(owner[1], k + rng.randint(0, 5))[k:]
            private = rng.randint(0, 2)
            outs = [kv.extend(owner[0], hashes, private, now) for _, kv in kvs]
        elif op == "room":
            outs = [kv.shadow_room_blocks(now) for _, kv in kvs]
        elif op == "match":  # a shared chain, or (half the time, where there are any) a private one from its head
            c = rng.choice(fresh_chains) if fresh_chains and rng.random() < 0.5 else rng.randint(0, 7)
            hashes = _chain(c, rng.randint(0, 40))
            outs = [(m.num_device_blocks, m.num_host_blocks) for m in (kv.match_prefix(hashes) for _, kv in kvs)]
        elif op == "host":  # a by-hash query of the host tier (names its private runs)
            h = _chain(rng.choice(fresh_chains), 40)[rng.randint(0, 39)]
            outs = [kv.in_host(h) for _, kv in kvs]
        if outs and outs[0] != outs[1]:
            return f"seed {seed} step {n} {op}: returned {outs[0]} (old) vs {outs[1]} (new)"
        if sparse and check_rng.random() < 0.7 and n < num_steps - 1:
            continue
        a, b = (_state(kv, mod) for mod, kv in kvs)
        if a != b:
            field = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            return f"seed {seed} step {n} {op}: state field {field}: old {a[field]} new {b[field]}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="main", help="git ref of the old kv.py (default: main)")
    parser.add_argument("--old", type=Path, help="a kv.py file to compare against instead of a git ref")
    parser.add_argument("--new", type=Path, default=ROOT / "shadowcore" / "kv.py")
    parser.add_argument("--seeds", type=int, default=3000)
    parser.add_argument("--sparse", action="store_true", help="compare the state about 3 steps in 10")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_path = args.old
        if old_path is None:
            old_path = Path(tmp) / "kv_old.py"
            text = subprocess.run(["git", "show", f"{args.against}:shadowcore/kv.py"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
            old_path.write_text(text)
        old, new = load_module(old_path, "kv_diff_old"), load_module(args.new, "kv_diff_new")
        for seed in range(args.seeds):
            problem = run(seed, old, new, args.sparse)
            if problem is not None:
                print(f"kv_diff: {args.new} differs from {args.old or args.against}: {problem}")
                return 1
    print(f"kv_diff: {args.seeds} sequences identical ({args.new} vs {args.old or args.against})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
