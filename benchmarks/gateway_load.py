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

    python benchmarks/gateway_load.py                       # idle 0,1000,20000 x concurrency 1,8,32
    python benchmarks/gateway_load.py --idle 0 --concurrency 4 --sessions 64

Two axes: ``--idle`` (idle sessions the gateway holds while the measured
sessions run: each made by one call, then left alone; increasing, added
between cells) and ``--concurrency``. For every (idle, concurrency) cell the
direct and gateway phases run and the table prints added latency p50/p99 and
gateway CPU per call side by side, then the targets (CPU per call at the
largest idle count within 1.2x of the smallest; added p99 at concurrency 32 no
worse than 2x concurrency 8) and the gateway's RSS per idle session.

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
import itertools
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


async def _run_phase(urls_by_model: dict[str, list[str]], via_gateway: str | None, args: argparse.Namespace,
                     concurrency: int, prefix: str) -> tuple[list[float], list[float], int]:
    models = sorted(urls_by_model)
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    ttfbs: list[float] = []
    failures = 0
    deadline = time.monotonic() + args.max_s
    limits = httpx.Limits(max_connections=concurrency * 2)

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
                    url, headers = via_gateway + "/v1/completions", {"X-Session-Id": f"{prefix}{i}"}
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


async def _add_idle(gateway: str, start: int, stop: int, prompt_chars: int) -> int:
    """Sessions ``idle{start}..idle{stop-1}``: one call each (model alternating), then never again."""
    failures = 0
    sem = asyncio.Semaphore(32)
    async with httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=64)) as client:
        async def one(i: int) -> None:
            nonlocal failures
            body = {"model": ("small", "large")[i % 2], "prompt": _prompt(i, 0, prompt_chars), "max_tokens": 4}
            async with sem:
                try:
                    r = await client.post(gateway + "/v1/completions", json=body, headers={"X-Session-Id": f"idle{i}"})
                    failures += r.status_code != 200
                except httpx.HTTPError:
                    failures += 1

        await asyncio.gather(*(one(i) for i in range(start, stop)))
    return failures


def _rss_bytes(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("nan")


def _settle(url: str, timeout_s: float = 60.0) -> None:
    """Wait until the gateway's shadow submissions stop changing (idle sessions fully shadowed)."""
    def count() -> float:
        text = httpx.get(url + "/metrics", timeout=10).text
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                   if x.startswith("shadowprefill_gateway_shadow_requests_total"))
    deadline, last = time.monotonic() + timeout_s, -1.0
    while time.monotonic() < deadline:
        now = count()
        if now == last:
            return
        last = now
        time.sleep(1.0)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected non-negative integers")
    return out


def _config(urls_by_model: dict[str, list[str]], policy: str, port: int) -> str:
    return ("models:\n"
            + "".join(f"  {m}:\n    block_size: 16\n    instances:\n"
                      + "".join(f"      - {{url: {u}}}\n" for u in us) for m, us in urls_by_model.items())
            + f"shadow: {{policy: {policy}}}\nlisten: {{host: 127.0.0.1, port: {port}}}\n"
            + "upstream: {max_connections: 1024}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=32, help="measured sessions per phase")
    p.add_argument("--calls", type=int, default=6, help="calls per session")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="comma list (the concurrency axis)")
    p.add_argument("--idle", type=_ints, default=[0, 1000, 20000],
                   help="comma list, increasing: idle sessions the gateway holds (the idle axis)")
    p.add_argument("--idle-prompt-chars", type=int, default=2000, help="prompt size of an idle session's one call")
    p.add_argument("--prompt-chars", type=int, default=2000, help="prompt size (the fake tokenizes bytes)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--token-delay-s", type=float, default=0.001, help="fake decode time per token")
    p.add_argument("--max-s", type=float, default=120.0, help="time bound of each phase")
    p.add_argument("--policy", default="harvest-slo")
    p.add_argument("--variant", action="append", type=_parse_variant, metavar="LABEL:SRC:STACK",
                   help="a gateway to measure (repeatable); default gateway:.:auto")
    p.add_argument("--rounds", type=int, default=1, help="alternate the phases this many times per cell")
    args = p.parse_args(argv)
    if min(args.sessions, args.calls, args.rounds, *args.concurrency) < 1 or args.sessions * args.calls > 100_000:
        p.error("sessions, calls, concurrency and rounds must be >= 1, and sessions*calls <= 100000")
    if args.idle != sorted(args.idle) or args.idle[-1] > 200_000:
        p.error("--idle must be increasing and at most 200000")
    variants = args.variant or [("gateway", ".", "auto")]
    if len({v[0] for v in variants}) != len(variants) or "direct" in {v[0] for v in variants}:
        p.error("--variant labels must be distinct and not 'direct'")

    procs: list[subprocess.Popen] = []
    # (idle, concurrency, phase) -> [latencies, ttfbs, failures, wall s, gateway CPU s]
    cells: dict[tuple[int, int, str], list] = {}
    rss: dict[str, list[tuple[int, float]]] = {label: [] for label, _s, _t in variants}
    shadow_tokens: dict[str, float] = {}
    idle_failures = 0
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
                cfg.write_text(_config(urls_by_model, args.policy, port))
                procs.append(_start_gateway(src, stack, cfg))
                gw_urls[label] = f"http://127.0.0.1:{port}"
                gw_pids[label] = procs[-1].pid
            for u in [*gw_urls.values(), *urls]:
                _wait_healthy(u)
            num_idle = 0
            for idle in args.idle:
                for label, url in gw_urls.items():
                    idle_failures += asyncio.run(_add_idle(url, num_idle, idle, args.idle_prompt_chars))
                    _settle(url)
                    rss[label].append((idle, _rss_bytes(gw_pids[label])))
                num_idle = idle
                for conc in args.concurrency:
                    for r in range(args.rounds):
                        for name, via in [("direct", None), *gw_urls.items()]:
                            cell = cells.setdefault((idle, conc, name), [[], [], 0, 0.0, 0.0])
                            t0, cpu0 = time.monotonic(), _cpu_s(gw_pids[name]) if via else 0.0
                            lat, ttfb, failed = asyncio.run(
                                _run_phase(urls_by_model, via, args, conc, f"m{idle}-{conc}-{r}-"))
                            if via:
                                cell[4] += _cpu_s(gw_pids[name]) - cpu0
                            cell[0] += lat
                            cell[1] += ttfb
                            cell[2] += failed
                            cell[3] += time.monotonic() - t0
            for label, url in gw_urls.items():
                text = httpx.get(url + "/metrics").text
                shadow_tokens[label] = sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                                           if x.startswith("shadowprefill_gateway_shadow_tokens_submitted_total"))
    finally:
        for proc in reversed(procs):
            _stop(proc)
    return _report(args, variants, cells, rss, shadow_tokens, idle_failures)


