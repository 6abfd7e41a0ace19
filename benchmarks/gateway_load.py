"""Load on the session gateway: many concurrent agent sessions against fake
OpenAI-compatible upstreams on loopback; prints the latency the gateway adds
at p50 and p99.

Two phases run the same workload (same sessions, prompts and models): first
straight to the upstreams (the client picks the instance), then through the
gateway (``shadowprefill serve`` in its own process, shadow policy on, so
shadow submission runs during the load). The gateway's added latency is the
difference of the two phases' percentiles, for whole calls and for time to
first byte of streamed calls. Bounded: ``--sessions`` x ``--calls`` calls,
at most ``--concurrency`` in flight, and every phase stops at ``--max-s``.

    python benchmarks/gateway_load.py --sessions 64 --calls 6 --concurrency 32

Everything runs on 127.0.0.1; the upstream processes and the gateway are
stopped at the end (also on errors).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


def _prompt(session: int, call: int, num_tokens: int) -> str:
    base = f"session {session} " + "the agent reads a file and plans an edit. " * (num_tokens // 42 + 1)
    return base[:num_tokens] + "".join(f" step {k}." for k in range(call))


async def _run_phase(urls_by_model: dict[str, list[str]], via_gateway: str | None, args: argparse.Namespace
                     ) -> tuple[list[float], list[float], int]:
    models = sorted(urls_by_model)
    sem = asyncio.Semaphore(args.concurrency)
    latencies: list[float] = []
    ttfbs: list[float] = []
    failures = 0
    deadline = time.monotonic() + args.max_s
    limits = httpx.Limits(max_connections=args.concurrency * 2)

    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        async def session(i: int) -> None:
            nonlocal failures
            for k in range(args.calls):
                if time.monotonic() > deadline:
                    return
                model = models[(i + k // 2) % len(models)]  # a switch every second call
                stream = k % 2 == 1
                body = {"model": model, "prompt": _prompt(i, k, args.prompt_chars), "max_tokens": args.max_tokens,
                        "stream": stream}
                if via_gateway:
                    url, headers = via_gateway + "/v1/completions", {"X-Session-Id": f"s{i}"}
                else:
                    instances = urls_by_model[model]
                    url, headers = instances[i % len(instances)] + "/v1/completions", {}
                async with sem:
                    t0 = time.perf_counter()
                    try:
                        async with client.stream("POST", url, json=body, headers=headers) as r:
                            first = None
                            async for _ in r.aiter_bytes():
                                if first is None:
                                    first = time.perf_counter() - t0
                            if r.status_code != 200:
                                failures += 1
                                continue
                    except httpx.HTTPError:
                        failures += 1
                        continue
                    latencies.append(time.perf_counter() - t0)
                    if stream and first is not None:
                        ttfbs.append(first)

        await asyncio.gather(*(session(i) for i in range(args.sessions)))
    return latencies, ttfbs, failures


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--calls", type=int, default=6, help="calls per session")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-chars", type=int, default=2000, help="prompt size (the fake tokenizes bytes)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--token-delay-s", type=float, default=0.001, help="fake decode time per token")
    p.add_argument("--max-s", type=float, default=120.0, help="time bound of each phase")
    p.add_argument("--policy", default="harvest-slo")
    args = p.parse_args(argv)
    if min(args.sessions, args.calls, args.concurrency) < 1 or args.sessions * args.calls > 100_000:
        p.error("sessions, calls and concurrency must be >= 1, and sessions*calls <= 100000")

    procs: list[subprocess.Popen] = []
    try:
        fakes = _start([sys.executable, "-m", "shadow_gateway.fake_upstream", "--count", "4",
                        "--token-delay-s", str(args.token_delay_s)])
        procs.append(fakes)
        urls = [fakes.stdout.readline().strip() for _ in range(4)]
        urls_by_model = {"small": urls[:2], "large": urls[2:]}
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "gateway.yaml"
            port = 18000 + os.getpid() % 1000
            cfg.write_text(
                "models:\n"
                + "".join(f"  {m}:\n    block_size: 16\n    instances:\n"
                          + "".join(f"      - {{url: {u}}}\n" for u in us) for m, us in urls_by_model.items())
                + f"shadow: {{policy: {args.policy}}}\nlisten: {{host: 127.0.0.1, port: {port}}}\n"
                + "upstream: {max_connections: 1024}\n"
            )
            gw = _start([sys.executable, "-m", "shadow_gateway.serve", "--config", str(cfg), "--log-level",
                         "warning"])
            procs.append(gw)
            gw_url = f"http://127.0.0.1:{port}"
            _wait_healthy(gw_url)
            for u in urls:
                _wait_healthy(u)
            results = {}
            for name, via in (("direct", None), ("gateway", gw_url)):
                t0 = time.monotonic()
                lat, ttfb, failed = asyncio.run(_run_phase(urls_by_model, via, args))
                results[name] = (lat, ttfb, failed, time.monotonic() - t0)
            metrics = httpx.get(gw_url + "/metrics").text
    finally:
        for proc in reversed(procs):
            _stop(proc)

    print(f"{args.sessions} sessions x {args.calls} calls, concurrency {args.concurrency}, "
          f"prompt {args.prompt_chars} tokens, {args.max_tokens} output tokens, policy {args.policy}")
    print(f"{'phase':<8} {'calls':>6} {'failed':>6} {'wall s':>7} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'TTFB p50':>9} {'TTFB p99':>9}")
    for name, (lat, ttfb, failed, wall) in results.items():
        print(f"{name:<8} {len(lat):>6} {failed:>6} {wall:>7.1f} {_pct(lat, 50):>8.2f} {_pct(lat, 99):>8.2f} "
              f"{_pct(ttfb, 50):>9.2f} {_pct(ttfb, 99):>9.2f}")
    d, g = results["direct"], results["gateway"]
    print(f"gateway added latency: p50 {_pct(g[0], 50) - _pct(d[0], 50):+.2f} ms, "
          f"p99 {_pct(g[0], 99) - _pct(d[0], 99):+.2f} ms (whole call); "
          f"TTFB p50 {_pct(g[1], 50) - _pct(d[1], 50):+.2f} ms, p99 {_pct(g[1], 99) - _pct(d[1], 99):+.2f} ms")
    shadow = [line for line in metrics.splitlines()
              if line.startswith("shadowprefill_gateway_shadow_tokens_submitted_total")]
    print("shadow tokens submitted during the gateway phase: "
          f"{sum(float(x.rsplit(' ', 1)[1]) for x in shadow):.0f}")
    return 0 if not d[2] and not g[2] else 1


if __name__ == "__main__":
    sys.exit(main())
