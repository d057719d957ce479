"""What every model shares: the declarative base with its naming convention and column types."""

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Enum, MetaData
from sqlalchemy.orm import DeclarativeBase

from service.column_types import JobSpecJSON, UTCDateTime
from service.spec.job_spec import JobSpec

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def utc_at(ts: float) -> datetime:
    """A time.time() value as the columns hold it."""
    return datetime.fromtimestamp(ts, UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, datetime: UTCDateTime, JobSpec: JobSpecJSON}


def enum_column(cls: type[enum.Enum]) -> Enum:
    # Stored as plain strings: adding a state needs no ALTER TYPE on PostgreSQL.
    return Enum(cls, native_enum=False, length=16, validate_strings=True)
