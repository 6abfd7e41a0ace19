"""GitHub Copilot coding-agent traces 2026 (AzurePublicDataset): sessions ->
turns -> llm_calls, as JSON Lines (one session per line, plain or gzip) or one
JSON document.

Invariants: every LLM call becomes one request; the calls of the whole file are
sorted by timestamp, stably (the only reordering any loader does); errors name
the line of the session and the JSON path of the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from shadowcore.workloads.reading import (
    WALLCLOCK_FORMAT,
    Clock,
    count_field,
    default_name,
    first_nonblank,
    json_count,
    json_error,
    json_field,
    json_path,
    jsonl_records,
    open_trace,
    str_field,
)
from shadowcore.workloads.trace import Trace, TraceError, TraceRequest

__all__ = ["load_copilot"]


_JSON_WS = " \t\n\r"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _JSON_WS:
        i += 1
    return i


def _document_sessions(path: str, text: str) -> Iterator[tuple[int, str, Any]]:
    """``(line, JSON path prefix, session)`` of a single JSON document that is a list
    of sessions or an object with a ``sessions`` list; the line is where the session
    object starts."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise json_error(path, e.lineno, e, text) from None
    dec = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if isinstance(doc, list):
        sessions, prefix = doc, ""
    elif isinstance(doc, dict) and isinstance(doc.get("sessions"), list):
        sessions, prefix = doc["sessions"], "sessions"
        # Find the array's position: walk the (already valid) top-level object.
        i = _skip_ws(text, i + 1)
        while True:
            key, i = dec.raw_decode(text, i)
            i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ':'
            if key == "sessions":
                break
            _, i = dec.raw_decode(text, i)
            i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ','
    else:
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise TraceError(path, 1, "$", keys,
                         "expected a list of sessions or an object with a 'sessions' list")
    # ``i`` is at the sessions array's '['.
    i = _skip_ws(text, i + 1)
    line, upto = 1, 0
    for k, session in enumerate(sessions):
        line += text.count("\n", upto, i)
        upto = i
        yield line, f"{prefix}[{k}]", session
        _, i = dec.raw_decode(text, i)
        i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ','


def load_copilot(path: str | os.PathLike[str], *, name: str | None = None) -> Trace:
    """Load GitHub Copilot coding-agent traces 2026 (AzurePublicDataset,
    ``GitHubCopilotCodingAgentDataset2026.md``; field reference
    ``analysis/GitHubCopilotCodingAgents/schema.json``).

    The release is JSONL (gzip-compressed shards ``shard-NNNN.jsonl.gz``; both plain
    and gzip files load), one session per line. A single JSON document holding a list
    of sessions, or an object ``{"sessions": [...]}``, also loads. The fields read
    (others, e.g. ``date``, ``turn_id``, ``duration_ms``, ``tool_batches``,
    ``tokens.total``, ``message_metadata``, are ignored)::

        {"session_id": str,
         "turns": [{"llm_calls": [{"timestamp": "2026-06-01T12:00:00.123Z",
                                   "model": str,
                                   "tokens": {"prompt": int, "completion": int,
                                              "cached": int}}, ...]}, ...]}

    Each LLM call becomes one request: ``tokens.prompt`` -> ``num_prompt_tokens``,
    ``tokens.completion`` -> ``num_output_tokens``, ``tokens.cached`` ->
    ``num_cached_tokens`` (must be <= prompt), ``model`` and ``session_id`` as they
    are. ``timestamp`` is an ISO-8601 wall-clock time (``T`` or space, up to 9
    fraction digits, optional ``Z``/``+HH:MM``; all calls must agree on having an
    offset). Calls with zero prompt tokens are kept.

    Ordering: sessions are stored one per line and overlap in time, so the calls of
    the whole file are sorted by timestamp (stably: equal times keep file order);
    this is the only reordering. Arrivals are seconds from the earliest call.

    Errors name the line of the session (JSONL: its line; a single document: the line
    where the session object starts) and, as the column, the JSON path of the field,
    e.g. ``turns[1].llm_calls[0].tokens.prompt`` (``sessions[3].turns[...]`` in a
    document). A missing field, a wrong type, a negative count, cached > prompt, an
    unparsable timestamp, invalid JSON and a file without any LLM call are errors."""
    p = os.fspath(path)
    with open_trace(p) as fh:
        first = first_nonblank(fh)
    calls: list[tuple[int, int, int, int, int, str, str]] = []
    clock = Clock()
    if first.lstrip().startswith("[") or not _is_jsonl_session(first):
        with open_trace(p) as fh:
            data = fh.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(p, data.count(b"\n", 0, e.start) + 1,
                             e.start - data.rfind(b"\n", 0, e.start),
                             data[e.start:e.start + 8], "not UTF-8 text") from None
        text = text.removeprefix("\ufeff")
        if not text.strip():
            raise TraceError(p, 1, 1, "", "empty file: expected Copilot sessions")
        for line, prefix, session in _document_sessions(p, text):
            _copilot_session(p, line, prefix, session, clock, calls)
    else:
        with open_trace(p) as fh:
            for line, session in jsonl_records(p, fh):
                _copilot_session(p, line, "", session, clock, calls)
    if not calls:
        raise TraceError(p, 1, "$", 0, "no llm_calls in the file")
    calls.sort(key=lambda c: (c[0], c[1]))
    t0 = calls[0][0]
    reqs = tuple(TraceRequest((ns - t0) / 1e9, pr, out, model=model, session_id=sid,
                              num_cached_tokens=cached)
                 for ns, _seq, pr, out, cached, model, sid in calls)
    return Trace(name or default_name(p), reqs)


