"""Gateway configuration errors (field, value, file:line) and routers."""

from __future__ import annotations

from pathlib import Path

import pytest
from shadow_gateway.config import SchedulerKind, load_config, parse_config
from shadow_gateway.router import ClientModel, Markov, RouteError, RouteRequest, WarmCost, Warmth, load_router

from shadowcore.cli import main as cli_main
from shadowcore.config import PluginRef
from shadowcore.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gateway.yaml"
GOOD = "models:\n  a:\n    instances: [http://127.0.0.1:1]\n  b:\n    instances: [http://127.0.0.1:2]\n"


def test_example_config_loads():
    cfg = load_config(EXAMPLE)
    assert cfg.model_names == ("tiny-a", "tiny-b")
    assert cfg.model("tiny-b").instances[0].scheduler is SchedulerKind.STOCK
    assert cfg.model("tiny-a").instances[0].id == "tiny-a/0"


@pytest.mark.parametrize(("text", "field", "line", "value"), [
    (GOOD + "router: {name: nope}\n", None, None, "'nope'"),
    ("models:\n  a:\n    instances:\n      - url: ftp://x\n", "models.a.instances[0].url", 4, "'ftp://x'"),
    ("models:\n  a:\n    block_size: 0\n    instances: [http://h:1]\n", "models.a.block_size", 3, "0"),
    ("models:\n  a:\n    instances: [{url: 'http://h:1', scheduler: fast}]\n", "models.a.instances[0].scheduler",
     3, "'fast'"),
    (GOOD + "health: {interval_s: -1}\n", "health.interval_s", 6, "-1"),
    (GOOD + "upstream: {retries: 1.5}\n", "upstream.retries", 6, "1.5"),
    (GOOD + "shadow: {policy: oracle}\n", "shadow.policy.name", 6, "'oracle'"),
    (GOOD + "shadow: {policy: {name: harvest, args: {beta: -2}}}\n", "shadow.policy.args.beta", 6, "-2"),
    (GOOD + "colour: red\n", "colour", 6, "'red'"),
    ("models:\n  a: {instances: []}\n", "models.a.instances", 2, "[]"),
    ("models:\n  a:\n    instances: [http://h:1\n", None, None, "''"),
])
def test_bad_config_names_field_value_and_line(text, field, line, value):
    with pytest.raises(ConfigError) as info:
        cfg = parse_config(text, "gw.yaml")
        load_router(cfg.router)
    err = info.value
    msg = str(err)
    if field is not None:
        assert err.field == field, msg
        assert msg.startswith(f"{field} = {value}"), msg
        assert msg.endswith(f"(gw.yaml:{line})"), msg
    else:
        assert value in msg


def test_policy_field_takes_the_command_line_syntax():
    cfg = parse_config(GOOD + 'shadow: {policy: \'harvest-slo:{"beta": 0.3, "delta": 0.1}\'}\n', "gw.yaml")
    assert cfg.shadow.policy == PluginRef("harvest-slo", {"beta": 0.3, "delta": 0.1})
    with pytest.raises(ConfigError) as info:
        parse_config(GOOD + 'shadow: {policy: \'harvest-slo:{"beta": 0.3,}\'}\n', "gw.yaml")
    assert info.value.field == "shadow.policy", str(info.value)
    assert "harvest-slo: arguments are not JSON" in str(info.value) and "column 26" in str(info.value)


def test_serve_command_reports_bad_config(tmp_path, capsys):
    bad = tmp_path / "g.yaml"
    bad.write_text(GOOD + "listen: {port: -1}\n")
    assert cli_main(["serve", "--config", str(bad), "--check"]) == 2
    assert f"listen.port = -1: must be an integer >= 0 ({bad}:6)" in capsys.readouterr().err
    assert cli_main(["serve", "--config", str(EXAMPLE), "--check"]) == 0


