"""How far the simulator's latency model is from a real GPU, per batch shape.

Times prefill and decode iterations of catalog model shapes with PyTorch only
(no vLLM: random bf16 weights, ``--layers`` decoder layers of the model's real
widths, scaled up to the model's layer count) on the GPU it finds, and prints
the relative error of the latency model for that device per shape, with the
median and p90 of the absolute error per model.

Two columns of error, because the two sides measure different things:

* ``model``: against the latency model's per-layer part (Vidur's
  ``model_time``: GEMMs and attention of every layer), which is what the timed
  layers run. This is the kernel-level check.
* ``iter``: against the whole predicted iteration (``predict_s``: plus LM head,
  embedding, KV writes, sampling and the engine's CPU overhead), which the
  timed layers do NOT run; it bounds the overhead terms from above.

What it does not measure: tensor-parallel all-reduce (a model with ``tp > 1``
is timed as one rank's shard: heads and FFN width divided by ``tp``; its rows
say so), paged KV and FlashAttention's varlen kernels (attention here is
PyTorch's ``scaled_dot_product_attention``, with an explicit causal mask when a
chunk has cached context), MoE models (skipped, named).

Runs, in order of use:

    # on a machine with the sim extra: predictions for both catalog GPUs
    python benchmarks/gpu_latency_check.py --predict preds.json
    # on the GPU machine (PyTorch only): measure and compare
    python benchmarks/gpu_latency_check.py --predictions preds.json --out gpu.json
    # both at once where both are installed and a GPU is present
    python benchmarks/gpu_latency_check.py
    # CI: tiny shapes on the CPU, roofline predictions; checks that it runs
    python benchmarks/gpu_latency_check.py --dry

In ``--dry`` mode the measured model is the catalog model shrunk 64x in width
and the errors mean nothing: it exercises every step of the pipeline.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

PREFILLS = ((512, 0), (2048, 0), (2048, 8192), (1024, 16384))  # (new tokens, cached context)
DECODES = ((1, 1024), (16, 2048), (64, 2048), (128, 8192))  # (sequences, context each)
DRY_PREFILLS = ((32, 0), (32, 64))
DRY_DECODES = ((1, 32), (4, 64))
DEFAULT_MODELS = ("Qwen2.5-7B", "Llama-3.1-8B", "Llama-3.1-70B")
DEVICES = ("H100-80GB", "H200")


def shapes(dry: bool) -> list[dict]:
    pre, dec = (DRY_PREFILLS, DRY_DECODES) if dry else (PREFILLS, DECODES)
    out = [{"kind": "prefill", "tokens": q, "context": c} for q, c in pre]
    return out + [{"kind": "decode", "seqs": b, "context": c} for b, c in dec]


def shape_key(s: dict) -> str:
    if s["kind"] == "prefill":
        return f"prefill q={s['tokens']} ctx={s['context']}"
    return f"decode b={s['seqs']} ctx={s['context']}"


# ----------------------------------------------------------------------------- predictions
def predict(models: list[str], latency: str, dry: bool) -> dict:
    """Predicted seconds per shape, model and device (needs shadow_sim)."""
    from shadow_sim.hardware import get_device, tensor_parallel_degree
    from shadow_sim.latency import latency_model
    from shadow_sim.models import get_model

    from shadowcore.latency import BatchShape, PrefillChunk

    out: dict = {"latency": latency, "dry": dry, "models": {}}
    for name in models:
        m = get_model(name)
        entry = {"num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_heads": m.num_heads,
                 "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "intermediate_size": m.intermediate_size,
                 "moe": m.num_experts > 1, "devices": {}}
        for dev in DEVICES:
            tp = tensor_parallel_degree(m, get_device(dev))
            lm = latency_model(m, dev, tp, kind=latency, **({"progress": False} if latency == "vidur" else {}))
            rows = {}
            for s in shapes(dry):
                if s["kind"] == "prefill":
                    batch = BatchShape(prefills=(PrefillChunk(s["tokens"], s["context"]),))
                else:
                    batch = BatchShape(decode_context_tokens=(s["context"],) * s["seqs"])
                model_s = lm.vidur_model_time_s(batch) if hasattr(lm, "vidur_model_time_s") else None
                rows[shape_key(s)] = {"iter_s": lm.predict_s(batch), "model_s": model_s}
            entry["devices"][dev] = {"tp": tp, "shapes": rows}
        out["models"][name] = entry
    return out


# ----------------------------------------------------------------------------- measurement
def _layer_weights(torch, dims: dict, device, dtype):
    h, nh, kvh, d, f = dims["hidden_size"], dims["num_heads"], dims["num_kv_heads"], dims["head_dim"], dims["inter"]
    w = lambda *shape: torch.randn(*shape, device=device, dtype=dtype) * 0.02
    return {"qkv": w(h, (nh + 2 * kvh) * d), "o": w(nh * d, h), "up": w(h, 2 * f), "down": w(f, h),
            "n1": torch.ones(h, device=device, dtype=dtype), "n2": torch.ones(h, device=device, dtype=dtype)}


def _rms(torch, x, g):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * g


def _layer(torch, F, x, wt, dims, kv_cache, mask):
    """One Llama-style decoder layer: x (B, T, h); kv_cache (B, kvh, C, d) pairs or None."""
    nh, kvh, d = dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]
    b, t, _ = x.shape
    qkv = _rms(torch, x, wt["n1"]) @ wt["qkv"]
    q, k, v = qkv.split((nh * d, kvh * d, kvh * d), dim=-1)
    q = q.view(b, t, nh, d).transpose(1, 2)
    k = k.view(b, t, kvh, d).transpose(1, 2)
    v = v.view(b, t, kvh, d).transpose(1, 2)
    if kv_cache is not None:
        k = torch.cat((kv_cache[0], k), dim=2)
        v = torch.cat((kv_cache[1], v), dim=2)
    causal = mask is None and t > 1
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=nh != kvh)
    x = x + a.transpose(1, 2).reshape(b, t, nh * d) @ wt["o"]
    gate, up = (_rms(torch, x, wt["n2"]) @ wt["up"]).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ wt["down"]


def measure(entry: dict, tp: int, dry: bool, layers: int, repeats: int) -> dict[str, float]:
    """Measured seconds per shape for the whole model (timed layers scaled to num_layers)."""
    import torch
    import torch.nn.functional as F

    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shrink = 64 if dry else 1
    dims = {"hidden_size": max(8, entry["hidden_size"] // shrink),
            "num_heads": max(1, entry["num_heads"] // tp // (8 if dry else 1)),
            "num_kv_heads": max(1, entry["num_kv_heads"] // tp // (8 if dry else 1)),
            "head_dim": entry["head_dim"] if not dry else 8,
            "inter": max(8, entry["intermediate_size"] // tp // shrink)}
    weights = [_layer_weights(torch, dims, device, dtype) for _ in range(layers)]
    out = {}
    for s in shapes(dry):
        if s["kind"] == "prefill":
            b, t, c = 1, s["tokens"], s["context"]
        else:
            b, t, c = s["seqs"], 1, s["context"]
        x = torch.randn(b, t, dims["hidden_size"], device=device, dtype=dtype)
        cache = None
        if c:
            shape = (b, dims["num_kv_heads"], c, dims["head_dim"])
            cache = (torch.randn(*shape, device=device, dtype=dtype), torch.randn(*shape, device=device, dtype=dtype))
        mask = None
        if c and t > 1:  # causal with an offset: row i sees the context and new tokens <= i
            mask = torch.ones(t, c + t, device=device, dtype=torch.bool).tril(diagonal=c)

        def run(x=x, cache=cache, mask=mask):
            y = x
            for wt in weights:
                y = _layer(torch, F, y, wt, dims, cache, mask)
            return y

        times = []
        with torch.inference_mode():
            for i in range(repeats + 2):  # two warm-ups
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    run()
                    end.record()
                    torch.cuda.synchronize()
                    dt = start.elapsed_time(end) * 1e-3
                else:
                    t0 = time.perf_counter()
                    run()
                    dt = time.perf_counter() - t0
                if i >= 2:
                    times.append(dt)
        out[shape_key(s)] = statistics.median(times) * entry["num_layers"] / layers
    return out


# ----------------------------------------------------------------------------- comparison
def relative_errors(predicted: dict[str, float | None], measured: dict[str, float]) -> dict[str, float | None]:
    """(predicted - measured) / measured per shape; None where there is no prediction."""
    missing = sorted(set(measured) - set(predicted))
    if missing:
        raise SystemExit(f"gpu_latency_check: the predictions have no entry for shape(s) {', '.join(missing)} "
                         "(made with other shapes or --dry: rerun --predict with the same mode)")
    return {k: (None if predicted[k] is None else (predicted[k] - m) / m) for k, m in measured.items()}


def abs_quantiles(errors: list[float]) -> tuple[float, float]:
    """Median and p90 (nearest rank) of the absolute errors."""
    a = sorted(abs(e) for e in errors)
    if not a:
        return math.nan, math.nan
    return statistics.median(a), a[min(len(a) - 1, math.ceil(0.9 * len(a)) - 1)]


def device_name(dry: bool) -> str:
    """The catalog device the measurements stand for."""
    if dry:
        return "H100-80GB"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_latency_check: no CUDA device found (use --dry on a CPU)")
    name = torch.cuda.get_device_name(0)
    for key, dev in (("H200", "H200"), ("H100", "H100-80GB")):
        if key in name:
            return dev
    raise SystemExit(f"gpu_latency_check: GPU {name!r} is not in the catalog ({', '.join(DEVICES)})")


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:+.1f}%"


def compare(preds: dict, dry: bool, layers: int, repeats: int) -> dict:
    dev = device_name(dry)
    report = {"device": dev, "dry": dry, "layers": layers, "models": {}}
    print(f"device {dev}{' (dry run on the CPU: errors are meaningless)' if dry else ''}; "
          f"latency model {preds['latency']}; {layers} timed layer(s) scaled to the model's count")
    print(f"{'model':<20} {'shape':<24} {'measured':>11} {'predicted':>11} {'err model':>10} {'err iter':>10}")
    for name, entry in preds["models"].items():
        if entry["moe"]:
            print(f"{name:<20} skipped: MoE layers are not timed by this check")
            continue
        d = entry["devices"][dev]
        tp = d["tp"]
        measured = measure(entry, tp, dry, layers, repeats)
        err_model = relative_errors({k: v["model_s"] for k, v in d["shapes"].items()}, measured)
        err_iter = relative_errors({k: v["iter_s"] for k, v in d["shapes"].items()}, measured)
        label = name + (f" tp{tp}*" if tp > 1 else "")
        for k, m in measured.items():
            p = d["shapes"][k]["iter_s"]
            print(f"{label:<20} {k:<24} {m * 1e3:>9.2f}ms {p * 1e3:>9.2f}ms {_pct(err_model[k]):>10} "
                  f"{_pct(err_iter[k]):>10}")
        qm = abs_quantiles([e for e in err_model.values() if e is not None])
        qi = abs_quantiles(list(err_iter.values()))
        print(f"{label:<20} |error| median / p90: model {_pct(qm[0])} / {_pct(qm[1])}, "
              f"iteration {_pct(qi[0])} / {_pct(qi[1])}")
        report["models"][name] = {"tp": tp, "measured_s": measured, "error_model": err_model, "error_iter": err_iter,
                                  "abs_error_model_median_p90": qm, "abs_error_iter_median_p90": qi}
    if any(e["devices"][dev]["tp"] > 1 for e in preds["models"].values() if not e["moe"]):
        print("* tp>1: one rank's shard timed; the prediction includes the all-reduce, the measurement does not")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help="catalog models, comma separated")
    ap.add_argument("--latency", default=None, choices=("vidur", "roofline"),
                    help="latency model to check (default: vidur; roofline with --dry)")
    ap.add_argument("--predict", metavar="FILE", help="only write the predictions to FILE (needs the sim extra)")
    ap.add_argument("--predictions", metavar="FILE", help="read predictions made with --predict (GPU machine)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers timed (scaled to the model's count)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repetitions per shape (median taken)")
    ap.add_argument("--dry", action="store_true", help="tiny shapes on the CPU: check that every step runs")
    ap.add_argument("--out", metavar="FILE", help="write the comparison as JSON")
    a = ap.parse_args(argv)
    if a.layers < 1 or a.repeats < 1:
        ap.error("--layers and --repeats must be at least 1")
    latency = a.latency or ("roofline" if a.dry else "vidur")
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    if a.predictions:
        try:
            preds = json.loads(Path(a.predictions).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"gpu_latency_check: {a.predictions}: {e}") from None
        if preds.get("dry") != a.dry:
            raise SystemExit(f"gpu_latency_check: {a.predictions} was made {'with' if preds.get('dry') else 'without'}"
                             " --dry; measure in the same mode")
    else:
        preds = predict(models, latency, a.dry)
    if a.predict:
        Path(a.predict).write_text(json.dumps(preds, indent=1))
        print(f"wrote predictions for {len(preds['models'])} model(s) x {len(DEVICES)} devices to {a.predict}")
        return 0
    report = compare(preds, a.dry, a.layers, a.repeats)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
