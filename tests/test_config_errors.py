"""Every bad input raises one ConfigError whose message starts with the field
path the user wrote and shows the value, before anything runs."""

from __future__ import annotations

import json
import math

import pytest

from shadowcore.config import PluginRef, ShadowConfig, SloConfig, build_attrs
from shadowcore.engine.run import ScenarioRun
from shadowcore.engine.scenario import FakeBackend, FakeScenario
from shadowcore.engine.workload import Workload
from shadowcore.errors import ConfigError, ShadowError
from shadowcore.policy import load_policy


def raises_one(fn, field: str, value_text: str) -> ConfigError:
    """``fn()`` raises a single ConfigError at ``field`` whose message shows ``value_text``."""
    with pytest.raises(ConfigError) as info:
        fn()
    err = info.value
    assert type(err) is ConfigError
    assert isinstance(err, ShadowError) and isinstance(err, ValueError)
    # One error: the traceback shows no chained error (re-raises are ``from None``).
    assert err.__cause__ is None
    assert err.__context__ is None or err.__suppress_context__
    assert err.field == field, str(err)
    msg = str(err)
    assert msg.startswith(f"{field} = "), msg
    assert value_text in msg, msg
    return err


# -- SLOs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"ttft_s": -1}, "ttft_s", "-1"),
    ({"tpot_s": -0.1}, "tpot_s", "-0.1"),
    ({"ttft_s": 0}, "ttft_s", "0"),
    ({"tpot_s": float("nan")}, "tpot_s", "nan"),
    ({"ttft_s": "1"}, "ttft_s", "'1'"),
])
def test_slo_must_be_positive(kwargs, field, value):
    raises_one(lambda: SloConfig(**kwargs), field, value)


def test_negative_slo_in_scenario_names_full_path():
    err = raises_one(lambda: FakeScenario.from_dict({"slo": {"tpot_s": -0.1}}), "scenario.slo.tpot_s", "-0.1")
    assert err.value == -0.1
    assert "> 0" in err.problem


def test_scenario_errors_before_anything_runs(monkeypatch):
    drawn = []
    monkeypatch.setattr(ScenarioRun, "draw_workload", lambda run, sessions=None: drawn.append(run) or Workload())
    raises_one(lambda: FakeBackend().run({"slo": {"ttft_s": -2}}, ShadowConfig()), "scenario.slo.ttft_s", "-2")
    raises_one(
        lambda: FakeBackend().run({"duration_s": 1.0}, ShadowConfig(PluginRef("harvest-slo", {"beta": -1}))),
        "shadow.policy.args.beta", "-1",
    )
    assert drawn == []


# -- shadow cap ---------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [0, 1.5, -0.25, 0.0])
@pytest.mark.parametrize("policy", ["harvest-slo", "harvest", "no-shadow", "oracle-host"])
def test_shadow_cap_outside_unit_interval(policy, cap):
    err = raises_one(lambda: load_policy(PluginRef(policy, {"shadow_cap": cap})), "policy.args.shadow_cap", repr(cap))
    assert err.value == cap
    assert "(0, 1]" in err.problem


@pytest.mark.parametrize("cap", [1.0, 0.01])
def test_shadow_cap_inside_unit_interval_is_accepted(cap):
    assert load_policy(PluginRef("harvest-slo", {"shadow_cap": cap})).kv.shadow_cap_fraction == cap


# -- beta and the other component arguments ---------------------------------------------


@pytest.mark.parametrize("beta", [0, -1, -0.5])
@pytest.mark.parametrize("policy", ["harvest-slo", "harvest", "harvest-slo-host", "predictive"])
def test_beta_must_be_positive(policy, beta):
    raises_one(lambda: load_policy(PluginRef(policy, {"beta": beta})), "policy.args.beta", repr(beta))


