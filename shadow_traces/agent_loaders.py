"""Loaders of agent sessions into the session-trace format
(:mod:`shadow_traces.session_trace`).

* :func:`load_swe_agent` -- SWE-agent trajectories (``.traj`` JSON files): one
  session per file, one call per assistant message of ``history``. A call's
  prompt is every message before it; its new input (``input_tokens``) is the
  messages since the previous assistant message (observations, the next
  instruction), its output that assistant message (content and tool calls).
  The tool time after a call is the ``execution_time`` of that call's
  ``trajectory`` step (SWE-agent records how long the action ran) when the
  trajectory has one step per assistant message; otherwise ``tool_gap_s``.
  Errors inside a trajectory name ``file:0:json.path`` (a JSON document has no
  line per field). Sessions arrive ``session_interval_s``
  apart in the order the files are given. The model is ``model`` when given,
  else the trajectory's ``replay_config`` agent model name, else
  ``"swe-agent"``. When every trajectory step has a ``query`` (the messages
  the LM was shown, SWE-agent >= 1.1, after its history processors), a call's
  prompt is that query and its new input the query minus the previous prompt
  and output; a query that changes an earlier message of the previous query
  (old observations elided) is recorded as a compaction to the prompt sent,
  and counted. Without ``query`` the prompt
  is the cumulative history.
* :func:`load_copilot_sessions` -- the GitHub Copilot coding-agent traces 2026
  as sessions (:func:`~shadowcore.workloads.traces.load_copilot` reads and
  checks the file): each session's LLM calls in time order, with their model,
  prompt and cached tokens. The trace has no per-call end time, so a call's
  ``gap_s`` is the time from the previous call's START (the replayed tool time
  includes the original call's latency; the header's metadata says so). New
  input is prompt - (previous prompt + output); a prompt shorter than that is
  recorded as a compaction to the whole prompt (``compact_to_tokens`` = prompt,
  ``input_tokens`` = 0), and counted in the notes.
* :func:`load_call_csv` -- a per-call table (CSV) with the columns of the call
  record (:data:`CSV_REQUIRED` and any of :data:`CSV_OPTIONAL`): each row goes
  through the same checks as a trace line (errors name ``file:line:column``).

Token counts of text (SWE-agent): a tokenizer the user points at
(:func:`token_counter` with a ``tokenizer.json`` file or a local tokenizer
folder; nothing is downloaded), else the estimate of
:data:`CHARS_PER_TOKEN` characters per token (``ceil(len(text) / 4)`` per
message). The trace header's ``tokenizer`` field says which one was used.

Every loader returns ``(trace, notes)``: ``notes`` are lines for the user
(what was estimated, what was derived); nothing is dropped silently.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from shadow_traces.session_trace import (
    SessionTrace,
    TraceCall,
    TraceHeader,
    TraceSession,
    sessions_from_records,
)
from shadowcore.errors import ConfigError
from shadowcore.workloads.traces import TraceError, load_copilot

__all__ = [
    "CHARS_PER_TOKEN",
    "CSV_OPTIONAL",
    "CSV_REQUIRED",
    "LOADERS",
    "TokenCounter",
    "load_call_csv",
    "load_copilot_sessions",
    "load_swe_agent",
    "token_counter",
]

CHARS_PER_TOKEN = 4.0
"""The estimate without a tokenizer: about 4 characters of English or code per
token (OpenAI's rule of thumb; BPE tokenizers of current models land at 3.5-4.5
on SWE-agent trajectories)."""

DEFAULT_TOOL_GAP_S = 2.0
DEFAULT_SESSION_INTERVAL_S = 10.0


class TokenCounter:
    """Counts the tokens of a text: ``count(text) -> int``; ``name`` goes into the header."""

    def __init__(self, name: str, count: Callable[[str], int]) -> None:
        self.name = name
        self.count = count


def token_counter(tokenizer: str | None = None) -> TokenCounter:
    """A tokenizer from a local path (a ``tokenizer.json`` file, or a folder with
    one or with a ``transformers`` tokenizer; never downloaded), or, for None, the
    characters-per-token estimate."""
    if tokenizer is None:
        return TokenCounter(f"chars/{CHARS_PER_TOKEN:g}", lambda text: math.ceil(len(text) / CHARS_PER_TOKEN))
    path = Path(tokenizer)
    if not path.exists():
        raise ConfigError("--tokenizer", tokenizer, "no such file or folder (a tokenizer.json or a local "
                          "tokenizer folder; nothing is downloaded)")
    file = path if path.is_file() else path / "tokenizer.json"
    if file.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--tokenizer", tokenizer, "needs the tokenizers package") from None
        tok = Tokenizer.from_file(str(file))
        return TokenCounter(str(path), lambda text: len(tok.encode(text, add_special_tokens=False).ids))
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("--tokenizer", tokenizer, "a tokenizer folder without tokenizer.json needs transformers") \
            from None
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError("--tokenizer", tokenizer, f"cannot load a tokenizer from it: {e}") from None
    return TokenCounter(str(path), lambda text: len(hf.encode(text, add_special_tokens=False)))


# -- SWE-agent --------------------------------------------------------------------------------------


def _text(path: str, where: str, content: Any) -> str:
    """A message's content: a string, or a list of parts with ``text``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text", ""), str):
                out.append(part.get("text", ""))
            else:
                raise TraceError(path, 0, f"{where}.content[{k}]", part, "not a text part")
        return "".join(out)
    raise TraceError(path, 0, f"{where}.content", content, "not a string or a list of text parts")


