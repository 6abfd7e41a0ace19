"""CPU cost of one engine iteration against the decode batch size, with the
per-iteration events held constant: issue 17's "flat in batch size".

    python benchmarks/batch_cost.py                      # batches 16, 64, 256
    python benchmarks/batch_cost.py --batches 8,128 --iterations 3000

One :class:`~shadowcore.engine.instance.EngineInstance` (no hook, linear
latency, a KV pool large enough that nothing is evicted, room for ``B + 8``
sequences) runs ``B`` normal
requests that decode throughout (prompt 64, output longer than the run) and,
every iteration, one new request of a 256-token prompt and one output token:
each iteration is a mixed one (B decodes + one prefill chunk), with one
admission and one finish. The figure is CPU microseconds per iteration over
``--iterations`` iterations after the decodes started. The decodes' block
boundaries (one block per decode every ``block_size`` tokens, B / 16 per
iteration) are taken per phase into the instance's decode pool, O(1) per
iteration (``EngineInstance._reserve_due``); a per-request engine grows by the
whole batch. The same script runs against an older checkout (its
``PYTHONPATH``) for before/after.
"""

from __future__ import annotations

import argparse
import sys
import time


def per_iteration_us(batch: int, iterations: int, block_size: int = 16) -> float:
    from shadowcore.engine.instance import EngineInstance, EngineLimits, EngineRequest, append_output_to_history
    from shadowcore.job import SessionHistory
    from shadowcore.kv import KVClassManager
    from shadowcore.latency import LinearLatencyModel
    from shadowcore.types import RequestKind

    per_req = (64 + iterations + 200) // block_size + 2
    kv = KVClassManager(batch * per_req + 4 * (iterations + 100), block_size)
    inst = EngineInstance("i0", "m", kv, LinearLatencyModel(), 0.05, EngineLimits(2048, batch + 8))

    def request(rid: str, prompt: int, output: int, now_s: float) -> EngineRequest:
        history = SessionHistory(rid)
        history.append(prompt)
        return EngineRequest(rid, RequestKind.NORMAL, history, prompt, output, now_s, 10.0, 0.05,
                             on_token=append_output_to_history)

    now = 0.0
    for i in range(batch):
        inst.enqueue(request(f"d{i}", 64, 10**9, now))

    def step(k: int) -> None:
        nonlocal now
        inst.enqueue(request(f"p{k}", 256, 1, now))
        end = inst.start_step(now)
        inst.end_step(end)
        now = end

    for k in range(50):  # every decode started
        step(k)
    c0 = time.process_time()
    for k in range(50, 50 + iterations):
        step(k)
    return 1e6 * (time.process_time() - c0) / iterations


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--json", action="store_true", help="print [[batch, us per iteration], ...] only "
                                                         "(benchmarks/scale.py reads it)")
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",")]
    rows = [(b, per_iteration_us(b, a.iterations)) for b in batches]
    if a.json:
        import json

        print(json.dumps(rows))
        return 0
    print(f"{'decodes':>8} {'us/iteration':>13}  (one prefill chunk, one admission, one finish each)")
    for b, us in rows:
        print(f"{b:>8} {us:>13.1f}")
    (b0, u0), (b1, u1) = rows[0], rows[-1]
    print(f"{b1 / b0:.0f}x the batch: {u1 / u0:.2f}x the cost per iteration "
          f"[target: flat in batch size (1.0x); per-request: ~{b1 / b0:.0f}x]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
