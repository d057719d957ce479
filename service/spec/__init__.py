"""The job spec's types: what a user submits and what the models store (column_types.py reads a
job's row back as a JobSpec). They sit below the models, in the storage layer, so that storing a
spec imports nothing from the API's schemas above (tests/test_layers.py); service/schemas builds
its request and response models on them."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base of every request body, the spec's included: unknown fields and coerced types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)
