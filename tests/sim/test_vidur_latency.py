"""VidurLatencyModel: offline build, cache, agreement with Vidur's own predictor,
LatencyModel invariants, coverage errors, and disagreement with the roofline.

Builds run against a fresh cache folder (``SHADOWPREFILL_CACHE`` points at a
tmp dir) with ``HF_HUB_OFFLINE=1`` and ``snapshot_download`` replaced by a
function that fails the test, so every build here proves that nothing is
fetched. Two configurations are trained once per module (about 30-40 s each
on 2 cores): Llama-3.1-8B at TP1 and Llama-3.1-70B at TP4 on H100-80GB.

Disagreement with RooflineLatencyModel (default knobs), ratio vidur / roofline
measured on the grid below (decodes b x context; prefill chunk q on c cached):

===============================  ============  =============
point                            8B TP1        70B TP4
===============================  ============  =============
decode b=1, ctx 512..65536       1.13 - 1.17   1.15 - 1.17
decode b=8                       1.01 - 1.18   1.07 - 1.16
decode b=32                      0.98 - 1.28   1.03 - 1.19
decode b=128                     0.96 - 1.38   1.00 - 1.29
prefill q=256,  c 0..32768       0.84 - 1.32   0.99 - 1.24
prefill q=1024                   0.69 - 0.88   0.79 - 0.89
prefill q=4096                   0.71 - 0.86   0.80 - 0.90
prefill q=8192                   0.72 - 0.86   0.82 - 0.93
median over the 28 points        1.02          1.08
===============================  ============  =============

Where they part: small batches are bandwidth-bound; the measured kernels have
floors the roofline lacks (FA3 decode ~12 us per layer whatever the context,
2 us per element-wise kernel, GEMMs at m = 128 ~25% slower than at m = 1), so
Vidur is 13-38% slower there. Large prefills and long-context attention are
compute-bound, where the measured GEMMs (~77% of peak FLOPs) and FA3 (~70%)
beat the roofline's fixed 60% / 45%, so Vidur is 7-31% faster.
Tolerance: the median ratio stays within [0.8, 1.25] and every point within
[0.6, 1.6], i.e. beyond the measured extremes (0.69 and 1.38) by a margin of
about the measured spread again; a unit or sharding bug (a missing factor of
2, TP not applied, ms vs s) moves points by >= 2x and fails it.
"""

from __future__ import annotations

import os
import random
import statistics

import pytest

pytest.importorskip("vidur")
pytest.importorskip("aiconfigurator_core")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shadow_sim import vidur_latency
from shadow_sim.latency import latency_model
from shadow_sim.roofline import RooflineLatencyModel
from shadow_sim.vidur_latency import ENV_CACHE, VidurLatencyModel, default_cache_dir, prepare_tables
from shadow_sim.vidur_profiles import ProfileCoverageError, build_profiles

from shadowcore.errors import ConfigError
from shadowcore.latency import BatchShape, LatencyModel, PrefillChunk

CONFIGS = [("Llama-3.1-8B", 1), ("Llama-3.1-70B", 4)]

DECODE_BATCHES = (1, 8, 32, 128)
DECODE_CONTEXTS = (512, 4096, 16384, 65536)
PREFILL_CHUNKS = (256, 1024, 4096, 8192)
PREFILL_CACHED = (0, 4096, 32768)

MEDIAN_RATIO = (0.8, 1.25)
POINT_RATIO = (0.6, 1.6)


HUB_CALLS: list[tuple] = []


def _no_hub(*args: object, **kwargs: object) -> None:
    HUB_CALLS.append((args, kwargs))  # recorded: Vidur swallows exceptions around its hub calls
    raise AssertionError("a model hub was contacted")


