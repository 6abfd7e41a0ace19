"""The one plugin-reference syntax (``NAME`` or ``NAME:{json}``, comma lists split
only outside the JSON): the parser, and ``--policy``/``--policies`` of
``simulate``; the other commands' tests sit with their backends
(tests/sim/test_experiments.py, tests/vllm/test_serve.py,
tests/gateway/test_config_router.py)."""

from __future__ import annotations

import pytest

from shadowcore.cli import main
from shadowcore.config import PluginRef, parse_ref, parse_refs, split_refs
from shadowcore.errors import ConfigError


@pytest.mark.parametrize(("text", "expected"), [
    ("no-shadow", [("no-shadow", {})]),
    ("a,b , c", [("a", {}), ("b", {}), ("c", {})]),
    ('harvest-slo:{"beta":0.3,"delta":0.1},no-shadow', [("harvest-slo", {"beta": 0.3, "delta": 0.1}),
                                                       ("no-shadow", {})]),
    (' x : { "a": {"b": [1, 2, {"c": "},{[\\"" }]} } , y', [("x", {"a": {"b": [1, 2, {"c": '},{["'}]}}), ("y", {})]),
    ("pkg.mod:factory", [("pkg.mod:factory", {})]),  # a colon not followed by { is part of the name
    ('pkg.mod:factory:{"k": 1},z', [("pkg.mod:factory", {"k": 1}), ("z", {})]),
])
def test_comma_lists_split_only_outside_the_json(text, expected) -> None:
    assert split_refs(text) == expected
    assert parse_refs(text) == [PluginRef(n, a) for n, a in expected]


@pytest.mark.parametrize(("text", "problem"), [
    ('harvest-slo:{"beta":0.3,', ("harvest-slo: arguments are not JSON: Expecting property name enclosed in "
                                  "double quotes at column 25")),
    ('a,harvest-slo:{"beta": lru}', "harvest-slo: arguments are not JSON: Expecting value at column 24"),
    ("a,,b", "empty name at column 3"),
    ("a,", "empty name at column 3"),
    ('x{"a":1}', "'{' at column 2 inside a name"),
    ('a:{"b":1} c', "a: 'c' at column 11 after the arguments"),
    ('a:{"b":1,"b":2}', "a: arguments are not JSON: duplicate key 'b'"),
])
def test_bad_lists_name_the_reference_and_the_column(text, problem) -> None:
    with pytest.raises(ConfigError) as info:
        parse_refs(text, "--policies")
    assert (info.value.field, info.value.value) == ("--policies", text)
    assert info.value.problem.startswith(problem), info.value.problem


def test_argument_values_are_checked_per_reference() -> None:
    with pytest.raises(ConfigError) as info:
        parse_refs('a,b:{"x": NaN}', "--policies")
    assert info.value.field == "--policies b.args.x"
    with pytest.raises(ConfigError) as info:
        parse_ref("a,b", "shadow.policy")
    assert info.value.field == "shadow.policy" and "one reference expected, got 2" in info.value.problem
    assert parse_ref('harvest-slo: {"beta": 0.3}') == PluginRef("harvest-slo", {"beta": 0.3})
    # configuration files take the same text: {"policy": "NAME:{json}"}
    assert PluginRef.parse("shadow.policy", 'harvest-slo:{"beta": 0.3}') == PluginRef("harvest-slo", {"beta": 0.3})


def _simulated(capsys) -> list[str]:
    """The policies of simulate's table, in row order (variants ``name(k=v)`` by name)."""
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("---")) + 1
    names = []
    for line in out[start:]:
        if not line.strip() or line.startswith(("one run", "reductions", "!", "left out", " ")):
            break
        names.append(line.split()[0].split("(")[0].rstrip("!"))
    return names


def test_simulate_takes_policies_with_arguments_from_either_flag(capsys) -> None:
    args = 'harvest-slo:{"beta": 0.3, "delta": 0.1, "n_min": 128}'
    assert main(["simulate", "--backend", "fake", "--duration", "10", "--policies", f"no-shadow,{args}"]) == 0
    assert _simulated(capsys) == ["no-shadow", "harvest-slo"]
    assert main(["simulate", "--backend", "fake", "--duration", "10", "--policy", args,
                 "--policies", "no-shadow,eager"]) == 0  # both flags, in command-line order
    assert _simulated(capsys) == ["harvest-slo", "no-shadow", "eager"]


@pytest.mark.parametrize(("flag", "text", "where"), [
    ("--policies", 'no-shadow,harvest-slo:{"beta": 0.3, "delta":}', "harvest-slo: arguments are not JSON"),
    ("--policy", 'harvest-slo:{"beta": 0.3, "delta": -1}', "--policy harvest-slo.args.delta = -1"),
    ("--policies", "no-shadow,nope", "--policies nope.name = 'nope'"),
])
def test_simulate_bad_policy_is_one_line_naming_it(capsys, flag, text, where) -> None:
    assert main(["simulate", "--backend", "fake", "--duration", "5", flag, text]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and where in err and flag in err, err
