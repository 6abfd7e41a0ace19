"""Does a KV connector move KV between two vLLM CPU processes? Start a prefill
(P) and a decode (D) server of a tiny model (built offline) with one connector,
send one prompt P then D as vLLM's disaggregated proxies do, and print what D
reports: tokens received through the connector (``vllm:external_prefix_cache_hits``),
tokens from its own prefix cache, its ``cached_tokens``, and whether its greedy
output equals a colocated prefill of the same prompt on P.

::

    python benchmarks/pd_transport.py                         # ExampleConnector (shared storage)
    python benchmarks/pd_transport.py --connector NixlConnector   # needs the nixl-cu12 package importable
    python benchmarks/pd_transport.py --prompt-tokens 1200 --max-num-batched-tokens 512   # a chunked prefill

With ``--prefix-tokens N`` D first receives a prompt of N tokens (a push), and
then the full prompt: the second transfer shows what D takes from its own cache
and what it receives. Prints one JSON object per request.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counter(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
               if line.startswith((name + "{", name + " ")))


def _hits(url: str) -> tuple[float, float]:
    return _counter(url, "vllm:prefix_cache_hits_total"), _counter(url, "vllm:external_prefix_cache_hits_total")


def kv_config(connector: str, role: str, storage: Path) -> dict:
    """``--kv-transfer-config`` of one side (role: producer or consumer)."""
    if connector == "ExampleConnector":
        return {"kv_connector": connector, "kv_role": f"kv_{role}",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return {"kv_connector": connector, "kv_role": f"kv_{role}", "kv_buffer_device": "cpu"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connector", default="ExampleConnector")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--prefix-tokens", type=int, default=0, help="push a prefix of this length to D first")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args()
    from shadow_vllm.tinymodel import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="pd-transport-"))
    model = build_tiny_model(root / "tiny")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    procs, urls = [], {}
    t0 = time.monotonic()
    for role in ("producer", "consumer"):
        port = _port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
               "--block-size", str(args.block_size), "--max-model-len", "4096", "--dtype", "float32",
               "--enforce-eager", "--enable-prompt-tokens-details",
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--kv-transfer-config", json.dumps(kv_config(args.connector, role, root / "kv"))]
        side_env = dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(_port()))
        log = open(root / f"{role}.log", "w")  # noqa: SIM115 - lives as long as the process
        procs.append(subprocess.Popen(cmd, env=side_env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        urls[role] = f"http://127.0.0.1:{port}"
    try:
        for (role, url), proc in zip(urls.items(), procs, strict=True):
            while True:
                if proc.poll() is not None:
                    print((root / f"{role}.log").read_text()[-3000:], file=sys.stderr)
                    return 1
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        print(json.dumps({"connector": args.connector, "servers_healthy_s": round(time.monotonic() - t0, 1)}))
        prompt = [(i * 104729) % 400 + 40 for i in range(args.prompt_tokens)]
        c = httpx.Client(timeout=300)
        for n in ([args.prefix_tokens] if args.prefix_tokens else []) + [len(prompt)]:
            p_body = {"model": "m", "prompt": prompt[:n], "max_tokens": 1, "temperature": 0,
                      "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
            t = time.monotonic()
            pre = c.post(urls["producer"] + "/v1/completions", json=p_body).json()
            p_s = time.monotonic() - t
            d_body = {"model": "m", "prompt": prompt[:n], "max_tokens": 8, "temperature": 0, "return_token_ids": True}
            if isinstance(pre.get("kv_transfer_params"), dict):
                d_body["kv_transfer_params"] = pre["kv_transfer_params"]
            before = _hits(urls["consumer"])
            t = time.monotonic()
            dec = c.post(urls["consumer"] + "/v1/completions", json=d_body).json()
            d_s = time.monotonic() - t
            local, external = (x - y for x, y in zip(_hits(urls["consumer"]), before, strict=True))
            ref = c.post(urls["producer"] + "/v1/completions",
                         json={"model": "m", "prompt": prompt[:n], "max_tokens": 8, "temperature": 0,
                               "return_token_ids": True}).json()
            print(json.dumps({"prompt_tokens": n, "p_cached_tokens": pre["usage"]["prompt_tokens_details"]
                              ["cached_tokens"], "p_s": round(p_s, 2), "d_s": round(d_s, 2),
                              "d_local_hits": local, "d_received": external,
                              "d_cached_tokens": dec["usage"]["prompt_tokens_details"]["cached_tokens"],
                              "d_output_equals_colocated": dec["choices"][0]["token_ids"]
                              == ref["choices"][0]["token_ids"]}))
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
