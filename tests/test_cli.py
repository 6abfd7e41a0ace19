"""The command line: bad input gets one line naming the file, line and column,
or the field; nothing runs."""

from __future__ import annotations

import pytest

from shadowcore.cli import main
from shadowcore.config import PluginRef
from shadowcore.errors import ConfigError
from shadowcore.policy import load_policy


@pytest.mark.parametrize(("text", "where"), [('{"a":\n', ":2:1"), ('{"duration_s": 1,,}', ":1:18"), ("[1, 2]", "JSON object")])
def test_bad_scenario_file_names_file_line_column(tmp_path, capsys, text: str, where: str) -> None:
    path = tmp_path / "scenario.json"
    path.write_text(text)
    assert main(["simulate", "--backend", "fake", "--scenario", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and where in err


def test_unknown_scenario_field_is_named(tmp_path, capsys) -> None:
    path = tmp_path / "scenario.json"
    path.write_text('{"duraton_s": 5}')
    assert main(["simulate", "--backend", "fake", "--scenario", str(path)]) == 2
    assert "scenario.duraton_s" in capsys.readouterr().err


def test_unknown_policy_argument_is_named_with_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_policy(PluginRef("harvest-slo", {"bogus": 1}))
    assert info.value.field == "policy.args.bogus" and "beta" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_policy(PluginRef("no-shadow", {"oracle": True}))  # flags are not arguments
    assert info.value.field == "policy.args.oracle"


def test_fake_backend_simulate_prints_table(capsys) -> None:
    assert main(["simulate", "--backend", "fake", "--duration", "20", "--policies", "no-shadow,harvest-slo"]) == 0
    out = capsys.readouterr().out
    assert "no-shadow" in out and "harvest-slo" in out and "sw TTFT" in out


@pytest.fixture
def command_plugins(tmp_path, monkeypatch):
    """Two subcommand plugins in a throwaway module: one that works, one whose module is missing."""
    (tmp_path / "cli_plugin_mod.py").write_text(
        "def hello(argv):\n    print('hello', *argv)\n    return 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from shadowcore.registry import PluginEntry, commands

    entries = [PluginEntry("hello", "cli_plugin_mod:hello", "t"), PluginEntry("broken", "no_such_mod_xyz:main", "t")]
    monkeypatch.setattr(commands, "source", lambda group: entries)
    monkeypatch.setattr(commands, "_loaded", {})
    return commands


def test_plugin_subcommand_gets_its_own_argv(command_plugins, capsys) -> None:
    assert main(["hello", "--flag", "x"]) == 3
    assert capsys.readouterr().out == "hello --flag x\n"


def test_broken_plugin_subcommand_is_named(command_plugins, capsys) -> None:
    assert main(["broken"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'broken'" in err and "no_such_mod_xyz" in err


def test_plugin_subcommands_are_listed_in_help(command_plugins, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "hello" in out and "broken" in out


def test_policy_flag_takes_arguments_as_json(capsys) -> None:
    argv = ["simulate", "--backend", "fake", "--duration", "20", "--policy", "no-shadow",
            "--policy", 'harvest-slo:{"eviction_order": "lru", "shadow_cap": 0.5}']
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no-shadow" in out and "harvest-slo" in out


@pytest.mark.parametrize(("value", "where"), [
    ('harvest-slo:{"eviction_order": lru}', ("--policy = 'harvest-slo:{\"eviction_order\": lru}': harvest-slo: "
                                             "arguments are not JSON: Expecting value at column 32")),  # the flag, the policy, the column
    ('harvest-slo:{"eviction_ordr": "lru"}', "eviction_ordr"),  # unknown argument
    ('harvest-slo:{"eviction_order": "fifo"}', "eviction_order = 'fifo'"),  # bad value
])
def test_bad_policy_flag_is_one_error_line_naming_it(capsys, value: str, where: str) -> None:
    assert main(["simulate", "--backend", "fake", "--duration", "5", "--policy", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and where in err, err


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # unwrapped


@pytest.mark.parametrize(("command", "description", "default"), [
    ("simulate", "Run one scenario under several policies", "(default: no-shadow,harvest-slo-host,oracle-host)"),
    ("plugins", "List every registered plugin of each entry-point group", None),
    ("sweep", "Run a grid of pairs x policies x seeds x windows", "(default: sweep-out)"),
    # the whole first paragraph of reproduce's docstring, not its first line
    ("reproduce", ("analogues of the paper's Figures 4, 5, 6, 8, 9 (load panel), 15 (switch rate) and 16 (models "
                   "per router) as PNG, and a Markdown table of our numbers next to the paper's (paper_numbers)."),
     "(default: reproduce-out)"),
    ("serve", "Run the session gateway", "(default: info)"),
    ("vllm-serve", "Start vLLM's OpenAI-compatible server with the shadow scheduler", "(default: harvest-slo)"),
    ("latency", "Fit a latency profile (or a linear model) to an engine's measured iterations", None),
])
def test_every_command_has_a_description_and_shows_defaults(capsys, command, description, default) -> None:
    out = _help(capsys, [command])
    assert description in out, out
    if default is not None:
        assert default in out, out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_top_level_help_describes_every_command(capsys) -> None:
    out = _help(capsys, [])
    for line in ("simulate run one scenario", "plugins list registered policies, backends, routers and commands",
                 "sweep Run a grid of pairs", "reproduce Reproduce the paper's figure types",
                 "serve Run the session gateway", "vllm-serve Start vLLM's OpenAI-compatible server",
                 "latency Fit a latency profile"):
        assert line in out, out


def test_install_script_ends_explaining_the_pip_check_warnings() -> None:
    from pathlib import Path

    script = (Path(__file__).resolve().parents[1] / "install.sh").read_text()
    removed = next(line for line in script.splitlines() if "pip uninstall" in line)
    last = script.rstrip().splitlines()[-1]
    assert last.startswith("echo ") and "pip check" in last and "on purpose" in last
    for package in ("torchvision", "torchaudio", "torchcodec"):  # exactly what it removes
        assert package in removed and package in last
