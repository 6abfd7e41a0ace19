"""Load on the session gateway: many concurrent agent sessions against fake
OpenAI-compatible upstreams on loopback; prints the latency the gateway adds
at p50 and p99.

Two phases run the same workload (same sessions, prompts and models): first
straight to the upstreams (the client picks the instance), then through the
gateway (``shadowprefill serve`` in its own process, shadow policy on, so
shadow submission runs during the load). The gateway's added latency is the
difference of the two phases' percentiles, for whole calls and for time to
first byte of streamed calls; the gateway process's CPU time per call (from
``/proc``, Linux) is printed too, as it depends less on other load on the
machine than the latencies do. Bounded: ``--sessions`` x ``--calls`` calls,
at most ``--concurrency`` in flight, and every phase stops at ``--max-s``.

    python benchmarks/gateway_load.py --sessions 64 --calls 6 --concurrency 32

To compare gateway versions side by side in one run, pass ``--variant``
once per gateway: ``LABEL:SRC:STACK`` where SRC is a directory holding an
older ``backends/shadow_gateway`` (e.g. ``git archive HEAD backends/shadow_gateway
| tar -x -C /tmp/head``; ``.`` for this checkout) and STACK is ``auto``
(uvicorn picks uvloop and httptools when installed) or ``plain`` (pure-Python
asyncio loop and h11 parser, as without them). Each variant is its own
gateway process on the same upstreams, and the phases alternate in rounds
(``--rounds``), so drifting machine load hits every phase alike.

    python benchmarks/gateway_load.py --concurrency 4 --policy no-shadow \
        --variant head:/tmp/head:plain --variant new:.:auto

Everything runs on 127.0.0.1; the upstream processes and the gateways are
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


# Launches ``shadow_gateway.serve``; ``plain`` hides uvloop and httptools from uvicorn.
_LAUNCH = ("import sys\n"
           "if sys.argv[1] == 'plain':\n"
           "    sys.modules['uvloop'] = sys.modules['httptools'] = None\n"
           "from shadow_gateway.serve import main\n"
           "sys.exit(main(sys.argv[2:]))\n")


def _start_gateway(src: str, stack: str, cfg: Path) -> subprocess.Popen:
    env = dict(os.environ)
    if src != ".":
        backends = str(Path(src).resolve() / "backends")
        if not (Path(backends) / "shadow_gateway" / "gateway.py").is_file():
            raise SystemExit(f"--variant: {backends}/shadow_gateway/gateway.py does not exist")
        env["PYTHONPATH"] = backends + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-c", _LAUNCH, stack, "--config", str(cfg), "--log-level", "warning"],
                            env=env, start_new_session=True)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process used so far; NaN off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _parse_variant(text: str) -> tuple[str, str, str]:
    parts = text.split(":")
    if len(parts) != 3 or not parts[0] or parts[2] not in ("auto", "plain"):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected LABEL:SRC:STACK with STACK auto or plain")
    return parts[0], parts[1], parts[2]


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
    p.add_argument("--variant", action="append", type=_parse_variant, metavar="LABEL:SRC:STACK",
                   help="a gateway to measure (repeatable); default gateway:.:auto")
    p.add_argument("--rounds", type=int, default=1, help="alternate the phases this many times")
    args = p.parse_args(argv)
    if min(args.sessions, args.calls, args.concurrency, args.rounds) < 1 or args.sessions * args.calls > 100_000:
        p.error("sessions, calls, concurrency and rounds must be >= 1, and sessions*calls <= 100000")
    variants = args.variant or [("gateway", ".", "auto")]
    if len({v[0] for v in variants}) != len(variants) or "direct" in {v[0] for v in variants}:
        p.error("--variant labels must be distinct and not 'direct'")

    procs: list[subprocess.Popen] = []
    results: dict[str, list] = {"direct": [[], [], 0, 0.0, float("nan")]}
    metrics: dict[str, str] = {}
    try:
        fakes = _start([sys.executable, "-m", "shadow_gateway.fake_upstream", "--count", "4",
                        "--token-delay-s", str(args.token_delay_s)])
        procs.append(fakes)
        urls = [fakes.stdout.readline().strip() for _ in range(4)]
        urls_by_model = {"small": urls[:2], "large": urls[2:]}
        with tempfile.TemporaryDirectory() as tmp:
            gw_urls, gw_pids = {}, {}
            for k, (label, src, stack) in enumerate(variants):
                cfg = Path(tmp) / f"gateway-{k}.yaml"
                port = 18000 + (os.getpid() * 7 + k) % 1000
                cfg.write_text(
                    "models:\n"
                    + "".join(f"  {m}:\n    block_size: 16\n    instances:\n"
                              + "".join(f"      - {{url: {u}}}\n" for u in us) for m, us in urls_by_model.items())
                    + f"shadow: {{policy: {args.policy}}}\nlisten: {{host: 127.0.0.1, port: {port}}}\n"
                    + "upstream: {max_connections: 1024}\n"
                )
                procs.append(_start_gateway(src, stack, cfg))
                gw_urls[label] = f"http://127.0.0.1:{port}"
                gw_pids[label] = procs[-1].pid
                results[label] = [[], [], 0, 0.0, 0.0]
            for u in [*gw_urls.values(), *urls]:
                _wait_healthy(u)
            for _ in range(args.rounds):
                for name, via in [("direct", None), *gw_urls.items()]:
                    t0, cpu0 = time.monotonic(), _cpu_s(gw_pids[name]) if via else 0.0
                    lat, ttfb, failed = asyncio.run(_run_phase(urls_by_model, via, args))
                    r = results[name]
                    if via:
                        r[4] += _cpu_s(gw_pids[name]) - cpu0
                    r[0] += lat
                    r[1] += ttfb
                    r[2] += failed
                    r[3] += time.monotonic() - t0
            for label, url in gw_urls.items():
                metrics[label] = httpx.get(url + "/metrics").text
    finally:
        for proc in reversed(procs):
            _stop(proc)

    print(f"{args.sessions} sessions x {args.calls} calls x {args.rounds} rounds, concurrency {args.concurrency}, "
          f"prompt {args.prompt_chars} tokens, {args.max_tokens} output tokens, policy {args.policy}")
    print(f"{'phase':<10} {'calls':>6} {'failed':>6} {'wall s':>7} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'TTFB p50':>9} {'TTFB p99':>9} {'gw CPU ms/call':>15}")
    for name, (lat, ttfb, failed, wall, cpu) in results.items():
        print(f"{name:<10} {len(lat):>6} {failed:>6} {wall:>7.1f} {_pct(lat, 50):>8.2f} {_pct(lat, 99):>8.2f} "
              f"{_pct(ttfb, 50):>9.2f} {_pct(ttfb, 99):>9.2f} {cpu * 1e3 / max(1, len(lat) + failed):>15.2f}")
    d = results["direct"]
    for label, _src, stack in variants:
        g = results[label]
        shadow = [line for line in metrics[label].splitlines()
                  if line.startswith("shadowprefill_gateway_shadow_tokens_submitted_total")]
        print(f"{label} ({stack}) added latency: p50 {_pct(g[0], 50) - _pct(d[0], 50):+.2f} ms, "
              f"p99 {_pct(g[0], 99) - _pct(d[0], 99):+.2f} ms (whole call); "
              f"TTFB p50 {_pct(g[1], 50) - _pct(d[1], 50):+.2f} ms, p99 {_pct(g[1], 99) - _pct(d[1], 99):+.2f} ms; "
              f"shadow tokens submitted {sum(float(x.rsplit(' ', 1)[1]) for x in shadow):.0f}")
    return 0 if not any(r[2] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
