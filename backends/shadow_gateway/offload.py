"""Large JSON off the event loop: token-id payloads decoded and encoded in a
worker process.

A routed call with a long context carries its token ids twice through the
gateway: the upstream's response lists the prompt's ids, and every shadow
request lists the session's context. ``json`` holds the interpreter lock
for the whole of one ``loads``/``dumps`` (a 4M-token response took 0.4 s of
the event loop), so a thread would not help; a worker process does. Token-id
lists cross the process boundary as ``array('i')`` (pickled as bytes: a
memory copy), never as lists of Python ints.

:class:`Offloader` runs :func:`decode` and :func:`encode` in the worker when
the payload is at least ``min_bytes`` (small payloads stay inline: a round
trip costs more than they do). What the worker returns is what the inline
path returns: decoded objects have the token-id lists at the known places
(``prompt_token_ids``, ``choices[].prompt_token_ids``,
``choices[].token_ids``) as ``array('i')``; encoding writes arrays as JSON
lists. A worker that fails (killed, broken pool) is replaced and the call
falls back to the inline path: offloading never fails a call.

Invariants: the worker holds no state (pure functions of their arguments);
results are identical to the inline path (tests compare them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

log = logging.getLogger("shadow_gateway.offload")
#: Where token-id lists sit in vLLM's completion and chat responses (and chunks).
_TOP = ("prompt_token_ids",)
_CHOICE = ("prompt_token_ids", "token_ids")


def _int_list_to_array(value: Any) -> Any:
    if isinstance(value, list) and value and all(type(v) is int for v in value[:8]):
        try:
            return array("i", value)
        except (TypeError, OverflowError):
            return value
    return value


def decode(raw: bytes) -> Any:
    """``json.loads`` with token-id lists as ``array('i')`` (see the module doc)."""
    data = json.loads(raw)
    if isinstance(data, dict):
        for key in _TOP:
            if key in data:
                data[key] = _int_list_to_array(data[key])
        for choice in data.get("choices") or ():
            if isinstance(choice, dict):
                for key in _CHOICE:
                    if key in choice:
                        choice[key] = _int_list_to_array(choice[key])
    return data


def _default(o: Any) -> Any:
    if isinstance(o, array):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def encode(obj: Any) -> bytes:
    """``json.dumps`` (compact, UTF-8, as Starlette's ``JSONResponse``) that writes arrays as lists."""
    return json.dumps(obj, default=_default, ensure_ascii=False, separators=(",", ":")).encode()


def approx_size(obj: Any) -> int:
    """A cheap upper-ish estimate of an object's JSON size: long arrays and
    strings count, the rest is assumed small (one level of nesting is looked at)."""
    if isinstance(obj, array):
        return 6 * len(obj)
    if isinstance(obj, (str, bytes)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(approx_size(v) if isinstance(v, (array, str, bytes, list)) else 16 for v in obj.values())
    if isinstance(obj, list):
        return 6 * len(obj) if obj and isinstance(obj[0], int) else sum(approx_size(v) for v in obj[:64])
    return 16


class Offloader:
    """A one-process pool for large JSON work (started lazily, replaced when broken)."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.num_offloaded = 0
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:  # spawn: the gateway process has threads (fork would copy their locks)
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def start(self) -> None:
        """Start the worker now (its interpreter start is ~0.1-1 s), so the first large call does not wait."""
        self._executor().submit(int)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def _run(self, fn: Any, *args: Any) -> Any:
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._executor(), fn, *args)
        except (BrokenProcessPool, OSError, RuntimeError) as e:  # the worker died: inline this time, new one next
            log.warning("offload worker failed (%r); running inline", e)
            self.close()
            return fn(*args)
        self.num_offloaded += 1
        return result

    async def decode(self, raw: bytes) -> Any:
        return await self._run(decode, raw) if len(raw) >= self.min_bytes else decode(raw)

    async def encode(self, obj: Any) -> bytes:
        return await self._run(encode, obj) if approx_size(obj) >= self.min_bytes else encode(obj)