def _assistant_text(path: str, where: str, msg: dict[str, Any]) -> str:
    text = _text(path, where, msg.get("content"))
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise TraceError(path, 0, f"{where}.tool_calls", calls, "not a list")
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise TraceError(path, 0, f"{where}.tool_calls[{k}].function", call, "missing function")
        args = fn.get("arguments", "")
        text += str(fn.get("name", "")) + (args if isinstance(args, str) else json.dumps(args))
    return text


def _traj_model(doc: dict[str, Any]) -> str | None:
    cfg = doc.get("replay_config")
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except json.JSONDecodeError:
            return None
    try:
        name = cfg["agent"]["model"]["name"]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    return name if isinstance(name, str) and name else None


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except OSError as e:
        raise ConfigError("input", path, str(e)) from None
    except json.JSONDecodeError as e:
        raise TraceError(path, e.lineno, e.colno, "", f"invalid JSON: {e.msg}") from None
    except ValueError as e:
        raise TraceError(path, 0, "$", str(e), "NaN/Infinity are not JSON numbers") from None


def _swe_session(path: str, counter: TokenCounter, model: str | None, arrival_s: float, tool_gap_s: float,
                 sid: str, notes: list[str]) -> TraceSession:
    doc = _read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("history"), list):
        raise TraceError(path, 1, "history", type(doc).__name__, "not a SWE-agent trajectory: no 'history' list")
    name = model or _traj_model(doc) or "swe-agent"
    steps = doc.get("trajectory") if isinstance(doc.get("trajectory"), list) else []
    calls_raw: list[tuple[int, int]] = []  # (input, output) per assistant message
    pending = 0
    for k, msg in enumerate(doc["history"]):
        where = f"history[{k}]"
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise TraceError(path, 0, f"{where}.role", msg if not isinstance(msg, dict) else msg.get("role"),
                             "a message needs a role")
        if msg["role"] == "assistant":
            calls_raw.append((pending, counter.count(_assistant_text(path, where, msg))))
            pending = 0
        else:
            pending += counter.count(_text(path, where, msg.get("content")))
    if not calls_raw:
        raise TraceError(path, 0, "history", len(doc["history"]), "no assistant message: a session needs a call")
    if pending:
        notes.append(f"{path}: {pending} tokens after the last assistant message belong to no call")
    timed = len(steps) == len(calls_raw) and all(
        isinstance(s, dict) and isinstance(s.get("execution_time"), (int, float))
        and not isinstance(s.get("execution_time"), bool) and math.isfinite(s["execution_time"])
        and s["execution_time"] >= 0 for s in steps)
    if not timed:
        notes.append(f"{path}: no per-step execution_time for every call: tool gaps are {tool_gap_s:g} s")
    stats = (doc.get("info") or {}).get("model_stats") if isinstance(doc.get("info"), dict) else None
    sent = _queries(path, counter, steps, len(calls_raw))
    if sent is None:
        notes.append(f"{path}: prompts from the cumulative history (the trajectory has no per-step 'query')")
    prompts, context, rewritten = [], 0, 0
    calls = []
    for i, (inp, out) in enumerate(calls_raw):
        compact = None
        if sent is not None:  # the messages the LM was shown (after SWE-agent's history processors)
            size, changed = sent[i]
            inp = size - context
            if i and (changed or inp < 0):  # an earlier message was changed: the context was rewritten
                rewritten += 1
                compact, inp = size, 0
        prompt = (context if compact is None else compact) + inp
        prompts.append(prompt)
        gap = None if i == 0 else float(steps[i - 1]["execution_time"]) if timed else tool_gap_s
        calls.append(TraceCall(inp, out, name, arrival_s=arrival_s if i == 0 else None, gap_s=gap,
                               prompt_tokens=prompt, compact_to_tokens=compact))
        context = prompt + out
    if rewritten:
        notes.append(f"{path}: {rewritten} calls' queries rewrite earlier messages (SWE-agent's history processors): "
                     "recorded as compactions to the prompt sent (the replay reuses none of their context)")
    if isinstance(stats, dict):
        sent, api = stats.get("tokens_sent"), stats.get("api_calls")
        if isinstance(api, int) and api != len(calls):
            notes.append(f"{path}: info.model_stats.api_calls = {api}, the history has {len(calls)} assistant "
                         "messages (retried or re-queried calls are not in the history)")
        if isinstance(sent, int) and sent > 0:
            notes.append(f"{path}: prompt tokens {sum(prompts)} ({counter.name}) vs info.model_stats.tokens_sent "
                         f"{sent} ({sum(prompts) / sent:.2f}x)")
    return TraceSession(sid, tuple(calls), sid)