@pytest.mark.parametrize(("policy", "args", "field", "value"), [
    ("harvest", {"delta": -1}, "policy.args.delta", "-1"),
    ("harvest-slo", {"n_min": -3}, "policy.args.n_min", "-3"),
    ("harvest-slo", {"margin": 1}, "policy.args.margin", "1"),
    ("harvest-slo", {"chunk_tokens": 0}, "policy.args.chunk_tokens", "0"),
    ("harvest", {"top_k": 0}, "policy.args.top_k", "0"),
    ("eager", {"gate": 1.5}, "policy.args.gate", "1.5"),
    ("predictive", {"gate": -0.1}, "policy.args.gate", "-0.1"),
    ("harvest", {"pseudo_count": -2}, "policy.args.pseudo_count", "-2"),
    ("oracle", {"cold_age_s": -5}, "policy.args.cold_age_s", "-5"),
    ("host-tier", {"host_capacity_bytes": -1}, "policy.args.host_capacity_bytes", "-1"),
    ("harvest-slo-host", {"pcie_bytes_per_s": 0}, "policy.args.pcie_bytes_per_s", "0"),
])
def test_component_arguments_are_reported_under_the_name_the_user_wrote(policy, args, field, value):
    raises_one(lambda: load_policy(PluginRef(policy, args)), field, value)


def test_load_policy_field_prefix_is_configurable():
    raises_one(lambda: load_policy(PluginRef("harvest", {"beta": 0}), field="shadow.policy"),
               "shadow.policy.args.beta", "0")


def test_unknown_and_conflicting_policy_arguments():
    err = raises_one(lambda: load_policy(PluginRef("harvest", {"bogus": 1})), "policy.args.bogus", "unknown argument")
    assert err.value == 1 and "beta" in err.problem  # names the known arguments
    raises_one(lambda: load_policy(PluginRef("harvest", {"top_k": 1, "gate": 0.2})), "policy.args", "'gate'")


# -- unknown plugin -----------------------------------------------------------------------


def test_unknown_policy_name():
    cfg = ShadowConfig.from_dict({"policy": "nope"})  # shape is fine; the name is checked when loaded
    assert cfg.policy.name == "nope"
    err = raises_one(lambda: load_policy(cfg.policy), "policy.name", "'nope'")
    assert "shadowprefill.policies" in err.problem
    assert "harvest-slo" in err.problem  # lists the known names


def test_unknown_policy_name_through_the_composition_root(monkeypatch):
    from shadowcore.pipeline import build_runtime

    cfg = ShadowConfig.from_dict({"policy": {"name": "nope", "args": {}}})
    with pytest.raises(ConfigError, match="'nope'") as info:
        build_runtime(cfg, cluster=None, models=("a", "b"))
    assert info.value.field.endswith("policy.name")

    drawn = []
    monkeypatch.setattr(ScenarioRun, "draw_workload", lambda run, sessions=None: drawn.append(run) or Workload())
    raises_one(lambda: FakeBackend().run({}, cfg), "shadow.policy.name", "'nope'")
    assert drawn == []


# -- arguments that are not JSON ------------------------------------------------------------


@pytest.mark.parametrize(("value", "shown"), [
    (object(), "<object object"),
    (float("nan"), "nan"),
    (float("inf"), "inf"),
    ({1, 2}, "{1, 2}"),
    (b"x", "b'x'"),
    ((1, 2j), "2j"),
])
def test_non_json_arguments_name_the_field(value, shown):
    field = "args.beta[1]" if isinstance(value, tuple) else "args.beta"
    raises_one(lambda: PluginRef("harvest", {"beta": value}), field, shown)


def test_non_json_arguments_through_from_dict_have_the_full_path():
    raises_one(lambda: ShadowConfig.from_dict({"policy": {"name": "harvest", "args": {"beta": math.nan}}}),
               "shadow.policy.args.beta", "nan")
    raises_one(lambda: ShadowConfig.from_dict({"policy": {"name": "harvest", "args": {"x": [1, {"a": math.inf}]}}}),
               "shadow.policy.args.x[1].a", "inf")
    raises_one(lambda: ShadowConfig.from_dict({"observers": ["pkg.mod:Obs", {"name": "pkg.mod:Obs",
                                                                           "args": {"s": {3}}}]}),
               "shadow.observers[1].args.s", "{3}")


def test_non_string_argument_key():
    raises_one(lambda: PluginRef("harvest", {1: 2}), "args", "1")


