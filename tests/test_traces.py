"""Normal-traffic trace loaders: the project's own Azure-format sample (always) and the
real Azure 2023 traces (skipped with a reason when absent, a failure under CI=true), peak/median/trough
windows, capping, one TraceError per malformed row (file, line, column and value in
the message, nothing returned) for every format, and write-then-load round trips."""

from __future__ import annotations

import csv
import gzip
import json
import math
import tempfile
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trace_sample import SAMPLES, sample_path, sample_text

from shadowcore.errors import ConfigError, ShadowError
from shadowcore.workloads import (
    FORMATS,
    Trace,
    TraceError,
    TraceRequest,
    load_azure,
    load_burstgpt,
    load_copilot,
    load_mooncake,
    load_trace,
)

AZURE_SET = "azure-llm-2023"
CODE = "AzureLLMInferenceTrace_code.csv"
CONV = "AzureLLMInferenceTrace_conv.csv"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


@pytest.fixture(scope="module")
def azure_dir(shared_traces) -> Path:
    """The real traces: skipped with a reason when absent, a failure under CI=true."""
    return shared_traces(AZURE_SET, CODE, CONV)


@pytest.fixture(scope="module")
def code_trace(azure_dir: Path) -> Trace:
    return load_azure(azure_dir / CODE)


@pytest.fixture(scope="module")
def conv_trace(azure_dir: Path) -> Trace:
    return load_azure(azure_dir / CONV)


@pytest.fixture(scope="module")
def sample_code_trace() -> Trace:
    return load_azure(sample_path("code"))


@pytest.fixture(scope="module")
def sample_conv_trace() -> Trace:
    return load_azure(sample_path("conv"))


#: Every Azure-format trace the generic tests below run on: the project's own
#: samples always, the real traces when present.
AZURE_TRACES = ["sample_code", "sample_conv", "code", "conv"]


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def raises_at(fn, path: Path, line: int, column, value) -> TraceError:
    """``fn()`` raises a TraceError at ``path:line:column`` showing ``value``."""
    with pytest.raises(TraceError) as info:
        fn()
    err = info.value
    assert isinstance(err, ShadowError) and isinstance(err, ValueError)
    assert (err.path, err.line, err.column, err.value) == (str(path), line, column, value), str(err)
    msg = str(err)
    assert msg.startswith(f"{path}:{line}:{column}: "), msg
    assert msg.endswith(f"({value!r})"), msg
    return err


# -- the project's own sample ---------------------------------------------------------------


@pytest.mark.parametrize("which", sorted(SAMPLES))
def test_committed_sample_is_what_the_generator_writes(which: str) -> None:
    # The shipped sample is written by tests/trace_sample.py from the embedded quantile
    # tables, not copied from the real traces; regenerate it with that script.
    assert sample_path(which).read_bytes() == sample_text(which)


@pytest.mark.parametrize("which", sorted(SAMPLES))
def test_sample_loads_with_the_published_quirks(which: str, request: pytest.FixtureRequest) -> None:
    raw = sample_path(which).read_bytes()
    assert raw.startswith(AZURE_HEADER.encode() + b"\r\n") and not raw.endswith(b"\n")
    trace: Trace = request.getfixturevalue(f"sample_{which}_trace")
    _table, rows, _seed = SAMPLES[which]
    assert len(trace) == rows  # the last row, without a newline, is kept
    assert trace.requests[0].arrival_s == 0.0 and 25 * 60 < trace.duration_s < 30 * 60
    assert np.all(np.diff(trace.arrivals_s) >= 0)
    first = raw.split(b"\r\n")[1].decode().split(",")
    assert (trace.requests[0].num_prompt_tokens, trace.requests[0].num_output_tokens) == (int(first[1]), int(first[2]))
    # 7 fraction digits are kept exactly (100 ns ticks).
    second = raw.split(b"\r\n")[2].decode().split(",")[0]

    def ns(stamp: str) -> int:
        whole = datetime.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
        return int(whole.timestamp()) * 10**9 + int(stamp[20:27]) * 100

    assert trace.requests[1].arrival_s == (ns(second) - ns(first[0])) / 1e9
    assert trace.name == f"AzureLLMInferenceTrace_{which}_sample"


# -- the real Azure 2023 traces -----------------------------------------------------------


def test_azure_code_trace_loads(code_trace: Trace) -> None:
    # The shared README says 8,818 rows: that is `wc -l` minus the header, but the
    # file's last row has no newline; the file holds 8,819 data rows (CRLF lines).
    assert len(code_trace) == 8819
    assert 57 * 60 <= code_trace.duration_s <= 58 * 60
    first, second, last = code_trace.requests[0], code_trace.requests[1], code_trace.requests[-1]
    assert (first.arrival_s, first.num_prompt_tokens, first.num_output_tokens) == (0.0, 4808, 10)
    # 18:17:04.0319600 - 18:17:03.9799600, from 7 fraction digits.
    assert second.arrival_s == pytest.approx(0.052, abs=1e-9)
    assert (last.num_prompt_tokens, last.num_output_tokens) == (549, 173)
    # 19:14:19.9280160 - 18:17:03.9799600
    assert last.arrival_s == pytest.approx(57 * 60 + 15.948056, abs=1e-9)
    assert np.all(np.diff(code_trace.arrivals_s) >= 0)
    assert code_trace.name == "AzureLLMInferenceTrace_code"


