"""Latency profiles: a kernel-level latency model calibrated to an end-to-end engine.

Kernel tables (Vidur's, measured per operator) miss what a real engine adds
around its kernels: scheduling and Python per iteration, per-sequence
bookkeeping, kernels slower in the engine than in isolation (paged attention,
chunked-prefill masks). A :class:`LatencyProfile` states that difference in
four non-negative terms, and :meth:`LatencyProfile.apply` wraps any
:class:`~shadowcore.latency.LatencyModel` with it:

``t' = t + (prefill_scale - 1) * t(prefills only) + (decode_scale - 1) * t(decodes only)
+ iteration_overhead_s + per_sequence_s * sequences``

where ``t`` is the base model's time of the whole batch. With both scales at
least 1 (validated: an engine is not faster than its own kernels; a faster
engine needs another base model, e.g. a fitted
:class:`~shadowcore.latency.LinearLatencyModel`) every term is non-decreasing
in every token count, so the wrapped model keeps the Protocol's invariants
(pure, monotone, empty batch 0.0). The identity profile returns the base model
itself, so an uncalibrated run is bit-identical to one without a profile.

:func:`fit_profile` fits the four terms to measured iterations (batch shape and
duration, e.g. from vLLM's per-step timing) by non-negative least squares;
:func:`fit_linear` fits a :class:`~shadowcore.latency.LinearLatencyModel`
from scratch. Profiles are JSON files (:meth:`LatencyProfile.from_file`); bad
files are one :class:`~shadowcore.errors.ConfigError` naming the file and
field. Measured steps are JSON Lines (:func:`read_steps`): ``{"prefills":
[[new, context], ...], "decodes": [context, ...], "duration_s": x}``, errors
name ``file:line``.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from shadowcore._validators import non_negative
from shadowcore.errors import ConfigError
from shadowcore.latency import BatchShape, LatencyModel, LinearLatencyModel, PrefillChunk

PROFILE_VERSION = 1


def _at_least_one(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1.0):
        raise ConfigError(attribute.name, value, "must be a finite number >= 1 (an engine is not faster than its "
                          "kernels; fit another base model instead)")


@attrs.frozen
class LatencyProfile:
    """How an end-to-end engine differs from a kernel-level latency model (module docstring)."""

    name: str = "identity"
    prefill_scale: float = attrs.field(default=1.0, validator=_at_least_one)
    decode_scale: float = attrs.field(default=1.0, validator=_at_least_one)
    iteration_overhead_s: float = attrs.field(default=0.0, validator=non_negative)
    per_sequence_s: float = attrs.field(default=0.0, validator=non_negative)
    #: What the profile was fitted to, in words (shown with results).
    source: str = ""

    @property
    def is_identity(self) -> bool:
        return (self.prefill_scale, self.decode_scale, self.iteration_overhead_s, self.per_sequence_s) == (1, 1, 0, 0)

    def apply(self, model: LatencyModel) -> LatencyModel:
        return model if self.is_identity else CalibratedLatencyModel(model, self)

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **attrs.asdict(self)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> LatencyProfile:
        if not isinstance(data, dict):
            raise ConfigError(where, data, "must be a JSON object")
        data = dict(data)
        version = data.pop("version", PROFILE_VERSION)
        if version != PROFILE_VERSION:
            raise ConfigError(f"{where}.version", version, f"this build reads version {PROFILE_VERSION}")
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", data[unknown[0]], f"unknown field (known: {', '.join(sorted(known))})")
        try:
            return cls(**data)
        except ConfigError as e:
            raise ConfigError(f"{where}.{e.field}", e.value, e.problem) from None
        except TypeError as e:
            raise ConfigError(where, data, str(e)) from None

    @classmethod
    def from_file(cls, path: str | Path) -> LatencyProfile:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except OSError as e:
            raise ConfigError("latency_profile", str(p), f"cannot read: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ConfigError("latency_profile", f"{p}:{e.lineno}:{e.colno}", f"not JSON: {e.msg}") from None
        return cls.from_dict(data, where=str(p))

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


@attrs.frozen
class CalibratedLatencyModel:
    """A base :class:`~shadowcore.latency.LatencyModel` with a :class:`LatencyProfile` applied.

    Invariants: pure and non-decreasing in every token count when the base is
    (the profile's terms are non-negative combinations of monotone parts); 0.0
    for an empty batch.
    """

    base: LatencyModel
    profile: LatencyProfile

    def predict_s(self, batch: BatchShape) -> float:
        if batch.is_empty:
            return 0.0
        base, pr = self.base, self.profile
        t = base.predict_s(batch)
        has_prefill = batch.num_prefill_tokens > 0
        if has_prefill and batch.num_decodes:
            p = base.predict_s(BatchShape(batch.prefills, ()))
            d = base.predict_s(BatchShape((), batch.decode_context_tokens))
        elif has_prefill:
            p, d = t, 0.0
        else:
            p, d = 0.0, t
        seqs = batch.num_decodes + sum(1 for c in batch.prefills if c.num_new_tokens)
        return (t + (pr.prefill_scale - 1.0) * p + (pr.decode_scale - 1.0) * d
                + pr.iteration_overhead_s + pr.per_sequence_s * seqs)

    def predict_decodes_s(self, num_decodes: int, total_context: int, max_context: int) -> float | None:
        """:meth:`predict_s` of a decode-only batch from its aggregates, when the base can tell."""
        fast = getattr(self.base, "predict_decodes_s", None)
        t = fast(num_decodes, total_context, max_context) if fast is not None else None
        if t is None:
            return None
        pr = self.profile
        return t + (pr.decode_scale - 1.0) * t + pr.iteration_overhead_s + pr.per_sequence_s * num_decodes


# ----------------------------------------------------------------------------- measured steps
@attrs.frozen
class MeasuredStep:
    """One engine iteration as measured: its batch and how long it took."""

    batch: BatchShape
    duration_s: float = attrs.field(validator=non_negative)


def read_steps(path: str | Path) -> list[MeasuredStep]:
    """Measured iterations from a JSON Lines file (module docstring); blank lines skipped."""
    p = Path(path)
    out = []
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ConfigError("steps", str(p), f"cannot read: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(where, line[:60], f"not JSON: {e.msg}") from None
        out.append(_step(row, where))
    if not out:
        raise ConfigError("steps", str(p), "no measured steps in the file")
    return out


def _step(row: Any, where: str) -> MeasuredStep:
    if not isinstance(row, dict):
        raise ConfigError(where, row, "each line must be a JSON object")
    unknown = sorted(set(row) - {"prefills", "decodes", "duration_s"})
    if unknown:
        raise ConfigError(f"{where}:{unknown[0]}", row[unknown[0]], "unknown field (prefills, decodes, duration_s)")
    try:
        prefills = tuple(PrefillChunk(int(q), int(c)) for q, c in _pairs(row.get("prefills", []), where))
        decodes = tuple(_int(c, f"{where}:decodes") for c in row.get("decodes", []))
        duration = row["duration_s"]
    except KeyError:
        raise ConfigError(f"{where}:duration_s", None, "missing") from None
    if not (isinstance(duration, (int, float)) and math.isfinite(duration) and duration > 0):
        raise ConfigError(f"{where}:duration_s", duration, "must be a finite number > 0")
    batch = BatchShape(prefills, decodes)
    if batch.is_empty:
        raise ConfigError(where, row, "an iteration with no tokens cannot be fitted")
    return MeasuredStep(batch, float(duration))


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(where, v, "must be a non-negative integer")
    return v


def _pairs(v: Any, where: str) -> Iterable[tuple[int, int]]:
    if not isinstance(v, list):
        raise ConfigError(f"{where}:prefills", v, "must be a list of [new_tokens, context_tokens]")
    for item in v:
        if not (isinstance(item, list) and len(item) == 2):
            raise ConfigError(f"{where}:prefills", item, "each entry must be [new_tokens, context_tokens]")
        yield _int(item[0], f"{where}:prefills"), _int(item[1], f"{where}:prefills")


def write_steps(path: str | Path, steps: Iterable[MeasuredStep]) -> None:
    with Path(path).open("w") as fh:
        for s in steps:
            row = {"prefills": [[c.num_new_tokens, c.num_context_tokens] for c in s.batch.prefills],
                   "decodes": list(s.batch.decode_context_tokens), "duration_s": s.duration_s}
            fh.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------- fitting
def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best of every
    active set (exact; 2^k solves, k <= 6 here)."""
    k = a.shape[1]
    best, best_err = np.zeros(k), float(np.sum(b * b))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.all(x >= 0):
                err = float(np.sum((sub @ x - b) ** 2))
                if err < best_err:
                    best, best_err = np.zeros(k), err
                    best[list(cols)] = x
    return best


def fit_profile(base: LatencyModel, steps: Sequence[MeasuredStep], name: str = "fitted",
                source: str = "") -> LatencyProfile:
    """The profile whose wrapped ``base`` best predicts ``steps`` (least squares,
    every term non-negative, scales >= 1)."""
    if len(steps) < 4:
        raise ConfigError("steps", len(steps), "need at least 4 measured steps to fit 4 terms")
    rows, rest = [], []
    for s in steps:
        b = s.batch
        t = base.predict_s(b)
        p = base.predict_s(BatchShape(b.prefills, ())) if b.num_prefill_tokens else 0.0
        d = base.predict_s(BatchShape((), b.decode_context_tokens)) if b.num_decodes else 0.0
        seqs = b.num_decodes + sum(1 for c in b.prefills if c.num_new_tokens)
        rows.append((p, d, 1.0, float(seqs)))
        rest.append(s.duration_s - t)
    x = nnls(np.array(rows), np.array(rest))
    return LatencyProfile(name, 1.0 + float(x[0]), 1.0 + float(x[1]), float(x[2]), float(x[3]),
                          source or f"fitted to {len(steps)} measured steps")


def fit_linear(steps: Sequence[MeasuredStep]) -> LinearLatencyModel:
    """A :class:`~shadowcore.latency.LinearLatencyModel` fitted to ``steps`` (non-negative least squares)."""
    if len(steps) < 5:
        raise ConfigError("steps", len(steps), "need at least 5 measured steps to fit 5 coefficients")
    rows = []
    for s in steps:
        b = s.batch
        pairs = sum(c.num_new_tokens * (c.num_context_tokens + c.num_new_tokens / 2.0) for c in b.prefills)
        rows.append((1.0, float(b.num_prefill_tokens), pairs, float(b.num_decodes), float(sum(b.decode_context_tokens))))
    x = nnls(np.array(rows), np.array([s.duration_s for s in steps]))
    return LinearLatencyModel(*(float(v) for v in x))


def prediction_errors(model: LatencyModel, steps: Sequence[MeasuredStep]) -> np.ndarray:
    """Relative errors (predicted - measured) / measured, per step."""
    return np.array([(model.predict_s(s.batch) - s.duration_s) / s.duration_s for s in steps])


__all__ = [
    "PROFILE_VERSION",
    "CalibratedLatencyModel",
    "LatencyProfile",
    "MeasuredStep",
    "fit_linear",
    "fit_profile",
    "nnls",
    "prediction_errors",
    "read_steps",
    "write_steps",
]