def _queries(path: str, counter: TokenCounter, steps: list, num_calls: int) -> list[tuple[int, bool]] | None:
    """Per call, from the trajectory steps' ``query`` (every message shown to the
    LM at that step; SWE-agent >= 1.1): (prompt tokens, whether the query rewrote
    the previous query's messages instead of extending them); None when a step has none."""
    if len(steps) != num_calls or not all(isinstance(st, dict) and isinstance(st.get("query"), list)
                                          for st in steps):
        return None
    out, previous = [], []
    for k, st in enumerate(steps):
        texts = []
        for j, msg in enumerate(st["query"]):
            where = f"trajectory[{k}].query[{j}]"
            if not isinstance(msg, dict):
                raise TraceError(path, 0, where, msg, "not a message")
            texts.append((msg.get("role"), _assistant_text(path, where, msg) if msg.get("role") == "assistant"
                          else _text(path, where, msg.get("content"))))
        rewritten = k > 0 and texts[:len(previous)] != previous
        out.append((sum(counter.count(t) for _, t in texts), rewritten))
        previous = texts
    return out


def load_swe_agent(paths: Sequence[str | os.PathLike[str]], *, tokenizer: str | None = None,
                   model: str | None = None, session_interval_s: float = DEFAULT_SESSION_INTERVAL_S,
                   tool_gap_s: float = DEFAULT_TOOL_GAP_S) -> tuple[SessionTrace, list[str]]:
    """SWE-agent ``.traj`` files as sessions (one per file, ids from the file names)."""
    for name, v in (("session_interval_s", session_interval_s), ("tool_gap_s", tool_gap_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise ConfigError(name, v, "must be a finite number >= 0")
    counter = token_counter(tokenizer)
    notes = [f"token counts: {counter.name}" + ("" if tokenizer else
                                                " (estimate; give --tokenizer PATH for exact counts)")]
    sessions, seen = [], set()
    for k, p in enumerate(paths):
        sid = base = Path(p).name.removesuffix(".traj")
        n = 1
        while sid in seen:
            n += 1
            sid = f"{base}#{n}"
        seen.add(sid)
        sessions.append(_swe_session(os.fspath(p), counter, model, k * session_interval_s, tool_gap_s, sid, notes))
    header = TraceHeader(tokenizer=counter.name, source="swe-agent",
                         metadata={"session_interval_s": session_interval_s, "default_tool_gap_s": tool_gap_s})
    return SessionTrace(header, tuple(sessions)), notes


# -- Copilot ----------------------------------------------------------------------------------------


def load_copilot_sessions(path: str | os.PathLike[str]) -> tuple[SessionTrace, list[str]]:
    """The Copilot coding-agent trace's sessions (see the module docstring)."""
    trace = load_copilot(path)
    by_session: dict[str, list[Any]] = {}
    for r in trace.requests:  # time order
        by_session.setdefault(r.session_id, []).append(r)
    sessions, compacted = [], 0
    for sid, reqs in by_session.items():
        calls, context, prev = [], 0, None
        for i, r in enumerate(reqs):
            new = r.num_prompt_tokens - context
            compact = None
            if i and new < 0:
                compacted += 1
                compact, new = r.num_prompt_tokens, 0
            calls.append(TraceCall(new, r.num_output_tokens, r.model or None,
                                   arrival_s=r.arrival_s, gap_s=None if prev is None else r.arrival_s - prev,
                                   prompt_tokens=r.num_prompt_tokens, cached_tokens=r.num_cached_tokens,
                                   compact_to_tokens=compact))
            context, prev = r.num_prompt_tokens + r.num_output_tokens, r.arrival_s
        sessions.append(TraceSession(sid, tuple(calls)))
    notes = [(f"{len(sessions)} sessions, {len(trace)} calls; gap_s is start-to-start (the trace has no call end "
             "times): the replayed tool time includes each original call's latency")]
    if compacted:
        notes.append(f"{compacted} calls have a prompt shorter than the previous prompt + output: recorded as "
                     "compactions (compact_to_tokens = the prompt; the replay does not reuse their context)")
    header = TraceHeader(tokenizer="as recorded (tokens.prompt/completion/cached)", source="copilot",
                         metadata={"gap_s": "start-to-start"})
    return SessionTrace(header, tuple(sessions)), notes


# -- CSV --------------------------------------------------------------------------------------------

CSV_REQUIRED = ("session_id", "call_index", "input_tokens", "output_tokens")
CSV_OPTIONAL = ("model", "task", "arrival_s", "gap_s", "latency_s", "prompt_tokens", "cached_tokens",
                "compact_to_tokens")
_CSV_INT = {"call_index", "input_tokens", "output_tokens", "prompt_tokens", "cached_tokens", "compact_to_tokens"}
_CSV_FLOAT = {"arrival_s", "gap_s", "latency_s"}


def _csv_records(path: str, fh: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    reader = csv.reader(fh, strict=True)
    header = next(reader, None)
    if header is None:
        raise TraceError(path, 1, 1, "", f"empty file: expected a CSV header with {', '.join(CSV_REQUIRED)}")
    names = [h.strip() for h in header]
    missing = [c for c in CSV_REQUIRED if c not in names]
    unknown = [c for c in names if c not in CSV_REQUIRED + CSV_OPTIONAL]
    if missing or unknown or len(set(names)) != len(names):
        problem = (f"missing {', '.join(missing)}" if missing else f"unknown columns {', '.join(unknown)}"
                   if unknown else "duplicate column names")
        raise TraceError(path, 1, 1, ",".join(header), f"wrong header: {problem}; columns are "
                         f"{', '.join(CSV_REQUIRED)} and optionally {', '.join(CSV_OPTIONAL)}")
    for row in reader:
        line = reader.line_num
        if not row:
            continue
        if len(row) != len(names):
            raise TraceError(path, line, len(row), ",".join(row), f"row has {len(row)} fields, header {len(names)}")
        rec: dict[str, Any] = {}
        for name, cell in zip(names, row):
            cell = cell.strip()
            if cell == "":
                if name in CSV_REQUIRED:
                    raise TraceError(path, line, name, cell, "empty field")
                continue
            key = {"session_id": "session", "call_index": "call"}.get(name, name)
            try:
                rec[key] = int(cell) if name in _CSV_INT else float(cell) if name in _CSV_FLOAT else cell
            except ValueError:
                kind = "an integer" if name in _CSV_INT else "a number"
                raise TraceError(path, line, name, cell, f"not {kind}") from None
            if name in _CSV_FLOAT and not math.isfinite(rec[key]):
                raise TraceError(path, line, name, cell, "not a finite number")
        yield line, rec


def load_call_csv(path: str | os.PathLike[str]) -> tuple[SessionTrace, list[str]]:
    """A per-call table as sessions."""
    p = os.fspath(path)
    try:
        fh = open(p, encoding="utf-8", newline="")  # noqa: SIM115 -- closed below
    except OSError as e:
        raise ConfigError("input", p, str(e)) from None
    with fh:
        try:
            trace = sessions_from_records(p, TraceHeader(source="csv"), _csv_records(p, fh))
        except csv.Error as e:
            raise TraceError(p, 0, 1, "", f"CSV syntax error: {e}") from None
    return trace, [f"{len(trace)} sessions, {trace.num_calls} calls"]


LOADERS = {"swe-agent": load_swe_agent, "copilot": load_copilot_sessions, "csv": load_call_csv}
