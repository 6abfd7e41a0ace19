"""What every machine of :mod:`shadowcore.testing.machines` shares."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

from shadowcore.testing.contracts import EPS_S

Draw = Callable[[st.SearchStrategy[Any]], Any]

__all__ = ["EPS_S", "Draw", "pick"]


def pick(data: st.DataObject, items: Sequence[Any]) -> Any:
    """One of ``items`` (an index draw: no strategy object built per call)."""
    return items[data.draw(st.integers(0, len(items) - 1))]
