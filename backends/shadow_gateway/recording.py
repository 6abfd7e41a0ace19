"""Recording the sessions a gateway serves as a session trace
(:mod:`shadow_traces.session_trace`), so that an operator can replay
their own traffic in the simulator (``shadowprefill simulate --sessions FILE``).

Opt-in: a ``record`` section in the gateway's configuration::

    record:
      path: /var/lib/shadowprefill/sessions.jsonl   # must not exist, unless overwrite: true
      overwrite: false
      hash_session_ids: true    # session ids as sha256 prefixes (default), or as sent; a
                                # suffix -N numbers the gateway sessions (a returning id is a new one)
      token_ids: false          # the prompt's token ids per call
      block_hashes: false       # chained hashes of the prompt's blocks ...
      block_size: 16            # ... of this many tokens
      prompt_text: false        # the request's messages / prompt, in the call's metadata

What one routed call that completed becomes (one line, written when it ends):
its session, index, task (``X-Session-Task``), the model the router chose, its
arrival (seconds since the gateway started), its latency, the tool gap since
the session's previous call ended, the upstream's ``usage`` counts (prompt,
completion and cached tokens), and the new input = prompt - (previous prompt +
output). A prompt that does not extend the previous one (its ids differ from
the previous prompt's, or it is shorter than previous prompt + output) is
recorded as a compaction to the whole prompt (``compact_to_tokens`` = prompt,
``input_tokens`` = 0; the metadata says why), so the file always reads back.

Never recorded unless asked: prompt text, token ids, block hashes, the
client's session id. Calls that failed, or whose response carried no usage,
are not recorded and are counted (:attr:`Recorder.num_skipped`, by reason);
the next call of the session is then measured against the last recorded one.
Recording never fails a call: the gateway calls :meth:`Recorder.on_call_end`
after the response ended and logs any error.

Memory: per live session the recorder keeps the previous call's counts, end
time and a digest of its prompt ids (not the ids); :meth:`Recorder.forget`
drops it when the gateway ends the session.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import attrs
import numpy as np

from shadow_traces.session_trace import SessionTraceWriter, TraceCall, TraceHeader
from shadowcore._validators import non_empty_str, positive_int
from shadowcore.errors import ConfigError


def _bool(_instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, value, "must be true or false")


@attrs.frozen
class RecordConfig:
    """The ``record`` section (see the module docstring)."""

    path: str = attrs.field(validator=non_empty_str)
    overwrite: bool = attrs.field(default=False, validator=_bool)
    hash_session_ids: bool = attrs.field(default=True, validator=_bool)
    token_ids: bool = attrs.field(default=False, validator=_bool)
    block_hashes: bool = attrs.field(default=False, validator=_bool)
    block_size: int = attrs.field(default=16, validator=positive_int)
    prompt_text: bool = attrs.field(default=False, validator=_bool)


def block_hashes(ids: Sequence[int], block_size: int) -> list[int]:
    """Chained 63-bit hashes of ``ids`` per block (the last may be partial): block
    ``k``'s hash covers every token up to its end, so equal hashes mean equal prefixes."""
    out, parent = [], b""
    arr = np.asarray(ids, dtype=np.int64)
    for start in range(0, len(arr), block_size):
        parent = hashlib.blake2b(parent + arr[start:start + block_size].tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(parent, "big") >> 1)
    return out


