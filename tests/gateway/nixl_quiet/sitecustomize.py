"""Test-only: NIXL agents without their busy progress thread.

Put on ``PYTHONPATH`` of the NIXL vLLM servers that ``tests/gateway/test_pd_vllm_engine.py``
starts (and nowhere else). The NIXL Python API (1.5.1) starts every agent with
a progress thread (``nixl_agent_config(enable_prog_thread=True)``, the default
vLLM's ``NixlConnector`` keeps) whose delay is hard-coded to 0, so an idle
server spins one CPU core on it: four such servers on a 2-core test machine
starved everything else and made that module take 5 minutes. Without the
thread, UCX makes progress when vLLM polls its transfers (every engine step
while a transfer is pending), which is all a test on CPU needs; on a GPU
deployment the default stays (docs/vllm.md says so).
"""

from nixl import _api

_defaults = list(_api.nixl_agent_config.__init__.__defaults__)
_defaults[0] = False  # enable_prog_thread, the first keyword of nixl_agent_config.__init__
_api.nixl_agent_config.__init__.__defaults__ = tuple(_defaults)
