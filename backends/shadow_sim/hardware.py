"""Accelerator specs and the paper's tensor-parallel sizing rule.

Invariants:

* A :class:`DeviceSpec` is immutable and every number in it is > 0 (power:
  ``busy_power_w >= idle_power_w >= 0``).
* Specs are vendor datasheet peaks (dense BF16, no sparsity); the latency
  model applies its own efficiency factors.
* :func:`tensor_parallel_degree` returns the smallest allowed degree at which
  a model's served weights take at most ``max_weight_fraction`` of each GPU's
  HBM (Appendix B: half), and raises ConfigError when none does.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from shadow_sim.models import ModelConfig
from shadowcore._validators import non_empty_str, non_negative, positive
from shadowcore.errors import ConfigError


@attrs.frozen
class DeviceSpec:
    """One GPU. ``nvlink_bandwidth_bytes_per_s`` is per direction per GPU."""

    name: str = attrs.field(validator=non_empty_str)
    hbm_bytes: float = attrs.field(validator=positive)
    hbm_bandwidth_bytes_per_s: float = attrs.field(validator=positive)
    bf16_flops_per_s: float = attrs.field(validator=positive)
    nvlink_bandwidth_bytes_per_s: float = attrs.field(validator=positive)
    idle_power_w: float = attrs.field(validator=non_negative)
    busy_power_w: float = attrs.field(validator=positive)

    def __attrs_post_init__(self) -> None:
        if self.busy_power_w < self.idle_power_w:
            raise ConfigError("busy_power_w", self.busy_power_w, f"must be >= idle_power_w ({self.idle_power_w})")


# NVIDIA datasheets: H100 SXM5 80 GB HBM3 3.35 TB/s, H200 141 GB HBM3e 4.8 TB/s;
# both 989 TFLOPS dense BF16, NVLink 4 at 900 GB/s bidirectional (450 GB/s each
# way), 700 W TDP. "80 GB" is taken as 80e9 bytes, the figure the paper's
# half-of-HBM rule implies (it puts Qwen3-Next-80B at TP=8). Idle power is a
# typical nvidia-smi reading of an idle SXM part, not a datasheet number.
H100_80GB = DeviceSpec("H100-80GB", 80e9, 3.35e12, 989.4e12, 450e9, 70.0, 700.0)
H200 = DeviceSpec("H200", 141e9, 4.8e12, 989.4e12, 450e9, 75.0, 700.0)

DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (H100_80GB, H200)}
"""Built-in devices, keyed by canonical name."""

_ALIASES: dict[str, str] = {
    "h100": "H100-80GB",
    "h100-sxm": "H100-80GB",
    "h100-80gb": "H100-80GB",
    "h100-sxm-80gb": "H100-80GB",
    "h200": "H200",
    "h200-141gb": "H200",
}

TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)


def get_device(name: str) -> DeviceSpec:
    """The built-in device called ``name`` (case-insensitive); ConfigError if unknown."""
    canonical = _ALIASES.get(name.strip().lower()) if isinstance(name, str) else None
    if canonical is None:
        raise ConfigError("device", name, f"unknown device; known devices: {', '.join(DEVICES)}")
    return DEVICES[canonical]


def tensor_parallel_degree(
    model: ModelConfig,
    device: DeviceSpec,
    degrees: Sequence[int] = TP_DEGREES,
    max_weight_fraction: float = 0.5,
) -> int:
    """Smallest of ``degrees`` at which served weights per GPU fit the fraction of HBM."""
    budget = device.hbm_bytes * max_weight_fraction
    for tp in sorted(degrees):
        if model.serving_weight_bytes / tp <= budget:
            return tp
    raise ConfigError(
        "tensor_parallel_degree",
        model.name,
        f"{model.serving_weight_bytes / 1e9:.1f} GB of weights exceed "
        f"{max_weight_fraction:g} of {device.name} HBM at every degree in {tuple(degrees)}",
    )


__all__ = [
    "DEVICES",
    "H100_80GB",
    "H200",
    "TP_DEGREES",
    "DeviceSpec",
    "get_device",
    "tensor_parallel_degree",
]
