"""Alembic, driven from the app's settings: upgrade, and the at-head check done at start-up."""

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

# Alembic's scripts, read by Alembic and imported by no module of ours: they sit beside the
# service package, at the repository's root in a checkout and in site-packages where the wheel
# installs them (pyproject.toml), so one path finds them in both.
MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"


class DatabaseNotAtHead(RuntimeError):
    pass


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


def check_at_head(engine: Engine) -> None:
    heads = set(ScriptDirectory.from_config(alembic_config(str(engine.url))).get_heads())
    with engine.connect() as conn:
        current = set(MigrationContext.configure(conn).get_current_heads())
    if current != heads:
        raise DatabaseNotAtHead(
            f"the database is at revision {sorted(current) or 'none'}, not at {sorted(heads)}: "
            "run `ett service migrate` (or `alembic upgrade head`) first"
        )
