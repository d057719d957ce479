"""`ett agent`: the node daemon's command line; each flag overrides its ETT_AGENT_* setting."""

import argparse
import logging
import signal
import sys

from pydantic import ValidationError

FLAGS = {  # flag -> AgentSettings field
    "--service": "service_url", "--token-file": "token_file", "--name": "name", "--slots": "slots",
    "--address": "address", "--data-dir": "data_dir", "--metrics-port": "metrics_port",
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--service", help="service URL (ETT_AGENT_SERVICE_URL)")
    parser.add_argument("--token-file", help="a file holding the agent token (ETT_AGENT_TOKEN_FILE; or set "
                        "ETT_AGENT_TOKEN): never the token itself, which `ps` would show")
    parser.add_argument("--name", help="node name, unique in the fleet (ETT_AGENT_NAME; default: host name)")
    parser.add_argument("--slots", type=int, help="processes this node can run (ETT_AGENT_SLOTS)")
    parser.add_argument("--address", help="address other nodes reach this one on (ETT_AGENT_ADDRESS)")
    parser.add_argument("--data-dir", help="spools, read positions, dead letters (ETT_AGENT_DATA_DIR)")
    parser.add_argument("--metrics-port", type=int, help="serve /metrics on this port; 0: off (ETT_AGENT_METRICS_PORT)")


def register(sub: argparse._SubParsersAction) -> None:
    """Adds `ett agent` to the `ett` command (ett_cli/main.py)."""
    # No abbreviations: `--token` must not pass for `--token-file`.
    parser = sub.add_parser("agent", help="run the node agent (one per machine)", allow_abbrev=False)
    add_arguments(parser)
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from agent.daemon import Agent
    from agent.settings import AgentSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat drowns the rest
    overrides = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field in FLAGS.items()}
    try:
        settings = AgentSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for error in exc.errors():
            if error["loc"]:
                name = "ETT_AGENT_" + "_".join(str(p) for p in error["loc"]).upper()
                print(f"ett agent: bad setting {name}: {error['msg']}", file=sys.stderr)
            else:  # a check across settings: its message names them
                print(f"ett agent: {error['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    from agent.confinement.job_user import JobUserError

    try:
        agent = Agent(settings)
    except JobUserError as exc:
        print(f"ett agent: {exc}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: agent.terminate())
    agent.run()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m agent.cli", allow_abbrev=False)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