def _report(args: argparse.Namespace, variants: list, cells: dict, rss: dict, shadow_tokens: dict,
            idle_failures: int) -> int:
    print(f"{args.sessions} measured sessions x {args.calls} calls x {args.rounds} rounds per cell, prompt "
          f"{args.prompt_chars} tokens, {args.max_tokens} output tokens, policy {args.policy}; idle sessions: one "
          f"call of {args.idle_prompt_chars} tokens each ({idle_failures} failed)")
    print(f"{'gateway':<10} {'idle':>6} {'conc':>4} {'calls':>6} {'failed':>6} {'direct p50':>10} "
          f"{'added p50':>9} {'added p99':>9} {'added TTFB p50':>14} {'gw CPU ms/call':>14}")
    failed_any = idle_failures > 0
    for label, _src, stack in variants:
        for (idle, conc, name), g in cells.items():
            if name != label:
                continue
            d = cells[(idle, conc, "direct")]
            failed_any |= bool(g[2] or d[2])
            cpu = g[4] * 1e3 / max(1, len(g[0]) + g[2])
            print(f"{label:<10} {idle:>6} {conc:>4} {len(g[0]):>6} {g[2] + d[2]:>6} {_pct(d[0], 50):>10.2f} "
                  f"{_pct(g[0], 50) - _pct(d[0], 50):>+9.2f} {_pct(g[0], 99) - _pct(d[0], 99):>+9.2f} "
                  f"{_pct(g[1], 50) - _pct(d[1], 50):>+14.2f} {cpu:>14.2f}")
        _targets(label, args, cells, rss[label])
        print(f"{label} ({stack}): shadow tokens submitted {shadow_tokens.get(label, 0):.0f}")
    return 1 if failed_any else 0


def _targets(label: str, args: argparse.Namespace, cells: dict, rss: list[tuple[int, float]]) -> None:
    def cpu(idle: int, conc: int) -> float:
        g = cells[(idle, conc, label)]
        return g[4] / max(1, len(g[0]) + g[2])

    def added_p99(idle: int, conc: int) -> float:
        return _pct(cells[(idle, conc, label)][0], 99) - _pct(cells[(idle, conc, "direct")][0], 99)

    lo, hi = args.idle[0], args.idle[-1]
    if lo != hi:
        for conc in args.concurrency:
            ratio = cpu(hi, conc) / cpu(lo, conc)
            print(f"target: CPU per call at {hi} idle / at {lo} idle, concurrency {conc}: {ratio:.2f}x "
                  f"(target <= 1.20x: {'met' if ratio <= 1.2 else 'MISSED'})")
    if 8 in args.concurrency and 32 in args.concurrency:
        for idle in args.idle:
            p8, p32 = added_p99(idle, 8), added_p99(idle, 32)
            ok = p32 <= 2 * max(p8, 0.0)
            print(f"target: added p99 at concurrency 32 vs 8, {idle} idle: {p32:+.2f} ms vs {p8:+.2f} ms "
                  f"(target <= 2x: {'met' if ok else 'MISSED'})")
    for (n0, r0), (n1, r1) in itertools.pairwise(rss):
        if n1 > n0:
            print(f"RSS per idle session, {n0} -> {n1} idle: {(r1 - r0) / (n1 - n0) / 1024:.2f} KiB "
                  f"(gateway RSS {r1 / 2**20:.0f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