def test_azure_conv_trace_loads(conv_trace: Trace) -> None:
    # README: 19,365 (same off-by-one as the code trace).
    assert len(conv_trace) == 19366
    assert 58 * 60 <= conv_trace.duration_s <= 59 * 60
    first, last = conv_trace.requests[0], conv_trace.requests[-1]
    assert (first.num_prompt_tokens, first.num_output_tokens) == (374, 44)
    assert conv_trace.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert (last.num_prompt_tokens, last.num_output_tokens) == (197, 183)
    assert conv_trace.rate_per_s == pytest.approx(19366 / conv_trace.duration_s)
    assert all(r.hash_ids == () and r.model == "" and r.num_cached_tokens == 0
               for r in conv_trace.requests)


def test_load_trace_detects_azure(azure_dir: Path, code_trace: Trace) -> None:
    assert load_trace(azure_dir / CODE) == code_trace
    assert load_trace(azure_dir / CODE, "azure") == code_trace


@pytest.mark.parametrize("which", sorted(SAMPLES))
def test_load_trace_detects_azure_on_the_sample(which: str, request: pytest.FixtureRequest) -> None:
    trace = request.getfixturevalue(f"sample_{which}_trace")
    assert load_trace(sample_path(which)) == trace
    assert load_trace(sample_path(which), "azure") == trace


def brute_counts(arrivals: np.ndarray, length: float, step: float, duration: float) -> list[int]:
    counts = []
    k = 0
    while k * step + length <= duration + 1e-9:
        s = k * step
        counts.append(sum(1 for a in arrivals if s <= a < s + length))
        k += 1
    return counts


