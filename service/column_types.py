"""Column types of our own: aware UTC datetimes, and a job's spec stored as JSON and read back typed."""

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, TypeDecorator

from service.spec.job_spec import JobSpec
from service.spec.notify import revealed


class UTCDateTime(TypeDecorator[datetime]):
    """Stores UTC and always hands back an aware datetime (SQLite forgets the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given; use UTC-aware datetimes")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class JobSpecJSON(TypeDecorator[JobSpec]):
    """A job's spec: stored as JSON, read back as the typed spec. The one place a spec is loaded,
    so the service never reads a spec as a dict."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: JobSpec | None, dialect: Any) -> dict[str, Any] | None:
        return None if value is None else revealed(value)  # the notify secret itself, not hidden

    def process_result_value(self, value: dict[str, Any] | None, dialect: Any) -> JobSpec | None:
        return None if value is None else JobSpec.model_validate(value)
