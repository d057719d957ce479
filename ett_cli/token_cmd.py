"""`ett token create|list|revoke`: the service's bearer tokens, straight in its database (run
where the service's settings are: its ETT_DATABASE_URL or its ./data)."""

import argparse
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from ett_cli.service_cmd import load_settings

DURATION = re.compile(r"^(\d+)([mhd])$")
UNITS = {"m": "minutes", "h": "hours", "d": "days"}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("token", help="manage API tokens")
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a token and print it once")
    create.add_argument("--role", required=True, choices=["admin", "user", "agent"])
    create.add_argument("--subject", default=None, help="who it is for (jobs are owned by it); default: the role")
    create.add_argument("--expires-in", type=duration, default=None, metavar="N{m,h,d}",
                        help="refused after this long, e.g. 12h or 30d (default: never)")
    create.set_defaults(run=run_create)
    listing = actions.add_parser("list", help="list tokens (never their secrets)")
    listing.set_defaults(run=run_list)
    revoke = actions.add_parser("revoke", help="revoke tokens by id (`ett token list`): refused from then on")
    revoke.add_argument("ids", type=int, nargs="+", metavar="ID")
    revoke.set_defaults(run=run_revoke)


def duration(text: str) -> timedelta:
    match = DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90m, 12h or 30d")
    return timedelta(**{UNITS[match[2]]: int(match[1])})


@contextmanager
def _database() -> Iterator[Any]:
    """A session on the service's database, or a one-line error naming the settings."""
    from sqlalchemy.exc import OperationalError

    from service.db import make_engine, make_session_factory
    from service.migrate import DatabaseNotAtHead, check_at_head

    settings = load_settings()
    engine = make_engine(settings.resolved_database_url)
    try:
        check_at_head(engine)
    except (DatabaseNotAtHead, OperationalError) as exc:
        # Most often: run from another folder than the service's, whose default ./data differs.
        reason = exc if isinstance(exc, DatabaseNotAtHead) else exc.orig
        print(f"ett: database {settings.resolved_database_url} (ETT_DATABASE_URL, or ETT_DATA_DIR="
              f"{settings.data_dir} from this folder): {reason}; point it at the service's database", file=sys.stderr)
        raise SystemExit(2) from None
    with make_session_factory(engine)() as session:
        yield session
    engine.dispose()


def run_create(args: argparse.Namespace) -> int:
    from service.models import Role
    from service.security import create_token

    expires_at = datetime.now(UTC) + args.expires_in if args.expires_in else None
    with _database() as session:
        secret = create_token(session, Role(args.role), args.subject or args.role, expires_at)
        session.commit()
    print(secret)
    return 0


def _when(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M") if at else "never"


def run_list(args: argparse.Namespace) -> int:
    from service.security import all_tokens, expired

    with _database() as session:
        tokens = all_tokens(session)
    print(f"{'ID':>5}  {'ROLE':6}  {'SUBJECT':24}  {'CREATED (UTC)':16}  {'EXPIRES (UTC)':16}  STATE")
    for token in tokens:
        state = "revoked" if token.revoked else "expired" if expired(token.expires_at) else "valid"
        print(f"{token.id:>5}  {token.role.value:6}  {token.subject[:24]:24}  {_when(token.created_at):16}  "
              f"{_when(token.expires_at):16}  {state}")
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    from service.security import revoke_tokens

    with _database() as session:
        unknown = revoke_tokens(session, args.ids)
        session.commit()
    revoked = [i for i in args.ids if i not in unknown]
    if revoked:
        print(f"revoked {', '.join(map(str, revoked))}")
    if unknown:
        print(f"ett: no token with id {', '.join(map(str, unknown))} (see `ett token list`)", file=sys.stderr)
        return 2
    return 0