@pytest.mark.parametrize("which", AZURE_TRACES)
def test_trace_windows_order_by_rate(which: str, request: pytest.FixtureRequest) -> None:
    trace: Trace = request.getfixturevalue(f"{which}_trace")
    w = trace.windows(length_s=600, step_s=60)
    assert set(w) == {"peak", "median", "trough"}
    assert w["peak"].rate_per_s >= w["median"].rate_per_s >= w["trough"].rate_per_s
    assert w["peak"].rate_per_s > w["trough"].rate_per_s  # real (and sampled) traffic is not flat
    counts = brute_counts(trace.arrivals_s, 600, 60, trace.duration_s)
    assert len(w["peak"]) == max(counts)
    assert len(w["trough"]) == min(counts)
    assert len(w["median"]) == sorted(counts)[(len(counts) - 1) // 2]
    for win in w.values():
        assert win.duration_s == 600
        assert all(0 <= a < 600 for a in win.arrivals_s)


@pytest.mark.parametrize("which", ["sample_code", "code"])
def test_trace_shorter_than_an_hour_has_no_hour_window(which: str, request: pytest.FixtureRequest) -> None:
    trace: Trace = request.getfixturevalue(f"{which}_trace")
    with pytest.raises(ConfigError) as info:
        trace.windows()  # default 3600 s; the trace spans under an hour
    assert info.value.field == "length_s" and "spans only" in str(info.value)


@pytest.mark.parametrize("which", ["sample_conv", "conv"])
def test_trace_capped_reports_the_count(which: str, request: pytest.FixtureRequest) -> None:
    trace: Trace = request.getfixturevalue(f"{which}_trace")
    expected = sum(1 for r in trace.requests
                   if r.num_prompt_tokens > 2048 or r.num_output_tokens > 256)
    assert expected > 0
    capped, n = trace.capped(max_prompt=2048, max_output=256)
    assert n == expected
    assert len(capped) == len(trace)
    assert max(r.num_prompt_tokens for r in capped.requests) == 2048
    assert max(r.num_output_tokens for r in capped.requests) == 256
    changed = sum(a != b for a, b in zip(capped.requests, trace.requests, strict=True))
    assert changed == n


# -- Trace operations ---------------------------------------------------------------------


def make_trace(arrivals, name="t", **kw) -> Trace:
    return Trace(name, tuple(TraceRequest(float(a), 100 + i, 10 + i) for i, a in enumerate(arrivals)), **kw)


def test_window_rebases_and_keeps_half_open_interval() -> None:
    t = make_trace([0, 1, 2, 3, 4, 5, 10])
    w = t.window(2, 3)
    assert [r.arrival_s for r in w.requests] == [0.0, 1.0, 2.0]
    assert [r.num_prompt_tokens for r in w.requests] == [102, 103, 104]
    assert w.duration_s == 3 and w.rate_per_s == 1.0
    assert len(t.window(5, 5)) == 1  # 5 in, 10 (the end) out
    with pytest.raises(ConfigError) as info:
        t.window(8, 5)
    assert info.value.field == "length_s" and "past the trace end" in str(info.value)
    for bad in ({"start_s": -1, "length_s": 1}, {"start_s": 0, "length_s": 0}):
        with pytest.raises(ConfigError):
            t.window(**bad)


def test_scaled_compresses_and_stretches_arrivals() -> None:
    t = make_trace([0, 2, 4, 8])
    fast = t.scaled(2.0)
    assert list(fast.arrivals_s) == [0, 1, 2, 4]
    assert fast.rate_per_s == pytest.approx(2 * t.rate_per_s)
    assert [r.num_prompt_tokens for r in fast.requests] == [r.num_prompt_tokens for r in t.requests]
    assert list(t.scaled(0.5).arrivals_s) == [0, 4, 8, 16]
    assert t.window(0, 8).scaled(2).duration_s == 4
    for bad in (0, -1, math.inf, math.nan, True):
        with pytest.raises(ConfigError):
            t.scaled(bad)


def test_capped_counts_and_trims_cache_and_hash_blocks() -> None:
    reqs = (
        TraceRequest(0.0, 2000, 50, hash_ids=(1, 2, 3, 4), num_cached_tokens=1800),
        TraceRequest(1.0, 500, 900, hash_ids=(1,)),
        TraceRequest(2.0, 100, 10),
    )
    t = Trace("t", reqs)
    capped, n = t.capped(max_prompt=1000, max_output=100)
    assert n == 2
    a, b, c = capped.requests
    assert (a.num_prompt_tokens, a.num_cached_tokens, a.hash_ids, a.num_output_tokens) == (1000, 1000, (1, 2), 50)
    assert (b.num_prompt_tokens, b.num_output_tokens, b.hash_ids) == (500, 100, (1,))
    assert c == reqs[2]
    same, zero = t.capped()
    assert zero == 0 and same == t
    _, only_out = t.capped(max_output=20)
    assert only_out == 2
    for bad in ({"max_prompt": 0}, {"max_output": -5}, {"max_prompt": 1.5}):
        with pytest.raises(ConfigError):
            t.capped(**bad)


def test_windows_pick_known_peak_and_trough() -> None:
    # 10 s at 1/s, 10 s at 5/s, 10 s at 0.5/s
    arrivals = list(range(10)) + [10 + i / 5 for i in range(50)] + [20 + 2 * i for i in range(5)] + [30]
    w = make_trace(arrivals).windows(length_s=10, step_s=1)
    assert w["peak"].name.endswith("[10s+10s]") and len(w["peak"]) == 50
    assert w["trough"].name.endswith("[20s+10s]") and len(w["trough"]) == 5
    assert w["peak"].rate_per_s >= w["median"].rate_per_s >= w["trough"].rate_per_s


@given(st.lists(st.floats(0, 500, allow_nan=False), min_size=1, max_size=60),
       st.sampled_from([10.0, 37.5, 100.0]), st.sampled_from([1.0, 7.0, 60.0]))
@settings(max_examples=60, deadline=None)
def test_windows_match_brute_force(arrivals, length, step) -> None:
    t = make_trace(sorted(arrivals), span_s=max(arrivals + [length]))
    w = t.windows(length_s=length, step_s=step)
    counts = brute_counts(t.arrivals_s, length, step, t.duration_s)
    assert (len(w["peak"]), len(w["median"]), len(w["trough"])) == (
        max(counts), sorted(counts)[(len(counts) - 1) // 2], min(counts))


def test_trace_invariants() -> None:
    with pytest.raises(ConfigError) as info:
        make_trace([0, 2, 1])
    assert info.value.field == "requests[2].arrival_s"
    with pytest.raises(ConfigError):
        TraceRequest(0.0, 10, 1, num_cached_tokens=11)
    with pytest.raises(ConfigError):
        TraceRequest(-1.0, 10, 1)
    with pytest.raises(ConfigError):
        TraceRequest(0.0, 10, 1, hash_ids=(1, -2))
    with pytest.raises(ConfigError):
        make_trace([0, 5], span_s=4)
    assert Trace("e", ()).rate_per_s == 0.0 and Trace("e", ()).duration_s == 0.0
    assert make_trace([0, 0]).rate_per_s == math.inf and make_trace([3, 3]).rate_per_s == 2 / 3
    with pytest.raises(ConfigError):
        Trace("e", ()).windows(10)


# -- malformed rows: Azure ---------------------------------------------------------------

ROW = "2023-11-16 18:17:03.9799600,4808,10"

AZURE_BAD = [
    # (file text, line, column, value, words in the problem)
    (f"{AZURE_HEADER}\n{ROW}\n2023-11-16 18:17:04.0319600,3180\n", 3, 3,
     "2023-11-16 18:17:04.0319600,3180", "missing column GeneratedTokens"),
    (f"{AZURE_HEADER}\n{ROW}\n2023-11-16 18:17:04.0319600,31x0,8\n", 3, 2, "31x0", "not an integer"),
    (f"{AZURE_HEADER}\n{ROW}\n2023-11-16 18:17:04.0319600,3180,8.5\n", 3, 3, "8.5", "not an integer"),
    (f"{AZURE_HEADER}\n2023-11-16 18:17:04.0319600,-3180,8\n", 2, 2, "-3180", "negative"),
    (f"{AZURE_HEADER}\n2023-11-16 18:17:04.0319600,,8\n", 2, 2, "", "empty field"),
    (f"{AZURE_HEADER}\n{ROW}\n16/11/2023 18:17:04,3180,8\n", 3, 1, "16/11/2023 18:17:04", "unparsable timestamp"),
    (f"{AZURE_HEADER}\n2023-02-30 18:17:04.0319600,3180,8\n", 2, 1, "2023-02-30 18:17:04.0319600", "invalid date"),
    (f"{AZURE_HEADER}\n2023-11-16 24:17:04.0319600,3180,8\n", 2, 1, "2023-11-16 24:17:04.0319600", "time of day"),
    (f"{AZURE_HEADER}\n2023-11-16 18:17:04.0319600123,3180,8\n", 2, 1, "2023-11-16 18:17:04.0319600123",
     "unparsable timestamp"),
    (f"{AZURE_HEADER}\n{ROW}\n2023-11-16 18:17:03.9799599,3180,8\n", 3, 1, "2023-11-16 18:17:03.9799599", "decreases"),
    (f"{AZURE_HEADER}\n{ROW}\n2023-11-16 18:17:04Z,3180,8\n", 3, 1, "2023-11-16 18:17:04Z", "mixes"),
    (f"{AZURE_HEADER}\n{ROW},7\n", 2, 4, "7", "extra field"),
    (f"{AZURE_HEADER}\n{ROW}\n\n{ROW}\n", 3, 1, "", "empty row"),
    ("", 1, 1, "", "empty file"),
    (f"{AZURE_HEADER}\n", 2, 1, "", "no data rows"),
    ("TIMESTAMP,Context,Generated\n" + ROW + "\n", 1, 1, "TIMESTAMP,Context,Generated",
     "TIMESTAMP, ContextTokens, GeneratedTokens"),
    (f"{BURST_HEADER}\n5,ChatGPT,472,18,490,Conversation log\n", 1, 1, BURST_HEADER, "missing TIMESTAMP"),
]


@pytest.mark.parametrize(("text", "line", "column", "value", "problem"), AZURE_BAD)
def test_azure_malformed_rows(tmp_path: Path, text, line, column, value, problem) -> None:
    path = write(tmp_path / "azure.csv", text)
    err = raises_at(lambda: load_azure(path), path, line, column, value)
    assert problem in err.problem, str(err)


def test_azure_non_utf8_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_bytes(f"{AZURE_HEADER}\n{ROW}\n2023-11-16 18:17:04.1,3\xff1,8\n".encode("latin-1"))
    err = raises_at(lambda: load_azure(path), path, 3, 24, b"\xff1,8")
    assert "UTF-8" in err.problem


def test_azure_crlf_bom_and_gzip(tmp_path: Path) -> None:
    text = f"\ufeff{AZURE_HEADER}\r\n{ROW}\r\n2023-11-16 18:17:03.9799601,1,2\r\n2023-11-16 18:17:04,3,4"
    plain = write(tmp_path / "a.csv", text)
    packed = tmp_path / "a.csv.gz"
    packed.write_bytes(gzip.compress(text.encode("utf-8")))
    for path in (plain, packed):
        t = load_azure(path)
        assert [r.num_prompt_tokens for r in t.requests] == [4808, 1, 3]
        assert t.requests[1].arrival_s == pytest.approx(1e-7, abs=1e-12)  # the 7th digit
        assert t.requests[2].arrival_s == pytest.approx(0.02004, abs=1e-12)
        assert t.name == "a"


def test_azure_utc_offsets_are_honoured(tmp_path: Path) -> None:
    path = write(tmp_path / "a.csv", f"{AZURE_HEADER}\n2024-05-10 01:00:00.5+01:00,1,1\n"
                                     "2024-05-10T00:00:01Z,2,2\n")
    assert list(load_azure(path).arrivals_s) == [0.0, 0.5]


# -- malformed rows: BurstGPT --------------------------------------------------------------

B1 = "5,ChatGPT,472,18,490,Conversation log"

BURST_BAD = [
    (f"{BURST_HEADER}\n{B1}\n45,ChatGPT,1087,230,1317\n", 3, 6, "45,ChatGPT,1087,230,1317", "missing column Log Type"),
    (f"{BURST_HEADER}\n{B1}\n45,ChatGPT,1087,2.5,1317,API log\n", 3, 4, "2.5", "Response tokens: not an integer"),
    (f"{BURST_HEADER}\n45,ChatGPT,-1087,230,1317,API log\n", 2, 3, "-1087", "Request tokens: negative"),
    (f"{BURST_HEADER}\n45,ChatGPT,1087,230,many,API log\n", 2, 5, "many", "Total tokens: not an integer"),
    (f"{BURST_HEADER}\nsoon,ChatGPT,1087,230,1317,API log\n", 2, 1, "soon", "not a number"),
    (f"{BURST_HEADER}\nnan,ChatGPT,1087,230,1317,API log\n", 2, 1, "nan", "not a number"),
    (f"{BURST_HEADER}\n{B1}\n4,ChatGPT,1087,230,1317,API log\n", 3, 1, "4", "decreases"),
    ("Timestamp,Model,Request tokens,Response tokens\n5,ChatGPT,472,18\n", 1, 1,
     "Timestamp,Model,Request tokens,Response tokens", "missing Total tokens, Log Type"),
    ("", 1, 1, "", "empty file"),
    (f"{BURST_HEADER}\n\n", 2, 1, "", "no data rows"),
]


@pytest.mark.parametrize(("text", "line", "column", "value", "problem"), BURST_BAD)
def test_burstgpt_malformed_rows(tmp_path: Path, text, line, column, value, problem) -> None:
    path = write(tmp_path / "burst.csv", text)
    err = raises_at(lambda: load_burstgpt(path), path, line, column, value)
    assert problem in err.problem, str(err)


def test_burstgpt_happy_path_keeps_failures(tmp_path: Path) -> None:
    path = write(tmp_path / "BurstGPT_1.csv", (
        f"{BURST_HEADER}\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,230,1317,Conversation log\n"
        "45,GPT-4,300,0,300,API log\n"            # a failure: kept, 0 output tokens
        "118.25,GPT-4,417,276,693,Conversation log\n"))
    t = load_burstgpt(path)
    assert [r.arrival_s for r in t.requests] == [0.0, 40.0, 40.0, 113.25]
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in t.requests] == [
        (472, 18), (1087, 230), (300, 0), (417, 276)]
    assert [r.model for r in t.requests] == ["ChatGPT", "ChatGPT", "GPT-4", "GPT-4"]
    assert t.name == "BurstGPT_1"
    assert load_trace(path) == t


# -- malformed rows: Mooncake --------------------------------------------------------------

M1 = '{"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2]}'

MOONCAKE_BAD = [
    (f'{M1}\n{{"timestamp": 10, "output_length": 5, "hash_ids": []}}\n', 2, "input_length",
     ["hash_ids", "output_length", "timestamp"], "missing field 'input_length'"),
    (f'{M1}\n{{"timestamp": 10, "input_length": "12", "output_length": 5}}\n', 2, "input_length", "12",
     "not an integer"),
    (f'{M1}\n{{"timestamp": 10, "input_length": 12, "output_length": 5.0}}\n', 2, "output_length", 5.0,
     "not an integer"),
    (f'{M1}\n{{"timestamp": 10, "input_length": 12, "output_length": true}}\n', 2, "output_length", True,
     "not an integer"),
    ('{"timestamp": 10, "input_length": 12, "output_length": -5}\n', 1, "output_length", -5, "negative"),
    (f'{M1}\n{{"timestamp": 10, "input_length": 12, "output_length": 5, "hash_ids": [0, "a"]}}\n', 2,
     "hash_ids[1]", "a", "not an integer"),
    (f'{M1}\n{{"timestamp": 10, "input_length": 12, "output_length": 5, "hash_ids": 7}}\n', 2,
     "hash_ids", 7, "not a list"),
    (f'{M1}\n{{"timestamp": "10", "input_length": 12, "output_length": 5}}\n', 2, "timestamp", "10",
     "not a number"),
    (f'{M1}\n{{"timestamp": NaN, "input_length": 12, "output_length": 5}}\n', 2, "timestamp", math.nan,
     "not a number"),
    (f'{{"timestamp": 10, "input_length": 1, "output_length": 1}}\n{M1}\n', 2, "timestamp", 0, "decreases"),
    (f'{M1}\n[1, 2]\n', 2, "$", [1, 2], "expected a JSON object"),
    (f'{M1}\n{{"timestamp": 10, "input_length": 12 "output_length": 5}}\n', 2, 38, '"output_length": 5}',
     "invalid JSON"),
    (f'{M1}\n\n{M1}\n', 2, 1, "", "empty line"),
    ("\n\n", 1, 1, "", "empty file"),
]


@pytest.mark.parametrize(("text", "line", "column", "value", "problem"), MOONCAKE_BAD)
def test_mooncake_malformed_rows(tmp_path: Path, text, line, column, value, problem) -> None:
    path = write(tmp_path / "mooncake_trace.jsonl", text)
    with pytest.raises(TraceError) as info:
        load_mooncake(path)
    err = info.value
    assert (err.path, err.line, err.column) == (str(path), line, column), str(err)
    if isinstance(value, float) and math.isnan(value):
        assert isinstance(err.value, float) and math.isnan(err.value)
    else:
        assert err.value == value and type(err.value) is type(value)
    assert str(err).startswith(f"{path}:{line}:{column}: ") and str(err).endswith(f"({value!r})")
    assert problem in err.problem, str(err)


def test_mooncake_happy_path(tmp_path: Path) -> None:
    path = write(tmp_path / "mooncake_trace.jsonl", (
        '{"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2]}\n'
        '{"timestamp": 0, "input_length": 7319, "output_length": 490, "hash_ids": [0, 14]}\n'
        '{"timestamp": 3052, "input_length": 12, "output_length": 3, "extra": "ignored"}\n\n'))
    t = load_mooncake(path)
    assert [r.arrival_s for r in t.requests] == [0.0, 0.0, 3.052]
    assert [r.hash_ids for r in t.requests] == [(0, 1, 2), (0, 14), ()]
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in t.requests] == [(6755, 500), (7319, 490), (12, 3)]
    assert load_trace(path) == t


# -- malformed rows: Copilot ---------------------------------------------------------------


def call(ts="2026-06-01T00:00:00.000Z", prompt=1000, completion=20, cached=800, model="Model A", **extra):
    c = {"message_id": "m", "timestamp": ts, "duration_ms": 12.5, "initiator_type": "agent",
         "model": model, "result": "Success", "status_code": "OK",
         "tokens": {"total": prompt + completion, "prompt": prompt, "completion": completion,
                    "cached": cached, "cached_pct": 80.0},
         "message_metadata": [{"type": "System", "role": "system", "sequenceId": 0, "token_len": 5}]}
    c.update(extra)
    return c


def session(sid, *turns):
    return {"session_id": sid, "date": "2026-06-01",
            "turns": [{"turn_id": f"{sid}-t{i}", "llm_calls": list(calls), "tool_batches": []}
                      for i, calls in enumerate(turns)]}


def jsonl(*sessions) -> str:
    return "".join(json.dumps(s) + "\n" for s in sessions)


GOOD = session("s0", [call()])


def broken(mutate):
    s = session("s1", [call(ts="2026-06-01T00:00:01Z")], [call(ts="2026-06-01T00:00:02Z"),
                                                          call(ts="2026-06-01T00:00:03Z")])
    mutate(s)
    return s


COPILOT_BAD = [
    (broken(lambda s: s.pop("session_id")), "session_id", ["date", "turns"], "missing field 'session_id'"),
    (broken(lambda s: s.update(turns={"a": 1})), "turns", {"a": 1}, "not a list"),
    (broken(lambda s: s["turns"][1].pop("llm_calls")), "turns[1].llm_calls", ["tool_batches", "turn_id"],
     "missing field"),
    (broken(lambda s: s["turns"][1]["llm_calls"][1]["tokens"].update(prompt="12")),
     "turns[1].llm_calls[1].tokens.prompt", "12", "not an integer"),
    (broken(lambda s: s["turns"][1]["llm_calls"][0]["tokens"].update(completion=-1)),
     "turns[1].llm_calls[0].tokens.completion", -1, "negative"),
    (broken(lambda s: s["turns"][0]["llm_calls"][0]["tokens"].update(cached=5000)),
     "turns[0].llm_calls[0].tokens.cached", 5000, "exceed prompt"),
    (broken(lambda s: s["turns"][0]["llm_calls"][0]["tokens"].pop("cached")),
     "turns[0].llm_calls[0].tokens.cached", ["cached_pct", "completion", "prompt", "total"], "missing field"),
    (broken(lambda s: s["turns"][1]["llm_calls"][1].update(timestamp="June 1st")),
     "turns[1].llm_calls[1].timestamp", "June 1st", "unparsable timestamp"),
    (broken(lambda s: s["turns"][1]["llm_calls"][1].update(timestamp=1780000000)),
     "turns[1].llm_calls[1].timestamp", 1780000000, "timestamp"),
    (broken(lambda s: s["turns"][1]["llm_calls"][1].update(timestamp="2026-06-01 00:00:03")),
     "turns[1].llm_calls[1].timestamp", "2026-06-01 00:00:03", "mixes"),
    (broken(lambda s: s["turns"][0]["llm_calls"][0].update(model=None)),
     "turns[0].llm_calls[0].model", None, "not a string"),
    (broken(lambda s: s["turns"][0]["llm_calls"].__setitem__(0, "call")),
     "turns[0].llm_calls[0]", "call", "expected a JSON object"),
]


@pytest.mark.parametrize(("record", "column", "value", "problem"), COPILOT_BAD)
def test_copilot_jsonl_malformed_records(tmp_path: Path, record, column, value, problem) -> None:
    path = write(tmp_path / "shard-0000.jsonl", jsonl(GOOD, GOOD, record, GOOD))
    err = raises_at(lambda: load_copilot(path), path, 3, column, value)
    assert problem in err.problem, str(err)


@pytest.mark.parametrize(("record", "column", "value", "problem"), COPILOT_BAD[:6])
def test_copilot_document_malformed_records_name_the_json_path(tmp_path: Path, record, column, value,
                                                                problem) -> None:
    sessions = [GOOD, GOOD, record]
    text = '{\n  "sessions": [\n' + ",\n".join("    " + json.dumps(s) for s in sessions) + "\n  ]\n}\n"
    path = write(tmp_path / "sessions.json", text)
    err = raises_at(lambda: load_copilot(path), path, 5, f"sessions[2].{column}", value)
    assert problem in err.problem
    # A top-level list: the path starts at the index.
    pretty = json.dumps(sessions, indent=2)
    path2 = write(tmp_path / "list.json", pretty)
    starts = [i for i, text in enumerate(pretty.splitlines(), 1) if text == "  {"]
    line = starts[2]
    raises_at(lambda: load_copilot(path2), path2, line, f"[2].{column}", value)


def test_copilot_syntax_errors_and_empty_files(tmp_path: Path) -> None:
    bad_line = json.dumps(GOOD)[:-1] + ",}"
    path = write(tmp_path / "shard.jsonl", jsonl(GOOD) + bad_line + "\n")
    err = raises_at(lambda: load_copilot(path), path, 2, len(bad_line), "}")
    assert "invalid JSON" in err.problem
    doc = write(tmp_path / "doc.json", '{\n  "sessions": [\n    {"session_id": "a",, "turns": []}\n  ]\n}\n')
    err = raises_at(lambda: load_copilot(doc), doc, 3, 24, ', "turns": []}')
    assert "invalid JSON" in err.problem
    empty = write(tmp_path / "empty.jsonl", "")
    raises_at(lambda: load_copilot(empty), empty, 1, 1, "")
    no_calls = write(tmp_path / "nocalls.jsonl", jsonl(session("a", []), session("b")))
    err = raises_at(lambda: load_copilot(no_calls), no_calls, 1, "$", 0)
    assert "no llm_calls" in err.problem
    wrong = write(tmp_path / "wrong.json", '{\n  "data": []\n}\n')
    raises_at(lambda: load_copilot(wrong), wrong, 1, "$", ["data"])
    # One object on one line is a JSONL session record.
    one = write(tmp_path / "one.json", '{"data": []}')
    raises_at(lambda: load_copilot(one), one, 1, "session_id", ["data"])


def test_copilot_happy_path_sorts_interleaved_sessions(tmp_path: Path) -> None:
    a = session("a", [call("2026-06-01T10:00:00.5Z", 1000, 10, 0), call("2026-06-01T10:00:04Z", 1500, 20, 1000)],
                [call("2026-06-01T10:01:00Z", 3000, 30, 1500, model="Model B")])
    b = session("b", [call("2026-06-01T10:00:02.25Z", 800, 8, 0, model="tool-model"),
                      call("2026-06-01T10:00:04Z", 0, 0, 0)])
    text = jsonl(a, b)
    plain = write(tmp_path / "shard-0000.jsonl", text)
    packed = tmp_path / "shard-0000.jsonl.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    doc = write(tmp_path / "doc.json", json.dumps({"sessions": [a, b]}, indent=1))
    listed = write(tmp_path / "list.json", json.dumps([a, b]))
    expected = [
        (0.0, "a", 1000, 10, 0, "Model A"),
        (1.75, "b", 800, 8, 0, "tool-model"),
        (3.5, "a", 1500, 20, 1000, "Model A"),   # equal times keep file order
        (3.5, "b", 0, 0, 0, "Model A"),          # zero-prompt calls are kept
        (59.5, "a", 3000, 30, 1500, "Model B"),
    ]
    for path in (plain, packed, doc, listed):
        t = load_copilot(path)
        got = [(r.arrival_s, r.session_id, r.num_prompt_tokens, r.num_output_tokens, r.num_cached_tokens, r.model)
               for r in t.requests]
        assert got == expected, path
        assert load_trace(path) == t


# -- format choice --------------------------------------------------------------------------


def test_load_trace_rejects_unknown_formats(tmp_path: Path) -> None:
    path = write(tmp_path / "x.csv", "a,b,c\n1,2,3\n")
    err = raises_at(lambda: load_trace(path), path, 1, 1, "a,b,c")
    for fmt in FORMATS:
        assert fmt in err.problem
    with pytest.raises(ConfigError) as info:
        load_trace(path, "parquet")
    assert info.value.field == "format" and "azure" in str(info.value)
    assert set(FORMATS) == {"azure", "burstgpt", "mooncake", "copilot"}


def test_load_trace_reports_a_broken_first_record(tmp_path: Path) -> None:
    path = write(tmp_path / "m.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 2,}\n')
    err = raises_at(lambda: load_trace(path), path, 1, 56, "}")
    assert "invalid JSON" in err.problem


def test_missing_file_raises_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_azure(tmp_path / "absent.csv")


# -- round trips ----------------------------------------------------------------------------

counts = st.integers(0, 200_000)
EPOCH_2020 = datetime(2020, 1, 1)


@given(st.integers(0, 10**7 * 86400 * 3650), st.lists(st.tuples(st.integers(0, 10**9), counts, counts),
                                                      min_size=1, max_size=40))
@settings(max_examples=80, deadline=None)
def test_azure_round_trip(start_ticks, rows) -> None:
    ticks, lines, expected = start_ticks, [AZURE_HEADER], []
    for gap, prompt, output in rows:
        ticks += gap  # 100 ns ticks, as in the 7-digit timestamps
        stamp = EPOCH_2020 + timedelta(seconds=ticks // 10**7)
        lines.append(f"{stamp:%Y-%m-%d %H:%M:%S}.{ticks % 10**7:07d},{prompt},{output}")
        expected.append(((ticks - start_ticks - rows[0][0]) / 1e7, prompt, output))
    with tempfile.TemporaryDirectory() as d:
        t = load_azure(write(Path(d) / "r.csv", "\r\n".join(lines)))
    assert len(t) == len(rows)
    for r, (arrival, prompt, output) in zip(t.requests, expected, strict=True):
        assert (r.num_prompt_tokens, r.num_output_tokens) == (prompt, output)
        assert r.arrival_s == pytest.approx(arrival, abs=1e-9)


@given(st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["ChatGPT", "GPT-4", "a, b", 'q"x']),
                          counts, counts, st.sampled_from(["Conversation log", "API log"])),
                min_size=1, max_size=40),
       st.integers(0, 10**6))
