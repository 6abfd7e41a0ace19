"""Plugin discovery through real entry points (no mocks of importlib.metadata).

Each test writes a fake installed distribution (``*.dist-info`` with
``METADATA`` and ``entry_points.txt``) and its modules into a temporary
directory and puts that directory on ``sys.path``; ``importlib.metadata``
then finds it exactly as it finds a pip-installed package.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shadowcore.config import PluginRef
from shadowcore.errors import ConfigError, PluginError
from shadowcore.policy import PolicySpec, load_policy
from shadowcore.registry import POLICY_GROUP, Registry

REPO = Path(__file__).resolve().parents[1]

PAPER = (
    "no-shadow", "host-tier", "harvest", "harvest-slo", "harvest-slo-host",
    "predictive", "dedicated", "eager", "oracle", "oracle-host",
)

# A valid policy whose module records each import (module-level side effect).
GOOD_MODULE = """
from pathlib import Path

from shadowcore.policy import Component, PolicySpec
from shadowcore.slack import NoShadowController
from shadowcore.switch import EmpiricalSwitchPredictor, NoTargets

with open(Path(__file__).with_name("imports.log"), "a") as f:
    f.write(__name__ + "\\n")


def factory(**_):
    return PolicySpec("fake-good", "fake", Component(NoShadowController),
                      Component(EmpiricalSwitchPredictor), NoTargets())


def harvest(**_):
    return PolicySpec("fake-harvest", "duplicate of harvest", Component(NoShadowController),
                      Component(EmpiricalSwitchPredictor), NoTargets())


def buggy(beta=0.5):
    return {"beta": beta}["delta-c81e"]  # a bug inside the factory: KeyError
"""

BROKEN_MODULE = """
raise ImportError("fakeplug cannot import: boom-7f3a")
"""

FAKE_MODULES = ("fakeplug_good", "fakeplug_broken", "myunpkg", "myunpkg.policies")


@pytest.fixture(autouse=True)
def _forget_fake_modules():
    yield
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()


def install_fake_dist(root: Path, entry_points: dict[str, str], modules: dict[str, str],
                      name: str = "fakeplug") -> Path:
    """Write a distribution ``name`` 0.1 with ``entry_points`` in the policy group."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = [f"[{POLICY_GROUP}]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for mod, source in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(source))
    return root


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    def make(entry_points: dict[str, str], modules: dict[str, str] | None = None) -> Path:
        root = install_fake_dist(tmp_path / "site", entry_points, modules or {})
        monkeypatch.syspath_prepend(str(root))  # also invalidates importlib caches
        importlib.invalidate_caches()
        return root

    return make


# -- the ten paper approaches ------------------------------------------------------------


def test_paper_policies_listed_and_load_by_name():
    registry = Registry(POLICY_GROUP)
    names = registry.names()
    assert set(PAPER) <= set(names), f"missing: {set(PAPER) - set(names)}"
    for name in PAPER:
        assert len(registry.entries()[name]) == 1
        spec = load_policy(PluginRef(name), registry=registry)
        assert isinstance(spec, PolicySpec)
        assert spec.name == name


def test_fake_distribution_is_discovered_next_to_builtins(fake_dist):
    fake_dist({"fake-good": "fakeplug_good:factory"}, {"fakeplug_good": GOOD_MODULE})
    registry = Registry(POLICY_GROUP)
    entries = registry.entries()
    assert set(PAPER) | {"fake-good"} <= set(entries)
    assert [(e.target, e.distribution) for e in entries["fake-good"]] == [("fakeplug_good:factory", "fakeplug")]
    assert load_policy(PluginRef("fake-good"), registry=registry).name == "fake-good"


# -- laziness ----------------------------------------------------------------------------


def test_listing_names_does_not_import_the_plugin(fake_dist):
    root = fake_dist({"fake-good": "fakeplug_good:factory"}, {"fakeplug_good": GOOD_MODULE})
    log = root / "imports.log"
    registry = Registry(POLICY_GROUP)

    assert "fake-good" in registry.names()
    assert "fake-good" in registry.entries()
    assert "fakeplug_good" not in sys.modules
    assert not log.exists()

    first = registry.load("fake-good")
    assert "fakeplug_good" in sys.modules
    assert log.read_text().splitlines() == ["fakeplug_good"]

    # Looked up once, then cached: a second lookup neither re-imports nor rebuilds.
    assert registry.load("fake-good") is first
    assert log.read_text().splitlines() == ["fakeplug_good"]


# -- duplicates --------------------------------------------------------------------------


