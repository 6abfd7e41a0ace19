"""The session-trace format: recorded or converted agent sessions, one LLM call
per line (JSON Lines), versioned, with a JSON Schema shipped in the package
(``session_trace.schema.json``, :func:`schema`).

Line 1 is the header::

    {"format": "shadowprefill-session-trace", "version": 1,
     "block_size": 16, "tokenizer": "chars/4", "source": "swe-agent", "metadata": {}}

(``block_size``, ``tokenizer``, ``source`` and ``metadata`` are optional;
``block_size`` is required when a call carries ``block_hashes``). Every other
non-blank line is one call::

    {"session": "django-123", "call": 0, "task": "django-123", "model": "gpt-4o",
     "arrival_s": 0.0, "input_tokens": 8123, "output_tokens": 212, "prompt_tokens": 8123}
    {"session": "django-123", "call": 1, "model": "gpt-4o-mini", "gap_s": 1.7,
     "input_tokens": 640, "output_tokens": 95, "cached_tokens": 8192}

Meaning (the rules the reader enforces beyond the schema):

* A session's calls appear in index order 0, 1, 2, ... (lines of different
  sessions may interleave, as a recording gateway writes them).
* ``input_tokens`` are the tokens the call appends to the session's context
  (new user/tool messages since the previous call's output); the context of call
  ``i`` is the previous call's prompt + its output, or ``compact_to_tokens`` when
  the context was replaced by a summary of that size (not on call 0). The prompt
  is context + ``input_tokens``; ``prompt_tokens``, when given, must equal it.
* ``cached_tokens`` (as observed by the serving system) is at most the prompt;
  ``token_ids`` has one id per prompt token; ``block_hashes`` one hash per
  ``block_size`` tokens of the prompt (the last block may be partial).
* Call 0 needs ``arrival_s`` (seconds from the trace start). A later call needs
  its tool time ``gap_s`` (previous call's end to this arrival), or ``arrival_s``
  plus the previous call's observed ``latency_s``, from which the reader derives
  it (it must not be negative). When ``gap_s`` is given it is the one replayed; a
  later call's ``arrival_s`` is kept as recorded.
* ``model`` is optional: a call without one must be routed by a router at replay.
* ``task`` names the session's task; every call that gives it gives the same one.
* Numbers are plain JSON numbers: ``NaN``/``Infinity`` are rejected; counts are
  integers (``3.0`` is not a count).

Every violation raises :class:`~shadowcore.workloads.traces.TraceError` naming
``file:line:field``; nothing is dropped, clamped or reordered except that the
sessions of a file are ordered by their first call's arrival (stably).

Validation uses ``jsonschema`` (the ``traces`` extra; it comes with the ``sim``
and ``gateway`` extras too): without it, reading a trace raises a ConfigError
saying what to install. Values are frozen attrs classes; :func:`write_session_trace`
writes one, :class:`SessionTraceWriter` appends calls as they happen (the
gateway's recorder), and :func:`read_session_trace` reads either back.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from importlib import resources
from typing import IO, Any, Self

import attrs

from shadowcore import _validators as _v
from shadowcore.errors import ConfigError
from shadowcore.workloads.sessions import AgentSession, CallSpec
from shadowcore.workloads.traces import TraceError

__all__ = [
    "FORMAT",
    "VERSION",
    "SessionTrace",
    "SessionTraceWriter",
    "TraceCall",
    "TraceHeader",
    "TraceSession",
    "from_agent_sessions",
    "model_map",
    "read_session_trace",
    "schema",
    "sessions_from_records",
    "write_session_trace",
]

FORMAT = "shadowprefill-session-trace"
VERSION = 1
SCHEMA_FILE = "session_trace.schema.json"


def _opt(validator: Callable) -> Callable:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value is not None:
            validator(instance, attribute, value)
    return check


def _finite_non_negative(instance: Any, attribute: Any, value: Any) -> None:
    _v.non_negative(instance, attribute, value)
    if not math.isfinite(value):
        raise ConfigError(attribute.name, value, "must be finite")


def _ids(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


def _id_check(_instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in value):
        raise ConfigError(attribute.name, value, "must be integers >= 0")


def _dict(value: Any) -> dict:
    return dict(value)


@attrs.frozen
class TraceHeader:
    """The first line of a trace file."""

    version: int = VERSION
    block_size: int | None = attrs.field(default=None, validator=_opt(_v.positive_int))
    tokenizer: str = ""
    source: str = ""
    metadata: dict = attrs.field(factory=dict, converter=_dict, hash=False)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "version": self.version}
        for key in ("block_size", "tokenizer", "source"):
            if getattr(self, key) not in (None, ""):
                out[key] = getattr(self, key)
        if self.metadata:
            out["metadata"] = self.metadata
        return out


@attrs.frozen
class TraceCall:
    """One call of a session (see the module docstring for each field's meaning).
    After reading, ``gap_s`` is set on every call but the first."""

    input_tokens: int = attrs.field(validator=_v.non_negative_int)
    output_tokens: int = attrs.field(validator=_v.non_negative_int)
    model: str | None = attrs.field(default=None, validator=_opt(_v.non_empty_str))
    arrival_s: float | None = attrs.field(default=None, validator=_opt(_finite_non_negative))
    gap_s: float | None = attrs.field(default=None, validator=_opt(_finite_non_negative))
    latency_s: float | None = attrs.field(default=None, validator=_opt(_finite_non_negative))
    prompt_tokens: int | None = attrs.field(default=None, validator=_opt(_v.non_negative_int))
    cached_tokens: int | None = attrs.field(default=None, validator=_opt(_v.non_negative_int))
    compact_to_tokens: int | None = attrs.field(default=None, validator=_opt(_v.non_negative_int))
    token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_ids, validator=_id_check,
                                                    repr=False)
    block_hashes: tuple[int, ...] | None = attrs.field(default=None, converter=_ids, validator=_id_check,
                                                       repr=False)
    metadata: dict = attrs.field(factory=dict, converter=_dict, hash=False)

    def to_json(self, session_id: str, index: int, task: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"session": session_id, "call": index}
        if task:
            out["task"] = task
        for f in attrs.fields(TraceCall):
            v = getattr(self, f.name)
            if v is None or (f.name == "metadata" and not v):
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


def _calls(_instance: Any, attribute: Any, value: Any) -> None:
    if not value or not all(isinstance(c, TraceCall) for c in value):
        raise ConfigError(attribute.name, value, "must be a non-empty tuple of TraceCall")


@attrs.frozen
class TraceSession:
    """One agent session: its id, task and calls (``calls[0].arrival_s`` is set;
    every later call has ``gap_s``; prompts are consistent, see :meth:`prompt_lengths`)."""

    session_id: str = attrs.field(validator=_v.non_empty_str)
    calls: tuple[TraceCall, ...] = attrs.field(converter=tuple, validator=_calls)
    task: str = ""

    def __attrs_post_init__(self) -> None:
        if self.calls[0].arrival_s is None:
            raise ConfigError("calls[0].arrival_s", None, "the first call needs an arrival time")
        if self.calls[0].compact_to_tokens is not None:
            raise ConfigError("calls[0].compact_to_tokens", self.calls[0].compact_to_tokens,
                              "the first call has no context to compact")
        for i, c in enumerate(self.calls[1:], 1):
            if c.gap_s is None:
                raise ConfigError(f"calls[{i}].gap_s", None, "a later call needs its tool gap")

    @property
    def arrival_s(self) -> float:
        return float(self.calls[0].arrival_s)  # type: ignore[arg-type]

    def prompt_lengths(self) -> tuple[int, ...]:
        """Per call: context + input_tokens."""
        out, context = [], 0
        for c in self.calls:
            if c.compact_to_tokens is not None:
                context = c.compact_to_tokens
            out.append(context + c.input_tokens)
            context = out[-1] + c.output_tokens
        return tuple(out)

    @property
    def models(self) -> tuple[str | None, ...]:
        return tuple(c.model for c in self.calls)

    def to_agent_session(self, model_of: Callable[[str | None, int], str] | None = None) -> AgentSession:
        """The workload value the engines and :func:`~shadowcore.workloads.sessions.session_stats`
        take: every call's ``input_tokens`` as its new input (no separate tool part).
        ``model_of(model, index)`` maps a recorded model (None where there is none)
        to the one replayed (default: as recorded; a call without a model then
        raises ConfigError)."""
        calls = []
        for i, c in enumerate(self.calls):
            model = model_of(c.model, i) if model_of is not None else c.model
            if not model:
                raise ConfigError(f"session {self.session_id!r} call {i}: model", c.model,
                                  "the call has no model: give a router or a model map")
            calls.append(CallSpec(model, c.input_tokens, 0, c.output_tokens, c.compact_to_tokens))
        gaps = tuple(float(c.gap_s) for c in self.calls[1:])  # type: ignore[arg-type]
        return AgentSession(self.session_id, self.task, self.arrival_s, tuple(calls), gaps)


def _sessions(_instance: Any, attribute: Any, value: Any) -> None:
    if not all(isinstance(s, TraceSession) for s in value):
        raise ConfigError(attribute.name, value, "must be a tuple of TraceSession")
    seen: set[str] = set()
    for s in value:
        if s.session_id in seen:
            raise ConfigError(attribute.name, s.session_id, "duplicate session id")
        seen.add(s.session_id)


@attrs.frozen
class SessionTrace:
    """A header and its sessions (ordered by first arrival)."""

    header: TraceHeader
    sessions: tuple[TraceSession, ...] = attrs.field(converter=tuple, validator=_sessions)

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def num_calls(self) -> int:
        return sum(len(s.calls) for s in self.sessions)

    @property
    def models(self) -> tuple[str, ...]:
        """Recorded models, in order of first appearance."""
        return tuple(dict.fromkeys(c.model for s in self.sessions for c in s.calls if c.model))

    @property
    def arrival_span_s(self) -> float:
        """Last session arrival minus the first (0 for one session)."""
        a = [s.arrival_s for s in self.sessions]
        return max(a) - min(a) if a else 0.0

    def agent_sessions(self, model_of: Callable[[str | None, int], str] | None = None) -> list[AgentSession]:
        return [s.to_agent_session(model_of) for s in self.sessions]


def from_agent_sessions(sessions: Iterable[AgentSession], header: TraceHeader | None = None) -> SessionTrace:
    """A trace of generated sessions (a preset's): each call's new input + tool
    result as ``input_tokens``, its compaction, the prompt as ``prompt_tokens``."""
    out = []
    for a in sessions:
        calls = []
        for i, (c, prompt) in enumerate(zip(a.calls, a.prompt_lengths())):
            calls.append(TraceCall(
                c.num_appended_tokens, c.num_output_tokens, c.model,
                arrival_s=a.arrival_s if i == 0 else None, gap_s=a.tool_gaps_s[i - 1] if i else None,
                prompt_tokens=prompt, compact_to_tokens=c.compact_to_tokens))
        out.append(TraceSession(a.session_id, tuple(calls), a.task))
    return SessionTrace(header or TraceHeader(), tuple(out))


# -- schema ---------------------------------------------------------------------------------------


@functools.cache
def schema() -> dict[str, Any]:
    """The JSON Schema of one line (``$defs.header`` for line 1, ``$defs.call`` for the others)."""
    text = resources.files("shadow_traces").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    return json.loads(text)


@functools.cache
def _validators() -> tuple[Any, Any]:
    try:
        import jsonschema
        from jsonschema import validators
    except ImportError:
        raise ConfigError("session trace", "jsonschema", "reading session traces needs jsonschema: "
                          "pip install 'shadowprefill[traces]' (or pip install jsonschema)") from None
    base = jsonschema.Draft202012Validator
    # JSON integers only: 3.0 is a number, not a token count
    checker = base.TYPE_CHECKER.redefine(
        "integer", lambda _c, x: isinstance(x, int) and not isinstance(x, bool))
    cls = validators.extend(base, type_checker=checker)
    defs = schema()["$defs"]

    def inline(node: Any) -> Any:  # local "$ref"s substituted: resolving them per line doubled the cost
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return {**inline(defs[ref.removeprefix("#/$defs/")]),
                        **{k: inline(v) for k, v in node.items() if k != "$ref"}}
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    header, call = (cls(inline(defs[name])) for name in ("header", "call"))
    cls.check_schema(header.schema)
    return header, call


def _schema_error(path: str, line: int, validator: Any, record: Any) -> None:
    errors = sorted(validator.iter_errors(record), key=lambda e: (list(e.absolute_path), e.message))
    if not errors:
        return
    e = errors[0]
    where = ".".join(str(p) for p in e.absolute_path)
    if e.validator == "additionalProperties":
        allowed = sorted(validator.schema.get("properties", {}))
        extra = sorted(set(record) - set(allowed)) if isinstance(record, dict) else []
        raise TraceError(path, line, extra[0] if extra else "$", extra, f"unknown field (allowed: {', '.join(allowed)})")
    if e.validator == "required":
        missing = e.message.split("'")[1] if "'" in e.message else "?"
        raise TraceError(path, line, missing, sorted(record) if isinstance(record, dict) else record,
                         f"missing field {missing!r}")
    raise TraceError(path, line, where or "$", e.instance, e.message)


# -- reading --------------------------------------------------------------------------------------


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def _records(path: str, fh: IO[str]) -> Iterator[tuple[int, Any]]:
    blank = 0
    for line, text in enumerate(fh, 1):
        if line == 1:
            text = text.removeprefix("\ufeff")
        if not text.strip():
            blank = blank or line
            continue
        if blank:
            raise TraceError(path, blank, 1, "", "blank line before more records")
        try:
            yield line, json.loads(text, parse_constant=_no_constant)
        except json.JSONDecodeError as e:
            raise TraceError(path, line, e.colno, text.strip()[:80], f"invalid JSON: {e.msg}") from None
        except ValueError as e:
            raise TraceError(path, line, 1, text.strip()[:80], str(e)) from None


@attrs.define
class _Open:
    """A session being read: its calls so far and the running context size."""

    line: int
    calls: list[TraceCall] = attrs.Factory(list)
    task: str | None = None
    prompt: int = 0  # the last call's prompt
    output: int = 0
    latency: float | None = None


def read_session_trace(path: str | os.PathLike[str]) -> SessionTrace:
    """Read and check a session-trace file (see the module docstring)."""
    p = os.fspath(path)
    header_check, _ = _validators()
    try:
        fh = open(p, encoding="utf-8")  # noqa: SIM115 -- closed below
    except OSError as e:
        raise ConfigError("session trace", p, str(e)) from None
    with fh:
        try:
            records = _records(p, fh)
            first = next(records, None)
            if first is None:
                raise TraceError(p, 1, 1, "", f"empty file: expected a {FORMAT} header line")
            line, rec = first
            if isinstance(rec, dict) and rec.get("format") != FORMAT:
                raise TraceError(p, line, "format", rec.get("format"),
                                 f"not a session trace: line 1 must be the header {{\"format\": \"{FORMAT}\", "
                                 f"\"version\": {VERSION}}}")
            _schema_error(p, line, header_check, rec)
            header = TraceHeader(rec["version"], rec.get("block_size"), rec.get("tokenizer", ""),
                                 rec.get("source", ""), rec.get("metadata", {}))
            return sessions_from_records(p, header, records)
        except UnicodeDecodeError as e:
            raise TraceError(p, 0, e.start + 1, "", "not UTF-8 text") from None


def sessions_from_records(path: str, header: TraceHeader, records: Iterable[tuple[int, Any]]) -> SessionTrace:
    """A trace from ``(line, call record)`` pairs in file order, each checked
    against the schema and the cross-line rules (other formats' loaders that
    produce call records, such as the CSV loader, go through here too)."""
    _, call_check = _validators()
    open_: dict[str, _Open] = {}
    for line, rec in records:
        _schema_error(path, line, call_check, rec)
        _add_call(path, line, rec, header, open_)
    if not open_:
        raise TraceError(path, 2, "$", "", "no calls")
    sessions = [TraceSession(sid, tuple(o.calls), o.task or "") for sid, o in open_.items()]
    sessions.sort(key=lambda s: s.arrival_s)  # stable: equal arrivals keep file order
    return SessionTrace(header, tuple(sessions))


def _add_call(p: str, line: int, rec: dict[str, Any], header: TraceHeader, open_: dict[str, _Open]) -> None:
    sid, index = rec["session"], rec["call"]
    o = open_.get(sid)
    expected = len(o.calls) if o else 0
    if index != expected:
        raise TraceError(p, line, "call", index,
                         f"session {sid!r}: calls must appear in order; expected call {expected}")
    if o is None:
        o = open_[sid] = _Open(line)
    task = rec.get("task")
    if task is not None:
        if o.task is not None and task != o.task:
            raise TraceError(p, line, "task", task, f"session {sid!r} has task {o.task!r} (line {o.line})")
        o.task = task
    compact = rec.get("compact_to_tokens")
    gap = rec.get("gap_s")
    if index == 0:
        if "arrival_s" not in rec:
            raise TraceError(p, line, "arrival_s", None, "the first call of a session needs arrival_s")
        if compact is not None:
            raise TraceError(p, line, "compact_to_tokens", compact, "the first call has no context to compact")
        context = 0
    else:
        context = o.prompt + o.output if compact is None else compact
        if gap is None:
            if "arrival_s" not in rec or o.latency is None:
                raise TraceError(p, line, "gap_s", None,
                                 "a later call needs gap_s, or arrival_s and the previous call's latency_s")
            prev = o.calls[-1].arrival_s
            if prev is None:
                raise TraceError(p, line, "gap_s", None,
                                 "gap_s is needed: the previous call has no arrival_s to derive it from")
            gap = rec["arrival_s"] - prev - o.latency
            if gap < -1e-9:
                raise TraceError(p, line, "arrival_s", rec["arrival_s"],
                                 f"arrives {-gap:.6g} s before the previous call ended "
                                 f"(its arrival {prev} + latency_s {o.latency})")
            gap = max(0.0, gap)  # rounding of the recorded times only (>= -1e-9)
    prompt = context + rec["input_tokens"]
    _check_prompt(p, line, rec, prompt, header)
    call = TraceCall(
        rec["input_tokens"], rec["output_tokens"], rec.get("model"), rec.get("arrival_s"), gap,
        rec.get("latency_s"), rec.get("prompt_tokens"), rec.get("cached_tokens"), compact,
        rec.get("token_ids"), rec.get("block_hashes"), rec.get("metadata", {}))
    o.calls.append(call)
    o.prompt, o.output, o.latency = prompt, rec["output_tokens"], rec.get("latency_s")


def _check_prompt(p: str, line: int, rec: dict[str, Any], prompt: int, header: TraceHeader) -> None:
    given = rec.get("prompt_tokens")
    if given is not None and given != prompt:
        raise TraceError(p, line, "prompt_tokens", given,
                         f"must equal context + input_tokens = {prompt} (give compact_to_tokens if the "
                         "context was summarised)")
    cached = rec.get("cached_tokens")
    if cached is not None and cached > prompt:
        raise TraceError(p, line, "cached_tokens", cached, f"exceeds the prompt ({prompt} tokens)")
    ids = rec.get("token_ids")
    if ids is not None and len(ids) != prompt:
        raise TraceError(p, line, "token_ids", len(ids), f"needs one id per prompt token ({prompt})")
    hashes = rec.get("block_hashes")
    if hashes is not None:
        if header.block_size is None:
            raise TraceError(p, line, "block_hashes", len(hashes), "needs block_size in the header")
        need = -(-prompt // header.block_size)
        if len(hashes) != need:
            raise TraceError(p, line, "block_hashes", len(hashes),
                             f"needs one hash per {header.block_size}-token block of the prompt ({need})")


# -- writing --------------------------------------------------------------------------------------


def _dumps(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def write_session_trace(trace: SessionTrace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` (header, then each session's calls in order)."""
    with SessionTraceWriter(path, trace.header) as w:
        for s in trace.sessions:
            for i, c in enumerate(s.calls):
                w.write_call(s.session_id, i, c, s.task if i == 0 else None)


class SessionTraceWriter:
    """Appends calls to a new trace file as they happen (each line flushed).

    The writer checks each value (attrs validators) but not the cross-line rules
    (order, prompt arithmetic): the producer must keep them, and
    :func:`read_session_trace` checks them on reading."""

    def __init__(self, path: str | os.PathLike[str], header: TraceHeader | None = None) -> None:
        self.path = os.fspath(path)
        self._fh: IO[str] | None = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 -- closed by close()
        self._fh.write(_dumps((header or TraceHeader()).to_json()) + "\n")
        self._fh.flush()
        self.num_calls = 0

    def write_call(self, session_id: str, index: int, call: TraceCall, task: str | None = None) -> None:
        if self._fh is None:
            raise ConfigError("session trace", self.path, "the writer is closed")
        self._fh.write(_dumps(call.to_json(session_id, index, task)) + "\n")
        self._fh.flush()
        self.num_calls += 1

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def model_map(trace_models: Sequence[str], targets: Sequence[str],
              given: Mapping[str, str] | None = None) -> dict[str, str]:
    """Recorded model -> replayed model: ``given`` first; then a recorded name
    that is one of ``targets`` maps to itself; the rest take the unused targets
    in order of first appearance. More recorded models than targets raise
    ConfigError naming them."""
    given = dict(given or {})
    unknown = [m for m in given.values() if m not in targets]
    if unknown:
        raise ConfigError("model map", given, f"maps to {unknown}, not among {list(targets)}")
    out = {m: given[m] for m in trace_models if m in given}
    out.update({m: m for m in trace_models if m not in out and m in targets})
    free = [t for t in targets if t not in out.values()]
    rest = [m for m in trace_models if m not in out]
    if len(rest) > len(free):
        raise ConfigError("model map", list(trace_models),
                          f"the trace has {len(trace_models)} models but the run has {len(targets)} "
                          f"({', '.join(targets)}): map them (session_models / --model-map RECORDED=MODEL)")
    out.update(zip(rest, free))
    return out
