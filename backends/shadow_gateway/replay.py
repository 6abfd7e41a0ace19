"""``shadowprefill replay --sessions FILE --gateway URL``: play a session trace
against a running gateway (and the real engines behind it), bounded, and
report the same per-call figures the simulator's table is made of.

Each session's calls go out in order: call 0 at the session's arrival offset
(times ``--time-scale``), each later call its tool gap after the previous one
ended. At most ``--max-sessions`` sessions are in flight; a session waiting for
a slot starts late, and the report says how many did. A call is a streamed
``/v1/completions`` request whose prompt is TOKEN IDS, so the engines see
exactly the trace's token counts: the session's context (the previous prompt
and the ids the engine generated) plus ``input_tokens`` new synthetic ids
(deterministic per session and call, in ``[10, vocab_size)``; a compaction
replaces the context by ``compact_to_tokens`` synthetic ids).
``max_tokens`` = ``min_tokens`` = ``output_tokens`` with ``ignore_eos`` (vLLM's
sampling extensions) fix the output length. The model is the recorded one
(``--model-map REC=MODEL``; a call without a model is an error): the gateway
must route by the client's model (its ``client-model`` router) for the replay
to reproduce the trace's routing.

Headers: ``X-Session-Id`` = ``--session-prefix`` + the trace's id, and
``X-Session-Task`` when the session has a task; ``--api-key`` as a bearer token.

A failed call (status, connection error, a stream without usage) ends its
session; failures are counted and printed, never dropped. ``--out FILE``
writes what was observed as a session trace (the same calls with their
measured latency and the cached tokens the engines reported).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence

import attrs
import httpx

from shadow_traces.session_trace import (
    SessionTrace,
    SessionTraceWriter,
    TraceHeader,
    TraceSession,
    read_session_trace,
)
from shadowcore.errors import ConfigError, ShadowError

__all__ = ["ObservedCall", "ReplayReport", "main", "replay", "synthetic_ids"]


def synthetic_ids(session_id: str, index: int, num_tokens: int, vocab_size: int, salt: str = "") -> list[int]:
    """``num_tokens`` deterministic ids in ``[10, vocab_size)`` for call ``index`` of a session."""
    out: list[int] = []
    counter = 0
    span = vocab_size - 10
    while len(out) < num_tokens:
        digest = hashlib.blake2b(f"{salt}{session_id}\x00{index}\x00{counter}".encode(), digest_size=64).digest()
        out.extend(10 + int.from_bytes(digest[k:k + 4], "big") % span for k in range(0, 64, 4))
        counter += 1
    return out[:num_tokens]


@attrs.frozen
class ObservedCall:
    session_id: str
    call_index: int
    model: str
    is_switch: bool
    arrival_s: float  # since the replay started
    ttft_s: float
    latency_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


@attrs.frozen
class ReplayReport:
    calls: tuple[ObservedCall, ...]
    failures: tuple[str, ...]  # "session#index: why"
    num_late_sessions: int  # started after their arrival offset (waited for a slot)
    wall_s: float

    def summary(self) -> dict[str, float]:
        calls, switch = self.calls, [c for c in self.calls if c.is_switch]

        def mean(xs: Sequence[float]) -> float:
            return sum(xs) / len(xs) if xs else math.nan

        def hit(cs: Sequence[ObservedCall]) -> float:
            total = sum(c.num_prompt_tokens for c in cs)
            return sum(c.num_cached_tokens for c in cs) / total if total else math.nan

        return {"calls": float(len(calls)), "switch_calls": float(len(switch)),
                "call_latency_s": mean([c.latency_s for c in calls]),
                "switch_latency_s": mean([c.latency_s for c in switch]),
                "switch_ttft_s": mean([c.ttft_s for c in switch]),
                "hit_rate": hit(calls), "switch_hit_rate": hit(switch),
                "failed_calls": float(len(self.failures)), "late_sessions": float(self.num_late_sessions)}

    def table(self) -> str:
        s = self.summary()
        rows = [("calls", f"{s['calls']:.0f} ({s['switch_calls']:.0f} switch calls)"),
                ("call latency (s)", f"{s['call_latency_s']:.3f}"),
                ("switch latency (s)", f"{s['switch_latency_s']:.3f}"),
                ("switch TTFT (s)", f"{s['switch_ttft_s']:.3f}"),
                ("hit rate", f"{s['hit_rate']:.1%}"), ("switch hit rate", f"{s['switch_hit_rate']:.1%}"),
                ("failed calls", f"{s['failed_calls']:.0f}"),
                ("sessions started late", f"{s['late_sessions']:.0f}"), ("wall time (s)", f"{self.wall_s:.1f}")]
        return "\n".join(f"{k:<22} {v}" for k, v in rows)


@attrs.define
class _Replay:
    trace: SessionTrace
    url: str
    models: Mapping[str, str]
    max_sessions: int
    time_scale: float
    vocab_size: int
    session_prefix: str
    headers: dict[str, str]
    timeout_s: float
    calls: list[ObservedCall] = attrs.Factory(list)
    failures: list[str] = attrs.Factory(list)
    late: int = 0
    t0: float = 0.0

    async def run(self) -> ReplayReport:
        self.t0 = time.monotonic()
        slots = asyncio.Semaphore(self.max_sessions)
        first = min(s.arrival_s for s in self.trace.sessions)
        limits = httpx.Limits(max_connections=self.max_sessions, max_keepalive_connections=self.max_sessions)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), limits=limits) as client:
            await asyncio.gather(*(self._session(client, slots, s, (s.arrival_s - first) * self.time_scale)
                                   for s in self.trace.sessions))
        order = {(s.session_id, i): k for k, s in enumerate(self.trace.sessions) for i in range(len(s.calls))}
        calls = tuple(sorted(self.calls, key=lambda c: order[(c.session_id, c.call_index)]))
        return ReplayReport(calls, tuple(self.failures), self.late, time.monotonic() - self.t0)

    def _now(self) -> float:
        return time.monotonic() - self.t0

    async def _session(self, client: httpx.AsyncClient, slots: asyncio.Semaphore, s: TraceSession,
                       at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - self._now()))
        async with slots:
            if self._now() > at_s + 0.05:
                self.late += 1
            context: list[int] = []
            previous: str | None = None
            for i, c in enumerate(s.calls):
                if i:
                    await asyncio.sleep(float(c.gap_s or 0.0) * self.time_scale)
                if c.compact_to_tokens is not None:
                    context = synthetic_ids(s.session_id, i, c.compact_to_tokens, self.vocab_size, "summary:")
                prompt = context + synthetic_ids(s.session_id, i, c.input_tokens, self.vocab_size)
                model = self.models[c.model] if c.model is not None else None
                assert model is not None  # checked before the replay starts
                out = await self._call(client, s, i, model, prompt, c.output_tokens, model != previous and i > 0)
                if out is None:
                    return  # the session cannot go on: counted in failures
                context = prompt + out
                previous = model

    async def _call(self, client: httpx.AsyncClient, s: TraceSession, i: int, model: str, prompt: list[int],
                    num_output: int, is_switch: bool) -> list[int] | None:
        body = {"model": model, "prompt": prompt, "max_tokens": num_output, "min_tokens": num_output,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        headers = {**self.headers, "X-Session-Id": self.session_prefix + s.session_id}
        if s.task:
            headers["X-Session-Task"] = s.task
        start = self._now()
        ttft, out, usage = None, [], None
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")[:200]
                    self.failures.append(f"{s.session_id}#{i}: status {r.status_code}: {text}")
                    return None
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        self.failures.append(f"{s.session_id}#{i}: {data['error']}")
                        return None
                    for ch in data.get("choices") or []:
                        if ttft is None:
                            ttft = self._now() - start
                        out.extend(ch.get("token_ids") or [])
                    if data.get("usage") and not data.get("choices"):
                        usage = data["usage"]
        except (httpx.HTTPError, OSError) as e:
            self.failures.append(f"{s.session_id}#{i}: {e!r}")
            return None
        end = self._now()
        if not isinstance(usage, dict):
            self.failures.append(f"{s.session_id}#{i}: the stream carried no usage")
            return None
        details = usage.get("prompt_tokens_details") or {}
        n_out = int(usage.get("completion_tokens", len(out)))
        if len(out) != n_out:  # no ids came back: the context continues with stand-ins of the right length
            out = synthetic_ids(s.session_id, i, n_out, self.vocab_size, "output:")
        self.calls.append(ObservedCall(
            s.session_id, i, model, is_switch, start, end - start if ttft is None else ttft, end - start,
            int(usage.get("prompt_tokens", len(prompt))), int(details.get("cached_tokens") or 0), n_out))
        return out


def replay(trace: SessionTrace, url: str, *, model_map: Mapping[str, str] | None = None, max_sessions: int = 16,
           time_scale: float = 1.0, vocab_size: int = 1000, session_prefix: str = "replay-",
           api_key: str | None = None, timeout_s: float = 600.0) -> ReplayReport:
    """Play ``trace`` against the gateway at ``url`` (see the module docstring)."""
    if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
        raise ConfigError("--max-sessions", max_sessions, "must be an integer >= 1")
    if not 0 <= time_scale < math.inf:
        raise ConfigError("--time-scale", time_scale, "must be a finite number >= 0")
    if vocab_size < 11:
        raise ConfigError("--vocab-size", vocab_size, "must be > 10")
    models = {m: (model_map or {}).get(m, m) for m in trace.models}
    for s in trace.sessions:
        for i, c in enumerate(s.calls):
            if c.model is None:
                raise ConfigError("sessions", f"{s.session_id}#{i}", "the call records no model: the replay "
                                  "sends the recorded model (the gateway's client-model router routes by it)")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    run = _Replay(trace, url.rstrip("/"), models, max_sessions, time_scale, vocab_size, session_prefix, headers,
                  timeout_s)
    return asyncio.run(run.run())


def write_observed(report: ReplayReport, trace: SessionTrace, path: str) -> None:
    """The observed calls as a session trace (latency and cached tokens as measured)."""
    by_key = {(c.session_id, c.call_index): c for c in report.calls}
    header = TraceHeader(source=f"shadowprefill replay of {trace.header.source or 'a session trace'}",
                         tokenizer="token ids (synthetic), usage counts")
    with SessionTraceWriter(path, header) as w:
        for s in trace.sessions:
            for i, c in enumerate(s.calls):
                o = by_key.get((s.session_id, i))
                if o is None:
                    break  # the session ended at a failed call (in report.failures)
                w.write_call(s.session_id, i, attrs.evolve(
                    c, model=o.model, latency_s=o.latency_s, cached_tokens=o.num_cached_tokens,
                    prompt_tokens=o.num_prompt_tokens, arrival_s=o.arrival_s if i == 0 else c.arrival_s,
                    token_ids=None, block_hashes=None), s.task if i == 0 else None)


def _pairs(text: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if item.strip():
            rec, sep, model = item.partition("=")
            if not sep or not rec.strip() or not model.strip():
                raise ConfigError("--model-map", item, "must be RECORDED=MODEL,...")
            out[rec.strip()] = model.strip()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shadowprefill replay", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", required=True, help="session-trace file (shadowprefill sessions convert)")
    p.add_argument("--gateway", required=True, help="the gateway's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model-map", help="RECORDED=MODEL,... (default: the recorded names)")
    p.add_argument("--max-sessions", type=int, default=16, help="sessions in flight at most")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies arrival offsets and tool gaps")
    p.add_argument("--vocab-size", type=int, default=1000, help="synthetic ids are in [10, vocab-size)")
    p.add_argument("--session-prefix", default="replay-", help="prefix of the X-Session-Id of every session")
    p.add_argument("--api-key", help="bearer token for the gateway")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per call")
    p.add_argument("--out", help="write the observed calls as a session trace")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(list(argv) if argv is not None else None)
    try:
        trace = read_session_trace(args.sessions)
        report = replay(trace, args.gateway, model_map=_pairs(args.model_map), max_sessions=args.max_sessions,
                        time_scale=args.time_scale, vocab_size=args.vocab_size, session_prefix=args.session_prefix,
                        api_key=args.api_key, timeout_s=args.timeout)
    except ShadowError as e:
        print(f"shadowprefill replay: error: {e}", file=sys.stderr)
        return 2
    if args.out:
        write_observed(report, trace, args.out)
    for f in report.failures:
        print(f"failed: {f}", file=sys.stderr)
    if args.json:
        print(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v)
                          for k, v in report.summary().items()}, indent=1))
    else:
        print(report.table())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
