"""The request tag between router side and engines (shadowcore.wire)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shadowcore.wire import ShadowTag, TagKind, parse_tag

names = st.text(st.characters(categories=("L", "N")), min_size=1, max_size=12)


@given(names, names, st.integers(0, 10**6), st.floats(0.0, 1.0))
def test_shadow_tag_round_trips(session: str, model: str, epoch: int, p: float) -> None:
    tag = ShadowTag(TagKind.SHADOW, session, model, epoch, p)
    assert parse_tag(tag.to_extra_args()) == tag


def test_routed_tag_and_normal_traffic() -> None:
    assert parse_tag(ShadowTag(TagKind.ROUTED, "s").to_extra_args()) == ShadowTag(TagKind.ROUTED, "s")
    assert parse_tag(None) is None
    assert parse_tag({"temperature_hint": 1}) is None


def test_numbers_sent_as_strings_over_http_are_read() -> None:
    tag = parse_tag({"shadowprefill_kind": "shadow", "shadowprefill_session": "s",
                     "shadowprefill_target_model": "m", "shadowprefill_epoch": "3",
                     "shadowprefill_switch_probability": "0.25"})
    assert tag == ShadowTag(TagKind.SHADOW, "s", "m", 3, 0.25)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"shadowprefill_kind": "bogus", "shadowprefill_session": "s"}, "shadowprefill_kind"),
        ({"shadowprefill_kind": "routed"}, "shadowprefill_session"),
        ({"shadowprefill_kind": "shadow", "shadowprefill_session": "s"}, "shadowprefill_target_model"),
        ({"shadowprefill_kind": "shadow", "shadowprefill_session": "s", "shadowprefill_target_model": "m",
          "shadowprefill_switch_probability": 1.5}, "shadowprefill_switch_probability"),
        ({"shadowprefill_kind": "shadow", "shadowprefill_session": "s", "shadowprefill_target_model": "m",
          "shadowprefill_epoch": -1}, "shadowprefill_epoch"),
        ({"shadowprefill_kind": "shadow", "shadowprefill_session": "s", "shadowprefill_target_model": "m",
          "shadowprefill_epoch": "x"}, "shadowprefill_epoch"),
    ],
)
def test_malformed_tags_name_the_key(args: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_tag(args)
