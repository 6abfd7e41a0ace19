"""The request tag between router side and engines (shadowcore.wire)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shadowcore.wire import ShadowEnd, ShadowStop, ShadowTag, TagKind, parse_stop, parse_tag

names = st.text(st.characters(categories=("L", "N")), min_size=1, max_size=12)


@given(names, names, st.integers(0, 10**6), st.floats(0.0, 1.0))
def test_shadow_tag_round_trips(session: str, model: str, epoch: int, p: float) -> None:
    tag = ShadowTag(TagKind.SHADOW, session, model, epoch, p)
    assert parse_tag(tag.to_extra_args()) == tag


def test_imminence_round_trips_and_is_sent_only_when_true() -> None:
    tag = ShadowTag(TagKind.SHADOW, "s", "m", 2, 0.5, imminent=True)
    assert tag.to_extra_args()["shadowprefill_imminent"] is True
    assert parse_tag(tag.to_extra_args()) == tag
    plain = ShadowTag(TagKind.SHADOW, "s", "m", 2, 0.5)
    assert "shadowprefill_imminent" not in plain.to_extra_args()
    assert parse_tag(plain.to_extra_args()).imminent is False
    assert parse_tag({**plain.to_extra_args(), "shadowprefill_imminent": "true"}).imminent is True
    with pytest.raises(ValueError, match="shadowprefill_imminent"):
        parse_tag({**plain.to_extra_args(), "shadowprefill_imminent": 1})


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


@given(st.sampled_from(list(ShadowEnd)), st.none() | st.integers(0, 10**7), st.text(max_size=30))
def test_shadow_stop_round_trips(end: ShadowEnd, held: int | None, detail: str) -> None:
    stop = ShadowStop(end, held, detail)
    assert parse_stop(stop.to_stop_reason()) == stop


def test_stop_reasons_that_are_not_shadow_ends() -> None:
    assert parse_stop(None) is None
    assert parse_stop(7) is None  # a stop token id
    assert parse_stop("</s>") is None
    assert parse_stop("shadowprefill:tail-below-n-min held=992") == ShadowStop(ShadowEnd.BELOW_N_MIN, 992)


@pytest.mark.parametrize(
    ("reason", "named"),
    [
        ("shadowprefill:bogus", "unknown end 'bogus'"),
        ("shadowprefill:prefilled held=x", "held=<non-negative integer>"),
        ("shadowprefill:prefilled held=-1", "held=<non-negative integer>"),
        ("shadowprefill:prefilled (no end", "unterminated detail"),
    ],
)
def test_malformed_stop_reasons_are_named(reason: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_stop(reason)
