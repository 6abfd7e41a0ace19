"""Microseconds per LatencyModel.predict_s call, Vidur tables vs roofline.

Usage: python benchmarks/latency_lookup.py [MODEL] [DEVICE] [TP]

The batch is 64 decodes (contexts 1000..3331) plus one 512-token prefill chunk
on 3000 cached tokens. The first run for a configuration trains Vidur's
predictor (~30-40 s on 2 cores, progress bar) and caches the tables under
``$SHADOWPREFILL_CACHE/vidur`` (default ``~/.cache/shadowprefill/vidur``).
"""

from __future__ import annotations

import sys
import time

from shadow_sim.latency import latency_model

from shadowcore.latency import BatchShape, PrefillChunk


def per_call_us(model, batch: BatchShape, n: int = 50_000) -> float:
    model.predict_s(batch)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            model.predict_s(batch)
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "Llama-3.1-8B"
    device = sys.argv[2] if len(sys.argv) > 2 else "H100-80GB"
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else None
    batch = BatchShape((PrefillChunk(512, 3000),), tuple(1000 + 37 * i for i in range(64)))
    started = time.perf_counter()
    vidur = latency_model(name, device, tp, kind="vidur")
    ready = time.perf_counter() - started
    roof = latency_model(name, device, tp, kind="roofline")
    print(f"{name} on {device}: vidur model ready in {ready:.1f} s")
    for label, model in (("vidur", vidur), ("roofline", roof)):
        print(
            f"  {label:9s} {per_call_us(model, batch):6.2f} us/call  predict_s = {model.predict_s(batch) * 1e3:.3f} ms"
        )


if __name__ == "__main__":
    main()