def test_duplicate_name_with_other_target_names_both_targets(fake_dist):
    fake_dist(
        {"harvest": "fakeplug_good:harvest", "fake-good": "fakeplug_good:factory"},
        {"fakeplug_good": GOOD_MODULE},
    )
    registry = Registry(POLICY_GROUP)
    # Listing is fine and shows the name once; the conflict is in its entries.
    assert registry.names().count("harvest") == 1
    assert {e.target for e in registry.entries()["harvest"]} == {
        "shadow_policies.paper:harvest", "fakeplug_good:harvest",
    }

    with pytest.raises(PluginError) as info:
        registry.load("harvest")
    msg = str(info.value)
    assert "shadow_policies.paper:harvest" in msg
    assert "fakeplug_good:harvest" in msg
    assert "'harvest'" in msg and POLICY_GROUP in msg

    # Through load_policy: one ConfigError at policy.name carrying both targets.
    with pytest.raises(ConfigError) as cinfo:
        load_policy(PluginRef("harvest"), registry=registry)
    assert cinfo.value.field == "policy.name"
    assert "shadow_policies.paper:harvest" in str(cinfo.value)
    assert "fakeplug_good:harvest" in str(cinfo.value)

    # Other names, built-in and from the same distribution, still load.
    assert load_policy(PluginRef("harvest-slo"), registry=registry).name == "harvest-slo"
    assert load_policy(PluginRef("fake-good"), registry=registry).name == "fake-good"
    # And the conflict is not cached as a success.
    with pytest.raises(PluginError):
        registry.load("harvest")


def test_same_name_same_target_twice_is_not_a_conflict(tmp_path, monkeypatch):
    # Two distributions declaring the identical target (e.g. a package seen
    # twice on sys.path under different names) are one entry.
    a = install_fake_dist(tmp_path / "a", {"fake-good": "fakeplug_good:factory"},
                          {"fakeplug_good": GOOD_MODULE}, name="fakeplug-a")
    b = install_fake_dist(tmp_path / "b", {"fake-good": "fakeplug_good:factory"}, {}, name="fakeplug-b")
    monkeypatch.syspath_prepend(str(a))
    monkeypatch.syspath_prepend(str(b))
    registry = Registry(POLICY_GROUP)
    assert len(registry.entries()["fake-good"]) == 1
    assert registry.load("fake-good")().name == "fake-good"


# -- broken plugins ----------------------------------------------------------------------


def test_broken_plugin_names_plugin_and_group_and_others_still_work(fake_dist):
    fake_dist(
        {"fake-broken": "fakeplug_broken:factory", "fake-good": "fakeplug_good:factory"},
        {"fakeplug_broken": BROKEN_MODULE, "fakeplug_good": GOOD_MODULE},
    )
    registry = Registry(POLICY_GROUP)
    assert "fake-broken" in registry.names()  # listing does not import it

    with pytest.raises(PluginError) as info:
        registry.load("fake-broken")
    msg = str(info.value)
    assert "'fake-broken'" in msg
    assert POLICY_GROUP in msg
    assert "fakeplug_broken:factory" in msg
    assert "fakeplug" in msg  # the distribution
    assert "boom-7f3a" in msg  # the cause
    assert isinstance(info.value.__cause__, ImportError)

    with pytest.raises(ConfigError) as cinfo:
        load_policy(PluginRef("fake-broken"), registry=registry)
    assert cinfo.value.field == "policy.name"
    assert cinfo.value.value == "fake-broken"
    assert POLICY_GROUP in str(cinfo.value)

    # Other lookups are unaffected, before and after another failed attempt.
    assert load_policy(PluginRef("harvest"), registry=registry).name == "harvest"
    assert load_policy(PluginRef("fake-good"), registry=registry).name == "fake-good"
    with pytest.raises(PluginError, match="fake-broken"):
        registry.load("fake-broken")
    assert load_policy(PluginRef("oracle"), registry=registry).name == "oracle"


def test_unknown_name_lists_known_names():
    registry = Registry(POLICY_GROUP)
    with pytest.raises(PluginError) as info:
        registry.load("definitely-not-registered")
    msg = str(info.value)
    assert "'definitely-not-registered'" in msg and POLICY_GROUP in msg
    assert "harvest-slo-host" in msg


# -- package.module:Object references --------------------------------------------------------

UNPACKAGED = """
import attrs

from shadowcore.policy import Component, PolicySpec
from shadowcore.slack import HarvestController
from shadowcore.switch import EmpiricalSwitchPredictor, TopK


def my_policy(beta=0.5, top_k=1):
    return PolicySpec("my-unpackaged", "not installed anywhere",
                      Component(HarvestController, {"beta": beta}),
                      Component(EmpiricalSwitchPredictor), TopK(top_k))


class Holder:
    @staticmethod
    def make(**kw):
        return my_policy(**kw)
"""


@pytest.fixture
def unpackaged(tmp_path, monkeypatch):
    pkg = tmp_path / "loose" / "myunpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "policies.py").write_text(textwrap.dedent(UNPACKAGED))
    monkeypatch.syspath_prepend(str(tmp_path / "loose"))
    importlib.invalidate_caches()


def test_module_reference_loads_unpackaged_policy(unpackaged):
    registry = Registry(POLICY_GROUP)
    ref = "myunpkg.policies:my_policy"
    assert ref not in registry.names()
    spec = load_policy(PluginRef(ref, {"beta": 0.3, "top_k": 2}), registry=registry)
    assert spec.name == "my-unpackaged"
    import numpy as np

    controller = spec.slack.build(np.random.default_rng(0))
    assert controller.beta == 0.3
    assert spec.targeting.k == 2
    # Dotted object paths work too.
    assert load_policy(PluginRef("myunpkg.policies:Holder.make"), registry=registry).name == "my-unpackaged"


