"""Result folders: what ``simulate --out DIR`` and ``sweep --out DIR`` write,
and what ``shadowprefill plot DIR [DIR2]`` redraws.

A folder holds:

* ``calls.parquet``: one row per completed routed call of every run
  (:data:`CALL_FIELDS`: grid label, policy, seed, window, session, call index,
  model, switch or not, measured or not, TTFT, latency, prompt, cached and
  output tokens; output tokens are null where the engine did not report them);
* ``summary.json``: ``{"source", "comparisons": {label: {...}}, "notices"}``
  where each comparison is :func:`~shadow_sim.experiments.runner.summary_json`
  (baseline, oracle, number of runs, per policy and metric ``{"mean", "se"}``,
  steps by budget reason, silent policies, and ``normal_slo_promise``: what
  calibration promised the normal traffic beside what each policy got);
* ``table.txt``: the table with every column and its legend;
* ``cdf_switch_ttft.png``, ``cdf_switch_latency.png``: empirical CDFs of the
  measured switch calls' TTFT and latency, one line per policy (one panel
  per grid label);
* ``reductions.png``: bars of the call, switch-call and switch-TTFT latency
  reductions against the baseline, with ±1 standard error bars (none for a
  single run).

Invariant: the plots are drawn only from ``calls.parquet`` and
``summary.json`` (:func:`plot_folders`), so a folder redraws the same
figures later, and two folders compare on one figure.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from shadowcore.errors import ConfigError

CALL_FIELDS = ("label", "policy", "seed", "window", "session_id", "call_index", "model", "is_switch", "measured",
               "ttft_s", "latency_s", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens")
REDUCTIONS = (("call_latency_red", "LLM-call latency"), ("switch_latency_red", "switch-call latency"),
              ("switch_ttft_red", "switch-call TTFT"))
CDFS = (("cdf_switch_ttft.png", "ttft_s", "switch-call TTFT (s)"),
        ("cdf_switch_latency.png", "latency_s", "switch-call latency (s)"))
PLOTS = tuple(name for name, _, _ in CDFS) + ("reductions.png",)


def no_nan(x: Any) -> Any:
    """``x`` with every NaN float as ``None`` (JSON has no NaN)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [no_nan(v) for v in x]
    return x


def write_folder(out: Path, calls: Iterable[Mapping[str, Any]], comparisons: Mapping[str, Mapping[str, Any]],
                 table: str, source: str, notices: Sequence[str] = ()) -> list[Path]:
    """Write the folder ``out`` (created if needed); the paths written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    rows = [{k: row.get(k) for k in CALL_FIELDS} for row in calls]
    schema = pa.schema([("label", pa.string()), ("policy", pa.string()), ("seed", pa.int64()),
                        ("window", pa.string()), ("session_id", pa.string()), ("call_index", pa.int64()),
                        ("model", pa.string()), ("is_switch", pa.bool_()), ("measured", pa.bool_()),
                        ("ttft_s", pa.float64()), ("latency_s", pa.float64()), ("num_prompt_tokens", pa.int64()),
                        ("num_cached_tokens", pa.int64()), ("num_output_tokens", pa.int64())])
    paths = [out / "calls.parquet", out / "summary.json", out / "table.txt"]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), paths[0])
    summary = {"source": source, "comparisons": dict(comparisons), "notices": list(notices)}
    paths[1].write_text(json.dumps(no_nan(summary), indent=1))
    paths[2].write_text(table.rstrip("\n") + "\n")
    return paths + plot_folders([out], out)


def call_rows(tasks: Sequence[Any], records: Sequence[Any]) -> list[dict[str, Any]]:
    """The ``calls.parquet`` rows of an experiment's runs (runner tasks and their records)."""
    out = []
    for t, r in zip(tasks, records):
        for c in r.calls:
            out.append({"label": t.label, "policy": t.name, "seed": t.seed, "window": t.window,
                        "session_id": c.session_id, "call_index": c.call_index, "model": c.model,
                        "is_switch": c.is_switch, "measured": c.session_id in r.measured_sessions,
                        "ttft_s": c.ttft_s, "latency_s": c.latency_s, "num_prompt_tokens": c.num_prompt_tokens,
                        "num_cached_tokens": c.num_cached_tokens, "num_output_tokens": c.num_output_tokens})
    return out


def write_comparisons(out: Path, tasks: Sequence[Any], records: Sequence[Any], comparisons: Mapping[str, Any],
                      extra: Mapping[str, Any] | None = None) -> list[Path]:
    """A simulator experiment's folder: its calls, comparisons (runner ``Comparison``s) and wide tables;
    ``extra`` fields join every comparison's summary (e.g. the normal traffic's caps)."""
    from shadow_sim.experiments.runner import format_table, summary_json

    tables = [(f"== {label}\n" if label else "") + format_table(c, wide=True) for label, c in comparisons.items()]
    notices = list(dict.fromkeys(n for c in comparisons.values() for n in c.notices))
    summaries = {k: {**summary_json(c), **(extra or {})} for k, c in comparisons.items()}
    return write_folder(out, call_rows(tasks, records), summaries, "\n\n".join(tables), "sim", notices)


