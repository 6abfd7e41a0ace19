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
    # listen: port range, host type, unknown keys, loopback only without client keys
    (GOOD + "listen: {port: 70000}\n", "listen.port", 6, "70000"),
    (GOOD + "listen:\n  host: 127.0.0.1\n  port: 0\n", "listen.port", 8, "0"),
    (GOOD + "listen:\n  host: 123\n", "listen.host", 7, "123"),
    (GOOD + "listen:\n  host: 'no such host!'\n", "listen.host", 7, "'no such host!'"),
    (GOOD + "listen:\n  port: 8000\n  hots: x\n", "listen.hots", 8, "'x'"),
    (GOOD + "listen: {host: 0.0.0.0}\n", "listen.host", 6, "'0.0.0.0'"),
    # duplicate instance URLs (also across models, and spelled differently)
    ("models:\n  a:\n    instances: [http://127.0.0.1:1]\n  b:\n    instances:\n      - http://127.0.0.1:1/\n",
     "models.b.instances[0].url", 6, "'http://127.0.0.1:1'"),
    ("models:\n  a:\n    instances:\n      - url: http://h:80\n      - url: http://H\n",
     "models.a.instances[1].url", 5, "'http://H'"),
    # unknown keys at every level
    ("models:\n  a:\n    instances: [http://h:1]\n    colour: red\n", "models.a.colour", 4, "'red'"),
    ("models:\n  a:\n    instances:\n      - {url: 'http://h:1', colour: red}\n",
     "models.a.instances[0].colour", 4, "'red'"),
    (GOOD + "session:\n  header: X-S\n  timeout: 3\n", "session.timeout", 8, "3"),
    (GOOD + "auth:\n  api_keys: []\n  colour: red\n", "auth.colour", 8, "'red'"),
    (GOOD + "access_log: {bodies: 1}\n", "access_log.bodies", 6, "1"),
    # client keys: never echoed
    (GOOD + "auth:\n  api_keys:\n    - short-key\n", "auth.api_keys[0]", 8, "<redacted>"),
    (GOOD + "auth:\n  api_keys:\n    - {key: aaaaaaaaaaaaaaaaaaaa, tenant: 'a:b'}\n", "auth.api_keys[0].tenant",
     8, "'a:b'"),
    (GOOD + "auth:\n  api_keys:\n    - aaaaaaaaaaaaaaaaaaaa\n    - aaaaaaaaaaaaaaaaaaaa\n", "auth.api_keys[1]", 9,
     "<redacted>"),
    (GOOD + "auth:\n  api_keys:\n    - {key_env: SHADOWPREFILL_TEST_UNSET}\n", "auth.api_keys[0].key_env", 8,
     "'SHADOWPREFILL_TEST_UNSET'"),
    # upstream credentials: an environment variable's name, never the key
    ("models:\n  a:\n    instances:\n      - {url: 'http://h:1', api_key: sk-secret}\n",
     "models.a.instances[0].api_key", 4, "<redacted>"),
    ("models:\n  a:\n    api_key_env: SHADOWPREFILL_TEST_UNSET\n    instances: [http://h:1]\n",
     "models.a.api_key_env", 3, "'SHADOWPREFILL_TEST_UNSET'"),
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


def test_secrets_come_from_the_environment_and_never_show(monkeypatch):
    env = {"UP_KEY": "upstream-secret-123", "CLIENT_KEY": "client-secret-aaaaaaa",
           "SHADOWPREFILL_GATEWAY_API_KEYS": "team-b:client-secret-bbbbbbb, client-secret-ccccccc"}
    text = ("listen: {host: 0.0.0.0}\nauth:\n  api_keys:\n    - {key_env: CLIENT_KEY, tenant: team-a}\n"
            "models:\n  a:\n    api_key_env: UP_KEY\n    instances: [http://h:1, {url: 'http://h:2', id: x}]\n")
    cfg = parse_config(text, "gw.yaml", env)
    assert [k.tenant for k in cfg.auth.api_keys][:2] == ["team-a", "team-b"]
    assert cfg.auth.api_keys[2].tenant.startswith("key-")  # a key without a tenant is a tenant of its own
    assert [i.auth_headers for i in cfg.model("a").instances] == [{"authorization": "Bearer upstream-secret-123"}] * 2
    for secret in ("upstream-secret-123", "client-secret"):
        assert secret not in repr(cfg)
    with pytest.raises(ConfigError) as info:  # a bad key in the variable: named by position, never shown
        parse_config(GOOD, "gw.yaml", {"SHADOWPREFILL_GATEWAY_API_KEYS": "t:short-secret"})
    assert info.value.field == "$SHADOWPREFILL_GATEWAY_API_KEYS[0]" and "short-secret" not in str(info.value)


def test_serve_without_client_keys_listens_on_loopback_only(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(GOOD + "tokenizer_check: false\n")
    monkeypatch.delenv("SHADOWPREFILL_GATEWAY_API_KEYS", raising=False)
    assert cli_main(["serve", "--config", str(cfg), "--check", "--host", "0.0.0.0"]) == 2
    assert "--host = '0.0.0.0': without client API keys" in capsys.readouterr().err
    assert cli_main(["serve", "--config", str(cfg), "--check", "--port", "70000"]) == 2
    assert "--port = 70000: must be a TCP port" in capsys.readouterr().err
    assert cli_main(["serve", "--config", str(cfg), "--check", "--host", "::1"]) == 0
    monkeypatch.setenv("SHADOWPREFILL_GATEWAY_API_KEYS", "team:" + "k" * 20)
    assert cli_main(["serve", "--config", str(cfg), "--check", "--host", "0.0.0.0"]) == 0


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
    assert f"listen.port = -1: must be a TCP port, an integer in [1, 65535] ({bad}:6)" in capsys.readouterr().err
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
