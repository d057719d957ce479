"""`ett service`: run the API server, or migrate its database."""

import argparse
import sys

from pydantic import ValidationError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("service", help="run the ETT service (see `ett service migrate`)")
    parser.add_argument("action", nargs="?", choices=["run", "migrate"], default="run")
    parser.add_argument("--host", help="listen address (ETT_HOST)")
    parser.add_argument("--port", type=int, help="listen port (ETT_PORT)")
    parser.add_argument("--workers", type=int, default=1, help="API processes (PostgreSQL only for more than 1)")
    parser.set_defaults(run=run)


def load_settings(**overrides: object):
    from service.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for error in exc.errors():
            name = "ETT_" + "_".join(str(p) for p in error["loc"]).upper()
            print(f"ett: bad setting {name}: {error['msg']}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> int:
    from service.db import make_engine
    from service.migrate import DatabaseNotAtHead, check_at_head, upgrade

    settings = load_settings(host=args.host, port=args.port)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if args.action == "migrate":
        upgrade(settings.resolved_database_url)
        print("ett: database at head")
        return 0
    try:
        check_at_head(make_engine(settings.resolved_database_url))
    except DatabaseNotAtHead as exc:
        print(f"ett: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    if args.workers > 1 and settings.resolved_database_url.startswith("sqlite"):
        print("ett: several workers need PostgreSQL (ETT_DATABASE_URL); SQLite has one writer", file=sys.stderr)
        return 2
    from service.main import KEEP_ALIVE_SECONDS

    uvicorn.run("service.main:create_app", factory=True, host=settings.host, port=settings.port,
                workers=args.workers, log_level="info", timeout_keep_alive=KEEP_ALIVE_SECONDS)
    return 0