@pytest.fixture(scope="module")
def offline_cache(tmp_path_factory: pytest.TempPathFactory):
    """A fresh cache root, hub access disabled for the whole module."""
    import huggingface_hub
    import vidur.execution_time_predictor.sklearn_execution_time_predictor as sk

    root = tmp_path_factory.mktemp("shadowprefill-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_CACHE, str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(sk, "snapshot_download", _no_hub)
        mp.setattr(huggingface_hub, "snapshot_download", _no_hub)
        yield root


@pytest.fixture(scope="module")
def built(offline_cache):
    """{(model, tp): (VidurLatencyModel, live Vidur predictor)} trained once per module."""
    out = {}
    for name, tp in CONFIGS:
        profiles = build_profiles(name, "H100-80GB", tp)
        path, predictor = prepare_tables(profiles, keep_predictor=True, progress=True)
        assert predictor is not None
        model = VidurLatencyModel.for_model(name, "H100-80GB", tp, progress=False)
        assert model.table_path == path
        out[(name, tp)] = (model, predictor)
    return out


@pytest.fixture(scope="module")
def models(built):
    return [m for m, _ in built.values()]


def prefill(q: int, c: int = 0) -> BatchShape:
    return BatchShape((PrefillChunk(q, c),))


def decodes(*contexts: int) -> BatchShape:
    return BatchShape((), contexts)


# ------------------------------------------------------------------ build & cache
def test_build_is_offline_and_cached_by_content(built, offline_cache, monkeypatch) -> None:
    model, _ = built[("Llama-3.1-8B", 1)]
    assert HUB_CALLS == []
    assert isinstance(model, LatencyModel)
    assert default_cache_dir() == offline_cache / "vidur"
    assert model.table_path.parent == offline_cache / "vidur"
    assert sorted(p.name for p in model.table_path.iterdir()) == ["meta.json", "profiles", "tables.npz"]
    meta = model.meta
    assert meta["profile_sha256"] == build_profiles("Llama-3.1-8B").content_hash
    assert meta["build_seconds"] > 0
    # A second construction loads the tables: no training.
    monkeypatch.setattr(vidur_latency, "train_vidur_predictor", _no_hub)
    again = VidurLatencyModel.for_model("Llama-3.1-8B", progress=False)
    assert again.table_path == model.table_path
    assert again.predict_s(decodes(1000)) == model.predict_s(decodes(1000))


def test_cache_key_changes_with_csv_contents() -> None:
    profiles = build_profiles("Llama-3.1-8B")
    edited = dict(profiles.csv)
    edited["mlp.csv"] = edited["mlp.csv"].replace("\n1,", "\n1,", 1) + "\n"
    from shadow_sim.vidur_profiles import hash_profile_texts

    assert hash_profile_texts(edited) != profiles.content_hash
    from shadow_sim.vidur_profiles import BandwidthModel

    other = build_profiles("Llama-3.1-8B", bandwidth=BandwidthModel(kernel_floor_s=3e-6))
    assert other.content_hash != profiles.content_hash
    tc = vidur_latency.TrainingConfig()
    assert vidur_latency.cache_key(other, tc) != vidur_latency.cache_key(profiles, tc)
    assert vidur_latency.cache_key(profiles, tc) == vidur_latency.cache_key(build_profiles("Llama-3.1-8B"), tc)


def test_edited_profile_in_place_gets_new_tables(built, tmp_path) -> None:
    """Vidur's own cache is keyed by config and would reuse stale tables; ours follows the bytes."""
    from shadow_sim.vidur_profiles import VidurProfiles

    model, _ = built[("Llama-3.1-8B", 1)]
    tc = vidur_latency.TrainingConfig()
    profiles = VidurProfiles.from_dir(model.table_path / "profiles", "Llama-3.1-8B")
    assert vidur_latency.table_dir(model.table_path.parent, profiles, tc) == model.table_path
    edit = tmp_path / "profiles"
    edit.mkdir()
    for name in ("mlp.csv", "attention.csv"):
        (edit / name).write_text((model.table_path / "profiles" / name).read_text())
    text = (edit / "mlp.csv").read_text()
    (edit / "mlp.csv").write_text(text.replace(",0\n", ",0.001\n", 1))  # one 'add' time edited
    edited = VidurProfiles.from_dir(edit, "Llama-3.1-8B")
    assert vidur_latency.table_dir(model.table_path.parent, edited, tc) != model.table_path


def test_explicit_cache_dir_wins(built, tmp_path, monkeypatch) -> None:
    import shutil

    model, _ = built[("Llama-3.1-8B", 1)]
    shutil.copytree(model.table_path, tmp_path / model.table_path.name)
    monkeypatch.setattr(vidur_latency, "train_vidur_predictor", _no_hub)
    moved = VidurLatencyModel.for_model("Llama-3.1-8B", cache_dir=tmp_path, progress=False)
    assert moved.table_path == tmp_path / model.table_path.name
    assert os.environ[ENV_CACHE] not in str(moved.table_path)


# ------------------------------------------------------------- Vidur's own predictor
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-tp{c[1]}")
def test_tables_reproduce_vidurs_predictor(built, config) -> None:
    """vidur_model_time_s reads the exported tables with Vidur's rule: it equals the live predictor."""
    from vidur.entities import Batch
    from vidur.types import ReplicaId

    model, predictor = built[config]
    rng = random.Random(7)
    for _ in range(60):
        chunks = [PrefillChunk(rng.randint(2, 4096), rng.randint(0, 60000)) for _ in range(rng.randint(0, 2))]
        ctx = [rng.randint(1, 60000) for _ in range(rng.randint(0, 64))]
        batch = BatchShape(chunks, ctx)
        if batch.is_empty:
            continue
        q = [c.num_new_tokens for c in chunks] + [1] * len(ctx)
        kv = [c.num_new_tokens + c.num_context_tokens for c in chunks] + ctx
        vb = Batch(ReplicaId(0), [None] * len(q), q, kv)
        expected = predictor.get_execution_time(vb, 0).model_time
        assert model.vidur_model_time_s(batch) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-tp{c[1]}")
def test_monotone_envelope_stays_close_to_vidur(built, config) -> None:
    """predict_s = Vidur's model_time + explicit extras, lifted by the monotone envelope.

    Measured excess over 300 random batches: median 0.2% / 0.1%, 95th
    percentile 5.9% / 4.8%, max 10.4% / 5.7% (8B TP1 / 70B TP4); the max comes
    from decode batches whose total KV equals two sequences at the 131072
    limit, which the measured kernels read ~19% slower per token.
    """
    model, _ = built[config]
    rng = random.Random(11)
    excess = []
    for _ in range(300):
        chunks = [PrefillChunk(rng.randint(2, 8192), rng.randint(0, 100000)) for _ in range(rng.randint(0, 1))]
        b = rng.choice((0, 1, 4, 16, 64, 200))
        mean = rng.randint(256, 60000)
        ctx = [max(1, int(rng.gauss(mean, mean / 4))) for _ in range(b)]
        batch = BatchShape(chunks, ctx)
        if batch.is_empty:
            continue
        reference = model.vidur_model_time_s(batch) + model.extra_costs_s(batch)
        got = model.predict_s(batch)
        assert got >= reference * (1 - 1e-12)  # an upper envelope never goes below Vidur
        excess.append(got / reference - 1)
    excess.sort()
    assert statistics.median(excess) < 0.01
    assert excess[int(0.95 * len(excess))] < 0.08
    assert excess[-1] < 0.15


# ---------------------------------------------------------------- invariants
def test_batch_without_tokens_costs_nothing(models) -> None:
    for m in models:
        assert m.predict_s(BatchShape()) == 0.0
        assert m.predict_s(prefill(0, 5000)) == 0.0
        assert m.predict_s(decodes(1)) > 0.0
        assert m.predict_s(prefill(1)) > 0.0


chunk_st = st.builds(PrefillChunk, st.integers(0, 4096), st.integers(0, 120000))
batch_st = st.builds(
    BatchShape,
    st.lists(chunk_st, max_size=3),
    st.lists(st.integers(0, 131072), max_size=80),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), batch=batch_st)
