"""Pydantic request and response models (requests reject unknown fields)."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base of every request body: unknown fields and coerced types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)
