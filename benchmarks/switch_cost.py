"""What a switch call costs in a finished ``reproduce`` or ``sweep`` folder: per grid point and
target model, under one policy (default ``no-shadow``), the switch-call latency over the
same-model calls' (the paper's Figure 2d ratio, 1.5-3.2x), the switch call's TTFT and decode
shares, its mean output and time per output token, and its token-weighted prefix hit rate. A switch call that is mostly decoding
leaves shadowing (and an oracle that makes the switch's prefill free) little to take off.

    python benchmarks/switch_cost.py reproduce-out [--policy no-shadow] [--label main:]

Reads ``OUT/parts/*.parquet`` (one finished run each); only measured sessions' calls count
(the runs' warm-up excluded, as in the metrics); calls are pooled over seeds and windows.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def collect(folder: Path, policy: str, label_prefix: str) -> dict[tuple[str, str], dict[str, list]]:
    """(label, model) -> {"switch": [(latency, ttft, outputs)], "same": [...]} of ``policy``'s runs."""
    import pyarrow.parquet as pq

    out: dict[tuple[str, str], dict[str, list]] = defaultdict(lambda: {"switch": [], "same": []})
    for part in sorted((folder / "parts").glob("*.parquet")):
        table = pq.read_table(part)
        meta = json.loads(table.schema.metadata[b"shadowprefill"])
        label = re.search(r"label='([^']*)'\)$", meta["task"])
        if meta["policy"] != policy or not label or not label.group(1).startswith(label_prefix):
            continue
        measured = set(meta["measured_sessions"])
        cols = table.to_pydict()
        for i, session in enumerate(cols["session_id"]):
            if session in measured:
                kind = "switch" if cols["is_switch"][i] else "same"
                out[(label.group(1), cols["model"][i])][kind].append(
                    (cols["latency_s"][i], cols["ttft_s"][i], cols["num_output_tokens"][i],
                     cols["num_prompt_tokens"][i], cols["num_cached_tokens"][i]))
    return out


def table(data: dict[tuple[str, str], dict[str, list]]) -> str:
    lines = [("| grid point | target model | switch calls | switch / same-model latency | switch TTFT share "
              "| switch decode share | mean output: switch / same | TPOT (ms): switch / same | switch hit rate |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (label, model), calls in sorted(data.items()):
        sw, same = calls["switch"], calls["same"]
        if not sw:
            continue
        lat, same_lat = _mean([c[0] for c in sw]), _mean([c[0] for c in same])
        ttft = _mean([c[1] for c in sw])
        tpot = [1000 * _mean([(c[0] - c[1]) / (c[2] - 1) for c in cs if c[2] > 1]) for cs in (sw, same)]
        outs = [_mean([c[2] for c in cs]) for cs in (sw, same)]
        lines.append(f"| {label} | {model} | {len(sw)} | {lat / same_lat:.2f}x | {100 * ttft / lat:.1f}% "
                     f"| {100 * (1 - ttft / lat):.1f}% | {outs[0]:.0f} / {outs[1]:.0f} | {tpot[0]:.1f} / {tpot[1]:.1f} "
                     f"| {100 * sum(c[4] for c in sw) / max(1, sum(c[3] for c in sw)):.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="a reproduce/sweep --out folder (its parts/)")
    p.add_argument("--policy", default="no-shadow", help="whose runs (default no-shadow)")
    p.add_argument("--label", default="main:", help="grid points whose label starts with this (default main:)")
    a = p.parse_args(argv)
    if not (a.out / "parts").is_dir():
        print(f"switch_cost: {a.out / 'parts'}: no such folder (a reproduce or sweep --out)", file=sys.stderr)
        return 2
    print(table(collect(a.out, a.policy, a.label)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