def _digest(ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


@attrs.define
class _Last:
    """What the recorder keeps of a session's last recorded call."""

    recorded_id: str
    index: int
    prompt: int
    output: int
    end_s: float
    prompt_digest: bytes | None  # of the prompt's ids, when the upstream returned them


@attrs.define(eq=False)
class CallFacts:
    """What the gateway knows of one routed call when it ends."""

    session_id: str
    model: str
    task: str
    started_s: float  # gateway clock
    ended_s: float
    usage: Any  # the upstream's usage object (None: none came)
    prompt_ids: list[int] | None = None
    request: Any = None  # messages / prompt, only when the recorder asks for text


@attrs.define(eq=False)
class Recorder:
    """Writes the calls of a gateway's sessions to ``config.path``."""

    config: RecordConfig
    epoch_s: float  # gateway clock at start: arrivals are seconds since then
    models: tuple[str, ...] = ()
    writer: SessionTraceWriter = attrs.field(init=False)
    sessions: dict[str, _Last] = attrs.field(init=False, factory=dict)
    num_recorded: int = attrs.field(init=False, default=0)
    num_sessions: int = attrs.field(init=False, default=0)
    num_skipped: dict[str, int] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if os.path.exists(self.config.path) and not self.config.overwrite:
            raise ConfigError("record.path", self.config.path,
                              "exists: the recorder does not overwrite a recording (set record.overwrite: true, "
                              "or choose a new path)")
        c = self.config
        header = TraceHeader(
            block_size=c.block_size if c.block_hashes else None,
            tokenizer="upstream usage (prompt_tokens, completion_tokens, cached_tokens)",
            source="shadowprefill gateway",
            metadata={"started": datetime.now(UTC).isoformat(timespec="seconds"), "models": list(self.models),
                      "session_ids": "sha256 prefix" if c.hash_session_ids else "as sent"})
        self.writer = SessionTraceWriter(c.path, header)

    @property
    def wants_text(self) -> bool:
        return self.config.prompt_text

    def session_key(self, session_id: str) -> str:
        if not self.config.hash_session_ids:
            return session_id
        return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    def _recorded_id(self, session_id: str) -> str:
        """A new recorded session per gateway session: a client id that returns after
        the gateway ended its session (idle timeout) starts a new one, as it runs cold."""
        self.num_sessions += 1
        return f"{self.session_key(session_id)}-{self.num_sessions}"

    def _skip(self, reason: str) -> None:
        self.num_skipped[reason] = self.num_skipped.get(reason, 0) + 1

    def on_call_end(self, call: CallFacts, ok: bool) -> None:
        """Record one routed call (the gateway calls this once per call, after it ended)."""
        if not ok:
            return self._skip("failed")
        usage = call.usage if isinstance(call.usage, dict) else {}
        prompt, output = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not (isinstance(prompt, int) and isinstance(output, int)) or prompt < 0 or output < 0:
            return self._skip("no-usage")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if not isinstance(cached, int) or not 0 <= cached <= prompt:
            cached = None
        ids = call.prompt_ids if isinstance(call.prompt_ids, (list, array)) and len(call.prompt_ids) == prompt else None
        last = self.sessions.get(call.session_id)
        arrival = max(0.0, call.started_s - self.epoch_s)
        meta: dict[str, Any] = {}
        compact = None
        if last is None:
            new = prompt
        else:
            new = prompt - (last.prompt + last.output)
            extends = ids is None or last.prompt_digest is None or (
                len(ids) >= last.prompt and _digest(ids[:last.prompt]) == last.prompt_digest)
            if not extends or new < 0:
                meta["compaction"] = "prompt does not extend the previous one" if not extends else \
                    "prompt shorter than the previous prompt + output"
                compact, new = prompt, 0
        if self.config.prompt_text and call.request is not None:
            meta["request"] = call.request
        c = self.config
        rec = TraceCall(
            new, output, call.model, arrival_s=arrival,
            gap_s=None if last is None else max(0.0, call.started_s - last.end_s),
            latency_s=max(0.0, call.ended_s - call.started_s), prompt_tokens=prompt, cached_tokens=cached,
            compact_to_tokens=compact, token_ids=tuple(ids) if c.token_ids and ids is not None else None,
            block_hashes=tuple(block_hashes(ids, c.block_size)) if c.block_hashes and ids is not None else None,
            metadata=meta)
        index = 0 if last is None else last.index + 1
        rid = self._recorded_id(call.session_id) if last is None else last.recorded_id
        self.writer.write_call(rid, index, rec, (call.task or None) if index == 0 else None)
        self.sessions[call.session_id] = _Last(rid, index, prompt, output, call.ended_s,
                                               _digest(ids) if ids is not None else None)
        self.num_recorded += 1
        return None

    def forget(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def close(self) -> None:
        self.writer.close()
