"""`ett`: one entry point, one module per group of subcommands."""

import argparse
import os
import sys

from agent import cli as agent_cmd
from ett_cli import client_cmd, demo_cmd, kubernetes_cmd, service_cmd, simulate_cmd, token_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ett", description="Effective Training Time: run and measure training jobs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (service_cmd, agent_cmd, token_cmd, client_cmd, demo_cmd, simulate_cmd, kubernetes_cmd):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # `ett jobs | head`: the reader has what it wanted. Nothing more to say, and nothing for
        # Python's flush at exit to fail on either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # as a command killed by SIGPIPE, the shell's convention


if __name__ == "__main__":
    sys.exit(main())
