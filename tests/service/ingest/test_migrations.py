"""Alembic: up from empty, down to base and up again, on both databases; models and migrations agree."""

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient

from service.main import create_app
from service.migrate import DatabaseNotAtHead, downgrade, upgrade
from service.models import Base
from service.settings import Settings
from tests.conftest import BACKENDS


def table_names(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def schema_differences(url: str) -> list:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", BACKENDS)
def test_upgrade_downgrade_upgrade(new_database_url, backend):
    url = new_database_url(backend)
    upgrade(url)
    assert table_names(url) == set(Base.metadata.tables)
    assert schema_differences(url) == []
    downgrade(url)
    assert table_names(url) == set()
    upgrade(url)
    assert table_names(url) == set(Base.metadata.tables)
    assert schema_differences(url) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_service_refuses_a_database_not_at_head(new_database_url, backend, tmp_path):
    app = create_app(Settings(database_url=new_database_url(backend), data_dir=tmp_path))
    with pytest.raises(DatabaseNotAtHead, match="ett service migrate"):
        with TestClient(app):
            pass