class View:
    models = ("a", "b", "c")

    def __init__(self, current=None, warm=None):
        self._current, self._warm = current, warm or {}

    def price(self, model):
        return {"a": (1.0, 0.1, 2.0), "b": (0.5, 0.05, 1.0), "c": (3.0, 0.3, 6.0)}[model]

    def current_model(self, session_id):
        return self._current

    def warmth(self, session_id, model):
        return Warmth(session_id, model, None, 1000, self._warm.get(model, 0))


def _call(model=None, session="s", n=0):
    return RouteRequest(session, model, "completions", {}, n)


def test_client_model_router_honours_and_rejects():
    assert ClientModel().choose(_call("b"), View()) == "b"
    assert ClientModel(default="c").choose(_call(None), View()) == "c"
    with pytest.raises(RouteError, match="'zz' is not served"):
        ClientModel().choose(_call("zz"), View())


def test_markov_router_is_reproducible_and_switches_at_its_rate():
    r = Markov(switch_probability=0.3, seed=4)
    picks = [r.choose(_call("a", f"s{i}", n), View(current="a")) for i in range(200) for n in range(1, 6)]
    assert picks == [r.choose(_call("a", f"s{i}", n), View(current="a")) for i in range(200) for n in range(1, 6)]
    rate = sum(p != "a" for p in picks) / len(picks)
    assert 0.25 < rate < 0.35
    assert r.choose(_call("c", "new", 0), View(current=None)) == "c"


def test_warm_cost_router_prices_a_switch_with_the_warmth_query():
    r = WarmCost()
    assert r.choose(_call(), View(current="a")) == "b"  # b is cheapest cold
    # a warm: 1000 tokens at the cached price 0.1 beat b's cold 0.5
    assert r.choose(_call(), View(current="a", warm={"a": 1000})) == "a"
    with pytest.raises(RouteError, match="unknown models"):
        WarmCost(candidates=("a", "x")).choose(_call(), View())


def test_router_plugins_load_by_name_and_errors_name_the_field():
    assert isinstance(load_router(PluginRef("markov", {"switch_probability": 0.5})), Markov)
    with pytest.raises(ConfigError) as info:
        load_router(PluginRef("markov", {"switch_probability": 2}))
    assert info.value.field == "router.args.switch_probability"
    with pytest.raises(ConfigError) as info:
        load_router(PluginRef("markov", {"colour": 1}))
    assert info.value.field == "router.args"


def test_known_prefix_matches_append_only_histories_exactly():
    from shadow_gateway.cluster import KnownPrefix

    def brute(a, a_len, b, b_len):
        n = 0
        while n < min(a_len, b_len) and a[n] == b[n]:
            n += 1
        return n

    known_list = list(range(100))
    k = KnownPrefix(routed_ids=known_list, routed_len=96, shadow_ids=known_list, shadow_len=64)
    history = list(range(40)) + [999] + list(range(41, 50))  # diverges at 40
    for step in range(5):  # the history grows in place; the memo must stay exact
        assert k.matched(history, len(history)) == (brute(known_list, 96, history, len(history)),
                                                      brute(known_list, 64, history, len(history)))
        assert k.matched(history, 30) == (30, 30)
        history.extend(range(50 + 10 * step, 60 + 10 * step))
    history = list(range(90))  # a new epoch: a new list
    assert k.matched(history, 90) == (90, 64)
    assert k.matched(history, 50) == (50, 50)
    history.extend([7, 7, 7])  # grows past 96 after matching all of the shadow prefix and some of the routed one
    assert k.matched(history, 93) == (90, 64)
    history.extend(range(93, 100))
    assert k.matched(history, 100) == (90, 64)  # 90..92 hold 7s: the routed prefix diverged at 90
    k.routed_ids, k.routed_len = [5] * 10, 10  # the known prefix replaced
    assert k.matched(history, 90) == (0, 64)
    assert k.matched(known_list, 100) == (0, 64)