def test_pure_and_monotone(models, data, batch: BatchShape) -> None:
    m = data.draw(st.sampled_from(models))
    t = m.predict_s(batch)
    assert t == m.predict_s(BatchShape(batch.prefills, batch.decode_context_tokens))
    assert (t == 0.0) == batch.is_empty
    # add a decode
    ctx = data.draw(st.integers(0, 131072))
    assert m.predict_s(BatchShape(batch.prefills, batch.decode_context_tokens + (ctx,))) >= t
    # more context on a decode
    if batch.decode_context_tokens:
        i = data.draw(st.integers(0, len(batch.decode_context_tokens) - 1))
        d = list(batch.decode_context_tokens)
        d[i] = min(131072, d[i] + data.draw(st.integers(1, 20000)))
        assert m.predict_s(BatchShape(batch.prefills, d)) >= t
    # a new chunk, or one more token / more context on an existing one
    assert m.predict_s(batch.with_prefills((PrefillChunk(data.draw(st.integers(0, 512)), 0),))) >= t
    if batch.prefills:
        i = data.draw(st.integers(0, len(batch.prefills) - 1))
        c = batch.prefills[i]
        more_q = PrefillChunk(c.num_new_tokens + 1, c.num_context_tokens)
        more_c = PrefillChunk(c.num_new_tokens, c.num_context_tokens + data.draw(st.integers(1, 10000)))
        for new in (more_q, more_c):
            p = list(batch.prefills)
            p[i] = new
            assert m.predict_s(BatchShape(p, batch.decode_context_tokens)) >= t