def _is_jsonl_session(text: str) -> bool:
    """Whether a file's first line is a complete JSON session record (JSONL), as
    opposed to the start of a multi-line document or a one-line ``{"sessions":..}``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        # Not a whole value on its own line: JSONL with a broken first record if the
        # line looks like one (``{...}`` on one line), otherwise a document.
        s = text.strip()
        return s.startswith("{") and s.endswith("}")
    return isinstance(value, dict) and "sessions" not in value


def _copilot_session(path: str, line: int, prefix: str, session: Any, clock: Clock,
                     out: list[tuple[int, int, int, int, int, str, str]]) -> None:
    sid = str_field(path, line, prefix, session, "session_id")
    turns, where = json_field(path, line, prefix, session, "turns")
    if not isinstance(turns, list):
        raise TraceError(path, line, where, turns, "not a list of turns")
    for ti, turn in enumerate(turns):
        calls, where = json_field(path, line, json_path(json_path(prefix, "turns"), ti), turn, "llm_calls")
        if not isinstance(calls, list):
            raise TraceError(path, line, where, calls, "not a list of LLM calls")
        for ci, call in enumerate(calls):
            cp = json_path(where, ci)
            ts, ts_where = json_field(path, line, cp, call, "timestamp")
            if not isinstance(ts, str):
                raise TraceError(path, line, ts_where, ts, f"timestamp: {WALLCLOCK_FORMAT}")
            try:
                ns = clock.ns(ts)
            except ValueError as e:
                raise TraceError(path, line, ts_where, ts, f"timestamp: {e}") from None
            model = str_field(path, line, cp, call, "model")
            tokens, tw = json_field(path, line, cp, call, "tokens")
            prompt = count_field(path, line, tw, tokens, "prompt")
            completion = count_field(path, line, tw, tokens, "completion")
            cached, cw = json_field(path, line, tw, tokens, "cached")
            cached = json_count(path, line, cw, cached)
            if cached > prompt:
                raise TraceError(path, line, cw, cached,
                                 f"cached tokens exceed prompt tokens ({prompt})")
            out.append((ns, len(out), prompt, completion, cached, model, sid))