# -- reading ---------------------------------------------------------------------------------
def read_folder(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(call rows, summary) of a result folder; a missing or foreign folder is one ConfigError."""
    import pyarrow.parquet as pq

    calls, summary = folder / "calls.parquet", folder / "summary.json"
    for path in (calls, summary):
        if not path.is_file():
            raise ConfigError("plot", str(folder), f"not a result folder: no {path.name} "
                                                   "(write one with simulate --out or sweep --out)")
    try:
        data = json.loads(summary.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{summary}:{e.lineno}:{e.colno}", "", e.msg) from None
    if not isinstance(data, dict) or not isinstance(data.get("comparisons"), dict):
        raise ConfigError(str(summary), "", "has no 'comparisons' object: not written by simulate/sweep --out")
    return pq.read_table(calls).to_pylist(), data


# -- plots -----------------------------------------------------------------------------------
def _series_name(folder_tag: str, label: str, policy: str) -> str:
    return " ".join(x for x in (folder_tag, policy) if x)


def plot_folders(folders: Sequence[Path], out: Path) -> list[Path]:
    """Draw :data:`PLOTS` into ``out`` from one folder, or from two compared
    (their policies side by side, named ``A:`` and ``B:``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [read_folder(f) for f in folders]
    tags = [""] if len(folders) == 1 else [f"{chr(65 + i)}:" for i in range(len(folders))]
    labels = list(dict.fromkeys(label for _, s in loaded for label in s["comparisons"]))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, field, title in CDFS:
        fig, axes = plt.subplots(1, len(labels), figsize=(5.5 * len(labels), 3.8), squeeze=False)
        for ax, label in zip(axes[0], labels):
            for tag, (rows, summary) in zip(tags, loaded):
                comp = summary["comparisons"].get(label)
                for k, policy in enumerate((comp or {}).get("policies", {})):
                    xs = sorted(r[field] for r in rows if r["label"] == label and r["policy"] == policy
                                and r["is_switch"] and r["measured"] and r[field] is not None)
                    if xs:  # equal curves stay visible: dashes differ per policy, and by folder
                        ys = [(i + 1) / len(xs) for i in range(len(xs))]
                        style = (0, (6, 2)) if tag == "B:" else (0, (4 + 3 * (k % 3), 1 + k % 2)) if k else "-"
                        ax.step(xs, ys, where="post", label=f"{_series_name(tag, label, policy)} (n={len(xs)})",
                                linestyle=style, alpha=0.85)
            ax.set_xlabel(title)
            ax.set_ylabel("share of switch calls")
            ax.set_xlim(left=0)
            ax.set_ylim(0, 1.02)
            ax.set_title(f"CDF of {title}" + (f", {label}" if label else ""), fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        paths.append(_save(fig, out / name, plt))
    paths.append(_reductions(plt, loaded, tags, labels, out / "reductions.png"))
    if len(folders) > 1:
        notes = "\n".join(f"{tag} {f}" for tag, f in zip(tags, folders))
        (out / "compared.txt").write_text(notes + "\n")
        paths.append(out / "compared.txt")
    return paths


def _reductions(plt: Any, loaded: Sequence[tuple[list, dict]], tags: Sequence[str], labels: Sequence[str],
                path: Path) -> Path:
    fig, axes = plt.subplots(1, len(REDUCTIONS), figsize=(5.0 * len(REDUCTIONS), 3.8), squeeze=False)
    series = []  # (name, label -> comparison)
    bases = set()
    runs = []
    for tag, (_, summary) in zip(tags, loaded):
        comps = summary["comparisons"]
        for label in labels:
            c = comps.get(label)
            if c is not None:
                bases.add(c["baseline"])
                runs.append(c["runs"])
        policies = dict.fromkeys(p for c in comps.values() for p in c["policies"]
                                 if p != c["baseline"])
        series += [(f"{tag}{p}", p, comps) for p in policies]
    width = 0.8 / max(1, len(series))
    for ax, (metric, title) in zip(axes[0], REDUCTIONS):
        for j, (name, policy, comps) in enumerate(series):
            xs, ys, es = [], [], []
            for i, label in enumerate(labels):
                m = comps.get(label, {}).get("policies", {}).get(policy, {}).get(metric)
                if m is None or m.get("mean") is None:
                    continue
                xs.append(i + j * width)
                ys.append(100 * m["mean"])
                es.append(100 * m["se"] if m.get("se") is not None else 0.0)
            if xs:
                ax.bar(xs, ys, width, yerr=es if any(es) else None, capsize=3, label=name,
                       hatch="//" if name.startswith("B:") else None)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
        ax.set_xticklabels([label or "run" for label in labels], fontsize=8)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_ylabel("reduction (%)")
        ax.set_title(f"{title} reduction vs {', '.join(sorted(bases))}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    bars = "error bars: ±1 standard error over runs" if max(runs, default=1) > 1 else "one run: no error bars"
    fig.text(0.01, 0.01, bars, fontsize=7)
    return _save(fig, path, plt)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the plot command ------------------------------------------------------------------------
def plot_main(argv: Sequence[str]) -> int:
    """``shadowprefill plot DIR [DIR2] [--out OUT]``."""
    import argparse

    p = argparse.ArgumentParser(prog="shadowprefill plot",
                                description="Redraw a result folder's plots, or compare two folders on one set.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("folders", nargs="+", metavar="DIR", help="result folder(s) of simulate/sweep --out (one or two)")
    p.add_argument("--out", help="where to write the PNGs (default: DIR for one folder, DIR/compare for two)")
    args = p.parse_args(list(argv))
    if len(args.folders) > 2:
        raise ConfigError("plot", args.folders, "give one folder, or two to compare")
    folders = [Path(f) for f in args.folders]
    out = Path(args.out) if args.out else (folders[0] if len(folders) == 1 else folders[0] / "compare")
    paths = plot_folders(folders, out)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


__all__ = ["CALL_FIELDS", "PLOTS", "call_rows", "no_nan", "plot_folders", "plot_main", "read_folder",
           "write_comparisons", "write_folder"]
