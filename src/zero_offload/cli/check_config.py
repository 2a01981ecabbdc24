"""`zo check-config`: read a DeepSpeed-style JSON config as the engine would, and print it in full."""

from __future__ import annotations

import json
import sys

HELP = "validate a DeepSpeed-style JSON config and print it in full"


def add_arguments(parser) -> None:
    parser.add_argument("path")
    parser.add_argument("--world-size", type=int, default=1)


def run(args) -> int:
    from ..config import ConfigError, check_supported, load_config

    try:
        config = load_config(args.path, world_size=args.world_size)
        check_supported(config)  # the combinations zo.initialize refuses, so that OK here means it runs
    except (ConfigError, NotImplementedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(config.to_dict(), indent=2))
    print(
        f"OK: {args.path} is valid for {args.world_size} rank(s); fingerprint {config.fingerprint()[:12]}",
        file=sys.stderr,
    )
    return 0
