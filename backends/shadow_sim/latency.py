"""The simulator's entry point to its latency models.

:func:`latency_model` returns a :class:`shadowcore.latency.LatencyModel` for a
catalog model on a device: ``kind="vidur"`` is Vidur's execution-time
predictor trained offline on aiconfigurator-core's measured kernels
(:mod:`shadow_sim.vidur_latency`; needs the ``sim`` extra, trains once per
configuration and then loads cached tables), ``kind="roofline"`` the analytic
:class:`~shadow_sim.roofline.RooflineLatencyModel` (no data, no extra
dependencies), and ``kind="auto"`` the Vidur model when the ``sim`` extra is
installed, else the roofline model.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shadow_sim.hardware import DeviceSpec
from shadow_sim.models import ModelConfig
from shadowcore.calibration import LatencyProfile
from shadowcore.errors import ConfigError
from shadowcore.latency import LatencyModel

#: Shipped latency profiles (``<name>.json`` next to this module, in ``profiles/``).
PROFILES_DIR = Path(__file__).with_name("profiles")

KINDS = ("vidur", "roofline", "auto")


def vidur_available() -> bool:
    """Whether the ``sim`` extra's packages (vidur, aiconfigurator-core, pandas) are importable."""
    return all(importlib.util.find_spec(m) is not None for m in ("vidur", "aiconfigurator_core", "pandas", "rich"))


def latency_model(
    name: str | ModelConfig,
    device: str | DeviceSpec = "H100-80GB",
    tp: int | None = None,
    kind: str = "vidur",
    **options: Any,
) -> LatencyModel:
    """A latency model of ``name`` on ``tp`` ``device`` GPUs (None: the half-of-HBM rule).

    ``options`` go to the chosen model's ``for_model`` (roofline efficiency
    knobs; for Vidur ``grid``, ``training``, ``cache_dir``, ``progress``,
    ``bandwidth`` and the overhead knobs).
    """
    if kind == "auto":
        kind = "vidur" if vidur_available() else "roofline"
    if kind == "roofline":
        from shadow_sim.roofline import RooflineLatencyModel

        return RooflineLatencyModel.for_model(name, device, tp, **options)
    if kind == "vidur":
        if not vidur_available():
            raise ConfigError("kind", kind, "needs the sim extra: pip install 'shadowprefill[sim]'")
        from shadow_sim.vidur_latency import VidurLatencyModel

        return VidurLatencyModel.for_model(name, device, tp, **options)
    raise ConfigError("kind", kind, f"must be one of {KINDS}")


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def resolve_profile(value: str | Mapping[str, Any] | LatencyProfile | None, field: str = "latency_profile",
                    ) -> LatencyProfile:
    """A :class:`~shadowcore.calibration.LatencyProfile` from a shipped name, a
    JSON file path, its fields, or ``""``/None (the identity: no calibration)."""
    if value is None or value == "":
        return LatencyProfile()
    if isinstance(value, LatencyProfile):
        return value
    if isinstance(value, Mapping):
        return LatencyProfile.from_dict(dict(value), where=field)
    if not isinstance(value, str):
        raise ConfigError(field, value, "must be a shipped profile name, a JSON file or an object")
    shipped = PROFILES_DIR / f"{value}.json"
    if shipped.exists():
        return LatencyProfile.from_file(shipped)
    if not Path(value).exists():
        raise ConfigError(field, value, f"no such file and not a shipped profile ({', '.join(shipped_profiles())})")
    return LatencyProfile.from_file(value)


__all__ = ["KINDS", "PROFILES_DIR", "latency_model", "resolve_profile", "shipped_profiles", "vidur_available"]
