"""The ``flowrl`` command (layer 7)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowrl", description="flowrl: actor-pool dataflow runtime for RL post-training")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("loadtest", help="run the load-test scenarios (flowrl vs static push vs simulation)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "loadtest":
        from ._loadtest import loadtest_main

        return loadtest_main(rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