@settings(max_examples=80, deadline=None)
def test_burstgpt_round_trip(rows, start_ms) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b.csv"
        with path.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(BURST_HEADER.split(","))
            ms = start_ms
            stamps = []
            for gap, model, prompt, output, log in rows:
                ms += gap
                stamps.append(ms)
                w.writerow([f"{ms / 1000}", model, prompt, output, prompt + output, log])
        t = load_burstgpt(path)
    assert [(r.model, r.num_prompt_tokens, r.num_output_tokens) for r in t.requests] == [
        (m, p, o) for _, m, p, o, _ in rows]
    for r, ms in zip(t.requests, stamps, strict=True):
        assert r.arrival_s == pytest.approx((ms - stamps[0]) / 1000, abs=1e-6)


@given(st.lists(st.tuples(st.integers(0, 10**6), counts, counts,
                          st.lists(st.integers(0, 2**40), max_size=8)), min_size=1, max_size=40),
       st.booleans())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mooncake_round_trip(rows, packed) -> None:
    ms, text, stamps = 0, "", []
    for gap, prompt, output, ids in rows:
        ms += gap
        stamps.append(ms)
        text += json.dumps({"timestamp": ms, "input_length": prompt, "output_length": output,
                            "hash_ids": ids}) + "\n"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.jsonl"
        path.write_bytes(gzip.compress(text.encode()) if packed else text.encode())
        t = load_mooncake(path)
    assert [(r.num_prompt_tokens, r.num_output_tokens, r.hash_ids) for r in t.requests] == [
        (p, o, tuple(i)) for _, p, o, i in rows]
    assert [r.arrival_s for r in t.requests] == [(s - stamps[0]) / 1000 for s in stamps]


