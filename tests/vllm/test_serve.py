"""``shadowprefill vllm-serve``: the command it builds, its errors, and (opt-in,
``SHADOWPREFILL_HTTP_TESTS=1``: the server needs about a minute to become
healthy on two cores) a real OpenAI-compatible server with the shadow
scheduler answering a shadow and a switch call over HTTP."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from shadow_vllm.engine_config import EngineShadowConfig
from shadow_vllm.serve import build_command, main

from shadowcore.errors import ConfigError


def test_command_runs_the_api_server_module_with_the_scheduler_and_policy() -> None:
    cmd = build_command(["--policy", "harvest-slo", "--policy-args", '{"beta": 0.4}', "--model", "/m",
                         "--block-size", "32", "--scheduler", "sync"])
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[3:7] == ["--model", "/m", "--block-size", "32"]
    assert cmd[cmd.index("--scheduler-cls") + 1] == "shadow_vllm.scheduler.ShadowScheduler"
    config = json.loads(cmd[cmd.index("--additional-config") + 1])["shadowprefill"]
    assert config["shadow"]["policy"] == {"name": "harvest-slo", "args": {"beta": 0.4}}
    async_cmd = build_command(["--model", "/m", "--scheduler", "async"])
    assert async_cmd[async_cmd.index("--scheduler-cls") + 1] == "shadow_vllm.scheduler.AsyncShadowScheduler"


@pytest.mark.parametrize("argv", [
    ["--policy", 'harvest-slo:{"beta": 0.4, "delta": 0.1}'],
    ["--policy", "harvest-slo", "--policy-args", '{"beta": 0.4, "delta": 0.1}'],  # the older spelling
])
def test_policy_takes_json_arguments_inline_or_as_policy_args(argv) -> None:
    cmd = build_command([*argv, "--model", "/m", "--scheduler", "sync"])
    config = json.loads(cmd[cmd.index("--additional-config") + 1])["shadowprefill"]
    assert config["shadow"]["policy"] == {"name": "harvest-slo", "args": {"beta": 0.4, "delta": 0.1}}


@pytest.mark.parametrize(("argv", "field"), [
    (["--policy", "nope"], "additional_config.shadowprefill.shadow.policy.name = 'nope'"),
    (["--policy", 'harvest-slo:{"beta": 0.4,}'], ("--policy = 'harvest-slo:{\"beta\": 0.4,}': harvest-slo: arguments "
                                                "are not JSON: Expecting property name enclosed in double quotes at "
                                                "column 26")),
    (["--policy", "harvest-slo,no-shadow"], "--policy = 'harvest-slo,no-shadow': one reference expected, got 2"),
    (["--policy", 'harvest-slo:{"beta": 0.4}', "--policy-args", '{"beta": 0.3}'],
     "--policy-args = '{\"beta\": 0.3}': --policy 'harvest-slo:{\"beta\": 0.4}' already gives the arguments"),
    (["--policy-args", '{"beta": -1}'], "additional_config.shadowprefill.shadow.policy.args.beta = -1"),
    (["--policy-args", '{"beta": '], "--policy-args:1:10"),
    (["--latency", '{"name": "linear", "args": {"overhead_s": -2}}'],
     "additional_config.shadowprefill.latency.args.overhead_s = -2"),
    (["--scheduler-cls", "x.Y"], "--scheduler-cls"),
])
def test_bad_arguments_fail_before_vllm_starts_naming_the_field(argv, field, capsys) -> None:
    with pytest.raises(ConfigError) as info:
        build_command([*argv, "--model", "/m"])
    assert str(info.value).startswith(field)
    assert main([*argv, "--model", "/m"]) == 2
    assert field in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("SHADOWPREFILL_HTTP_TESTS") != "1", reason="opt-in: SHADOWPREFILL_HTTP_TESTS=1")
def test_http_server_shadow_then_switch_finds_the_context_cached(tiny_model_dir, tmp_path) -> None:
    port = 8900 + os.getpid() % 90
    cmd = build_command(["--policy", "harvest-slo", "--model", tiny_model_dir, "--block-size", "32",
                         "--enforce-eager", "--dtype", "float32", "--kv-cache-memory-bytes", str(8 << 20),
                         "--max-model-len", "4096", "--port", str(port), "--enable-prompt-tokens-details"])
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, server, deadline_s=240)
        ctx = [10 + (i * 104729) % 400 for i in range(1000)]
        tag = {"shadowprefill_kind": "shadow", "shadowprefill_session": "h1", "shadowprefill_target_model": "tiny",
               "shadowprefill_epoch": 0, "shadowprefill_switch_probability": 0.8}
        shadow = _post(port, {"model": tiny_model_dir, "prompt": ctx, "max_tokens": 1, "vllm_xargs": tag})
        assert shadow["choices"][0]["stop_reason"] == "shadowprefill:prefilled"
        switch = _post(port, {"model": tiny_model_dir, "prompt": ctx + [5, 6, 7], "max_tokens": 2,
                              "vllm_xargs": {"shadowprefill_kind": "routed", "shadowprefill_session": "h1"}})
        assert switch["usage"]["prompt_tokens_details"]["cached_tokens"] == 992
    finally:
        server.terminate()
        server.wait(timeout=60)


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _wait_healthy(port: int, server: subprocess.Popen, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if server.poll() is not None:
            raise AssertionError(f"server exited with {server.returncode}: {shlex.join(server.args)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise AssertionError("server not healthy in time")


def test_keep_tails_below_n_min_is_a_checked_bool_that_round_trips() -> None:
    from shadow_vllm.engine_config import EngineShadowConfig, engine_args

    with pytest.raises(ConfigError) as info:
        EngineShadowConfig.from_dict({"keep_tails_below_n_min": "yes"})
    assert str(info.value).startswith("additional_config.shadowprefill.keep_tails_below_n_min = 'yes'")
    assert not EngineShadowConfig.from_dict({}).keep_tails_below_n_min  # finishing tails is the default
    data = engine_args("harvest-slo", keep_tails_below_n_min=True)["additional_config"]["shadowprefill"]
    config = EngineShadowConfig.from_dict(data)
    assert config.keep_tails_below_n_min is True
    assert EngineShadowConfig.from_dict(config.to_dict()) == config


def test_latency_profile_is_the_one_simulate_takes_and_is_applied(tmp_path) -> None:
    """``vllm-serve --latency-profile`` reaches the engine config, which applies the
    same profile ``simulate --latency-profile`` does (shipped name or file)."""
    from shadow_sim.latency import resolve_profile

    from shadowcore.calibration import LatencyProfile
    from shadowcore.latency import BatchShape, LinearLatencyModel, PrefillChunk

    cmd = build_command(["--policy", "harvest-slo", "--latency-profile", "paper-testbed-h100", "--model", "m"])
    extra = json.loads(cmd[cmd.index("--additional-config") + 1])["shadowprefill"]
    assert extra["latency_profile"] == "paper-testbed-h100"
    config = EngineShadowConfig.from_dict(extra)
    assert EngineShadowConfig.from_dict(config.to_dict()) == config
    batch = BatchShape((PrefillChunk(512, 0),), ())
    want = resolve_profile("paper-testbed-h100").apply(LinearLatencyModel()).predict_s(batch)
    assert config.build_latency().predict_s(batch) == want > LinearLatencyModel().predict_s(batch)
    path = tmp_path / "mine.json"
    LatencyProfile("mine", decode_scale=2.0).write(path)
    decodes = BatchShape((), (100,) * 4)
    mine = EngineShadowConfig.from_dict({"latency_profile": str(path)}).build_latency()
    assert mine.predict_s(decodes) == 2 * LinearLatencyModel().predict_s(decodes)
    assert EngineShadowConfig.from_dict({}).build_latency() == LinearLatencyModel()  # none: the model itself
    with pytest.raises(ConfigError, match=r"additional_config.shadowprefill.latency_profile = 'nope'"):
        EngineShadowConfig.from_dict({"latency_profile": "nope"})


def test_pd_role_picks_the_pd_scheduler_and_needs_a_kv_connector() -> None:
    kv = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
    cmd = build_command(["--pd-role", "prefill", "--pd-max-iteration-s", "0.05", "--scheduler", "sync",
                         "--model", "m", "--kv-transfer-config", kv])
    assert cmd[cmd.index("--scheduler-cls") + 1] == "shadow_vllm.pd.PrefillShadowScheduler"
    pd = json.loads(cmd[cmd.index("--additional-config") + 1])["shadowprefill"]["pd"]
    assert pd == {"role": "prefill", "max_iteration_s": 0.05, "push_tokens": 4096}
    cmd = build_command(["--pd-role", "decode", "--scheduler", "async", "--kv-transfer-config", kv])
    assert cmd[cmd.index("--scheduler-cls") + 1] == "shadow_vllm.pd.AsyncDecodeShadowScheduler"
    with pytest.raises(ConfigError, match="--kv-transfer-config"):
        build_command(["--pd-role", "decode"])
    with pytest.raises(ConfigError, match="pd.push_tokens"):
        build_command(["--pd-role", "decode", "--pd-push-tokens", "0", "--kv-transfer-config", kv])
