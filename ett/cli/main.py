"""`ett`: one entry point, one module per group of subcommands."""

import argparse
import sys

from agent import cli as agent_cmd
from ett.cli import client_cmd, demo_cmd, service_cmd, simulate_cmd, token_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ett", description="Effective Training Time: run and measure training jobs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (service_cmd, agent_cmd, token_cmd, client_cmd, demo_cmd, simulate_cmd):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
