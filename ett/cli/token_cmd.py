"""`ett token create`: mint a bearer token, written straight into the service's database."""

import argparse
import sys

from ett.cli.service_cmd import load_settings


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("token", help="manage API tokens")
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a token and print it once")
    create.add_argument("--role", required=True, choices=["admin", "user", "agent"])
    create.add_argument("--subject", default=None, help="who it is for (jobs are owned by it); default: the role")
    create.set_defaults(run=run_create)


def run_create(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import OperationalError

    from service.db import make_engine, make_session_factory
    from service.migrate import DatabaseNotAtHead, check_at_head
    from service.models import Role
    from service.security import create_token

    settings = load_settings()
    engine = make_engine(settings.resolved_database_url)
    try:
        check_at_head(engine)
    except (DatabaseNotAtHead, OperationalError) as exc:
        # Most often: run from another folder than the service's, whose default ./data differs.
        reason = exc if isinstance(exc, DatabaseNotAtHead) else exc.orig
        print(f"ett: database {settings.resolved_database_url} (ETT_DATABASE_URL, or ETT_DATA_DIR={settings.data_dir} "
              f"from this folder): {reason}; point it at the service's database", file=sys.stderr)
        return 2
    with make_session_factory(engine)() as session:
        secret = create_token(session, Role(args.role), args.subject or args.role)
        session.commit()
    print(secret)
    return 0