# ----------------------------------------------------------------- coverage
@pytest.mark.parametrize(
    ("batch", "named"),
    [
        (decodes(*[100] * 257), "257"),
        (prefill(8193), "8193"),
        (prefill(1000, 131000), "132000"),
        (decodes(131073), "131073"),
        (BatchShape([PrefillChunk(8192, 0), PrefillChunk(8192, 0)], [10]), "16385"),
    ],
    ids=["decodes", "chunk", "chunk-kv", "decode-kv", "tokens"],
)
def test_beyond_coverage_raises_naming_value_and_limit(models, batch: BatchShape, named: str) -> None:
    with pytest.raises(ProfileCoverageError, match=named) as info:
        models[0].predict_s(batch)
    assert "beyond the tables'" in str(info.value)


# ----------------------------------------------------------- vs the roofline
def _ratios(model: VidurLatencyModel, roof: RooflineLatencyModel) -> list[float]:
    out = []
    for b in DECODE_BATCHES:
        for c in DECODE_CONTEXTS:
            batch = decodes(*[c] * b)
            out.append(model.predict_s(batch) / roof.predict_s(batch))
    for q in PREFILL_CHUNKS:
        for c in PREFILL_CACHED:
            out.append(model.predict_s(prefill(q, c)) / roof.predict_s(prefill(q, c)))
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-tp{c[1]}")
def test_agrees_with_roofline_within_stated_tolerance(built, config) -> None:
    model, _ = built[config]
    roof = RooflineLatencyModel.for_model(config[0], "H100-80GB", config[1])
    ratios = _ratios(model, roof)
    assert len(ratios) == 28
    assert MEDIAN_RATIO[0] <= statistics.median(ratios) <= MEDIAN_RATIO[1], sorted(ratios)
    assert all(POINT_RATIO[0] <= r <= POINT_RATIO[1] for r in ratios), sorted(ratios)


# ------------------------------------------------------------------ factory
def test_factory(built) -> None:
    assert isinstance(latency_model("Llama-3.1-8B", kind="roofline"), RooflineLatencyModel)
    vid = latency_model("L8", "h100", kind="vidur", progress=False)
    assert isinstance(vid, VidurLatencyModel)
    assert vid.table_path == built[("Llama-3.1-8B", 1)][0].table_path
    assert isinstance(latency_model("Llama-3.1-8B", kind="auto", progress=False), VidurLatencyModel)
    with pytest.raises(ConfigError, match="kind"):
        latency_model("Llama-3.1-8B", kind="vllm")
