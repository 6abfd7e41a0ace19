"""``shadowprefill serve --config gateway.yaml``: run the gateway with uvicorn.

Registered as the ``serve`` plugin of the entry-point group
``shadowprefill.commands``; FastAPI and uvicorn are imported only here, so
``shadowcore`` never needs them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from shadowcore.cli import HelpFormatter, describe
from shadowcore.errors import ConfigError, PluginError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the session gateway: an OpenAI-compatible API that routes agent calls and keeps the next model warm."""
    parser = argparse.ArgumentParser(prog="shadowprefill serve", formatter_class=HelpFormatter,
                                     description=describe(main.__doc__) + " The configuration file names the "
                                     "models and their vLLM instances, the router and the shadow policy "
                                     "(docs/gateway.md, examples/gateway.yaml).")
    parser.add_argument("--config", required=True, help="gateway YAML file (see docs/gateway.md)")
    parser.add_argument("--host", help="override listen.host")
    parser.add_argument("--port", type=int, help="override listen.port")
    parser.add_argument("--check", action="store_true", help="validate the configuration and exit")
    parser.add_argument("--log-level", default="info", help="log level of the gateway and uvicorn")
    args = parser.parse_args(list(argv or []))
    try:
        import uvicorn

        from shadow_gateway.app import create_app
        from shadow_gateway.config import check_host, check_listen, check_port, load_config
        from shadow_gateway.gateway import Gateway
    except ImportError as e:
        print(f"shadowprefill serve: error: {e}; install the gateway extra: pip install 'shadowprefill[gateway]'",
              file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        if args.host is not None:
            check_host("--host", args.host)
            check_listen("--host", args.host, config.auth)
        if args.port is not None:
            check_port("--port", args.port)
        gateway = Gateway(config)  # loads the router and the shadow policy: errors before listening
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill serve: error: {e}", file=sys.stderr)
        return 2
    if config.tokenizer_check:  # also run at startup; here it fails with one clear line
        import asyncio

        try:
            asyncio.run(gateway.check_tokenizers())
        except ConfigError as e:
            print(f"shadowprefill serve: error: {e}", file=sys.stderr)
            return 2
    if args.check:
        print(f"{args.config}: ok ({len(config.models)} models, router {config.router.name}, "
              f"policy {config.shadow.policy.name})")
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = args.host if args.host is not None else config.host
    port = args.port if args.port is not None else config.port
    uvicorn.run(create_app(config, gateway), host=host, port=port,
                log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
