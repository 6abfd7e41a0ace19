"""Every mutant of ``tools/mutants.py`` still applies to the tree: its test
file and source file exist and each anchor occurs the expected number of
times. A refactor that moves an anchor fails here, in the suite, rather than
only when someone next runs the mutants (which take an hour in all)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("_mutants_tool", ROOT / "tools" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mutant_applies() -> None:
    mutants = _mutants()
    assert len(mutants.MUTATIONS) > 100  # the table was read
    problems = mutants.stale()
    assert not problems, "tools/mutants.py has mutants that no longer apply:\n" + "\n".join(problems)


def test_a_moved_anchor_is_reported(tmp_path: Path) -> None:
    """The check itself can fail: a copy of one mutant's source without its anchor is reported."""
    mutants = _mutants()
    name, (test_file, _test, path, old, *_rest) = next(iter(mutants.MUTATIONS.items()))
    for rel in (test_file, path):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text())
    (tmp_path / path).write_text((ROOT / path).read_text().replace(old, "", 1) + "\n")
    assert any(p.startswith(f"{name}: ") and "found" in p for p in mutants.stale(tmp_path))