# -- unknown fields and bad shapes ----------------------------------------------------------


@pytest.mark.parametrize(("build", "field", "value"), [
    (lambda: ShadowConfig.from_dict({"polcy": "harvest"}), "shadow.polcy", "'harvest'"),
    (lambda: ShadowConfig.from_dict({"policy": {"name": "harvest", "arg": {}}}), "shadow.policy.arg", "{}"),
    (lambda: ShadowConfig.from_dict({"policy": 3}), "shadow.policy", "3"),
    (lambda: ShadowConfig.from_dict({"policy": {"name": ""}}), "shadow.policy.name", "''"),
    (lambda: ShadowConfig.from_dict({"seed": -1}), "shadow.seed", "-1"),
    (lambda: ShadowConfig.from_dict({"seed": 1.5}), "shadow.seed", "1.5"),
    (lambda: ShadowConfig.from_dict([1]), "shadow", "[1]"),
    (lambda: FakeScenario.from_dict({"bogus": 7}), "scenario.bogus", "7"),
    (lambda: FakeScenario.from_dict({"slo": {"ttft": 1}}), "scenario.slo.ttft", "1"),
    (lambda: FakeScenario.from_dict({"slo": 5}), "scenario.slo", "5"),
    (lambda: build_attrs(SloConfig, "deploy.slo", {"tpot": 0.02}), "deploy.slo.tpot", "0.02"),
])
def test_unknown_fields_and_bad_shapes(build, field, value):
    raises_one(build, field, value)


def test_unknown_field_lists_known_fields():
    err = raises_one(lambda: FakeScenario.from_dict({"slo": {"ttft": 1}}), "scenario.slo.ttft", "1")
    assert "ttft_s" in err.problem and "tpot_s" in err.problem


def test_first_bad_field_is_the_one_reported():
    # Several problems: one error, deterministic (first unknown key in sorted order).
    raises_one(lambda: ShadowConfig.from_dict({"zzz": 1, "aaa": 2, "seed": -1}), "shadow.aaa", "2")


# -- JSON round trip ------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [
    ShadowConfig(),
    ShadowConfig(PluginRef("harvest-slo-host", {"beta": 0.25, "shadow_cap": 0.5, "top_k": 1}), seed=7),
    ShadowConfig(PluginRef("predictive", {"gate": 0.3, "nested": {"a": [1, 2.5, None, True, "s"]}}), seed=3,
                 observers=(PluginRef("pkg.mod:Observer", {"path": "/tmp/x"}),)),
])
def test_shadow_config_json_round_trip(cfg):
    text = cfg.to_json()
    back = ShadowConfig.from_json(text)
    assert back.to_json() == text
    assert back.policy.name == cfg.policy.name
    assert dict(back.policy.args) == dict(cfg.policy.args)
    assert back.seed == cfg.seed
    assert [(o.name, dict(o.args)) for o in back.observers] == [(o.name, dict(o.args)) for o in cfg.observers]
    assert json.loads(text)["policy"] == {"name": cfg.policy.name, "args": dict(cfg.policy.args)}


def test_round_trip_args_tuple_becomes_list_and_stays_stable():
    cfg = ShadowConfig(PluginRef("harvest", {"xs": (1, 2)}))
    once = ShadowConfig.from_json(cfg.to_json())
    assert once.policy.args["xs"] == [1, 2]
    assert ShadowConfig.from_json(once.to_json()).to_json() == once.to_json() == cfg.to_json()


def test_from_json_validates():
    raises_one(lambda: ShadowConfig.from_json('{"seed": -4}'), "shadow.seed", "-4")


def test_config_error_survives_pickling() -> None:
    """Worker processes (sweep, simulate) send errors back pickled: the field survives."""
    import pickle

    from shadowcore.errors import ConfigError

    err = pickle.loads(pickle.dumps(ConfigError("scenario.models[0]", "GPT-9", "unknown model")))
    assert (err.field, err.value, err.problem) == ("scenario.models[0]", "GPT-9", "unknown model")
    assert str(err) == "scenario.models[0] = 'GPT-9': unknown model"