copilot_call = st.tuples(st.integers(0, 10**12), st.integers(0, 10**6), st.integers(0, 10**4),
                         st.floats(0, 1), st.sampled_from(["Model A", "Model B", "tool-model"]))


@given(st.lists(st.lists(st.lists(copilot_call, max_size=4), max_size=3), min_size=1, max_size=6),
       st.sampled_from(["Z", "+00:00", "-05:30"]))
@settings(max_examples=60, deadline=None)
def test_copilot_round_trip(sessions, tz) -> None:
    base = datetime(2026, 6, 1, tzinfo=UTC)
    records, expected = [], []
    for si, turns in enumerate(sessions):
        rec_turns = []
        for turn in turns:
            calls = []
            for offset_ns, prompt, completion, frac, model in turn:
                cached = int(prompt * frac)
                stamp = base + timedelta(seconds=offset_ns // 10**9)
                if tz == "-05:30":
                    stamp = stamp.astimezone(timezone(-timedelta(hours=5, minutes=30)))
                text = f"{stamp:%Y-%m-%dT%H:%M:%S}.{offset_ns % 10**9:09d}{tz}"
                calls.append(call(text, prompt, completion, cached, model=model))
                expected.append((offset_ns, len(expected), prompt, completion, cached, model, f"s{si}"))
            rec_turns.append(calls)
        records.append(session(f"s{si}", *rec_turns))
    with tempfile.TemporaryDirectory() as d:
        path = write(Path(d) / "c.jsonl", jsonl(*records))
        if not expected:
            with pytest.raises(TraceError):
                load_copilot(path)
            return
        t = load_copilot(path)
    expected.sort(key=lambda e: (e[0], e[1]))
    t0 = expected[0][0]
    assert [(r.num_prompt_tokens, r.num_output_tokens, r.num_cached_tokens, r.model, r.session_id)
            for r in t.requests] == [e[2:] for e in expected]
    assert [r.arrival_s for r in t.requests] == pytest.approx([(e[0] - t0) / 1e9 for e in expected], abs=1e-9)


def test_trace_request_is_frozen() -> None:
    r = TraceRequest(0.0, 1, 1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        r.arrival_s = 1.0  # type: ignore[misc]
