"""``reproduce --policies`` adds the user's policies to every study, the
tables and every figure (fed synthetic comparisons: no simulation)."""

from __future__ import annotations

import pytest

from shadowcore.config import PluginRef, policy_label


def test_user_policies_join_every_study_table_and_figure(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shadow_sim.experiments import reproduce
    from shadow_sim.experiments.runner import COLUMNS, Comparison

    mine = PluginRef("harvest-slo", {"beta": 0.4})
    label = policy_label(mine)
    results = {}
    for study, name, _fields, refs in reproduce.studies(True, extra=(mine, PluginRef("no-shadow"))):
        names = tuple(policy_label(r) for r in refs)
        assert names.count(label) == 1 and names.count("no-shadow") == 1, (study, names)
        per = {n: {"shadow_tokens": 100.0, "shadow_unused_share": 0.5} for n in names}
        summary = {n: {**{key: (0.01, 0.0) for key, _t, _k in COLUMNS}, "calls": (120.0, 0.0),
                       "switch_calls": (30.0, 0.0)} for n in names}
        results[f"{study}:{name}"] = (study, Comparison(name, names, "no-shadow", None, ((0, "peak", per),), summary))
    drawn: list[tuple[str, list[str]]] = []
    for fn in ("_bars", "_lines"):
        inner = getattr(reproduce, fn)

        def spy(ax, comps, policies, metric, *args, inner=inner, **kwargs):
            drawn.append((metric, list(policies)))
            return inner(ax, comps, policies, metric, *args, **kwargs)

        monkeypatch.setattr(reproduce, fn, spy)
    assert len(reproduce.figures(results, tmp_path, [label])) == 7
    assert drawn and all(label in policies for _metric, policies in drawn), drawn
    assert f"\n{label}  " in reproduce.markdown(results, quick=True)  # a row of every study's table