def test_module_reference_errors_name_the_reference(unpackaged):
    registry = Registry(POLICY_GROUP)
    with pytest.raises(ConfigError) as info:
        load_policy(PluginRef("myunpkg.policies:missing"), registry=registry)
    assert info.value.field == "policy.name"
    assert "myunpkg.policies:missing" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_policy(PluginRef("myunpkg.nowhere:my_policy"), registry=registry)
    assert "myunpkg.nowhere" in str(info.value)
    # Bad arguments of a referenced policy are reported under policy.args.
    with pytest.raises(ConfigError) as info:
        load_policy(PluginRef("myunpkg.policies:my_policy", {"top_k": 0}), registry=registry)
    assert info.value.field == "policy.args.k"
    with pytest.raises(PluginError, match="not of the form"):
        registry.load("myunpkg.policies:")


# -- the CLI -------------------------------------------------------------------------------


def test_a_bug_inside_a_factory_is_one_error_naming_the_plugin(fake_dist, capsys):
    fake_dist({"fake-buggy": "fakeplug_good:buggy"}, {"fakeplug_good": GOOD_MODULE})
    registry = Registry(POLICY_GROUP)
    with pytest.raises(ConfigError) as info:
        load_policy(PluginRef("fake-buggy"), registry=registry)
    msg = str(info.value)
    assert info.value.field == "policy.name" and "'fake-buggy' in group shadowprefill.policies" in msg, msg
    assert "(fakeplug_good:buggy, from fakeplug)" in msg and "KeyError: 'delta-c81e'" in msg, msg
    assert isinstance(info.value.__cause__, KeyError)  # the traceback stays chained for a debugger
    # wrong arguments are still the arguments' fault, not a bug
    with pytest.raises(ConfigError) as info:
        load_policy(PluginRef("fake-buggy", {"gamma": 1}), registry=registry)
    assert info.value.field == "policy.args" and "gamma" in str(info.value)
    from shadowcore.cli import main

    assert main(["simulate", "--backend", "fake", "--policy", "fakeplug_good:buggy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fakeplug_good:buggy" in err and "KeyError" in err, err


def _plugins_cli(extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "shadowcore.cli", "plugins"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env, check=False,
    )


def _status_of(stdout: str, name: str) -> str:
    m = re.search(rf"^\s+{re.escape(name)}\s+(ok|BROKEN.*?)\s{{2}}", stdout, flags=re.MULTILINE)
    assert m, f"{name!r} not listed:\n{stdout}"
    return m.group(1)


def test_cli_plugins_lists_all_paper_policies():
    proc = _plugins_cli()
    assert proc.returncode == 0, proc.stderr
    for group in ("policies", "backends", "routers", "commands"):  # every group, with what it holds
        assert re.search(rf"^{group} \(shadowprefill\.{group}\): \S", proc.stdout, flags=re.MULTILINE), proc.stdout
    for name in PAPER:
        assert _status_of(proc.stdout, name) == "ok"
    # one-line descriptions: the policy's own, a router's and a command's docstring
    assert re.search(r"^\s+no-shadow\s+ok  Cold switch; the baseline\.  \[shadow_policies", proc.stdout, re.MULTILINE)
    assert re.search(r"^\s+client-model\s+ok  Honour the model the client named", proc.stdout, re.MULTILINE)
    assert re.search(r"^\s+sweep\s+ok  Run a grid of pairs", proc.stdout, re.MULTILINE)
    assert "fake" in proc.stdout  # the fake backend


def test_cli_plugins_reports_broken_and_duplicate_plugins(tmp_path):
    root = install_fake_dist(
        tmp_path / "site",
        {"fake-broken": "fakeplug_broken:factory", "harvest": "fakeplug_good:harvest",
         "fake-good": "fakeplug_good:factory", "fake-buggy": "fakeplug_good:buggy"},
        {"fakeplug_broken": BROKEN_MODULE, "fakeplug_good": GOOD_MODULE},
    )
    proc = _plugins_cli(root)
    assert proc.returncode == 1, proc.stderr  # any broken plugin fails the command
    assert proc.stderr.count("\n") == 1 and "3 broken" in proc.stderr, proc.stderr
    assert _status_of(proc.stdout, "fake-good") == "ok"
    assert _status_of(proc.stdout, "fake-broken").startswith("BROKEN")
    assert "boom-7f3a" in proc.stdout
    buggy = _status_of(proc.stdout, "fake-buggy")  # imports fine, its factory raises
    assert buggy.startswith("BROKEN") and "fakeplug_good:buggy" in buggy and "KeyError" in buggy, buggy
    dup = _status_of(proc.stdout, "harvest")
    assert dup.startswith("BROKEN")
    assert "shadow_policies.paper:harvest" in dup and "fakeplug_good:harvest" in dup
    for name in set(PAPER) - {"harvest"}:
        assert _status_of(proc.stdout, name) == "ok"
