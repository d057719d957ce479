"""A job's steps over HTTP (GET /api/v1/jobs/{id}/steps): rank 0's steps a page at a time."""

from pydantic import BaseModel, Field


class StepOut(BaseModel):
    step: int
    attempt: int
    at: float = Field(description="when the step ended (unix seconds, the service's clock)")
    seconds: float | None = Field(description="its duration")
    loss: float | None = Field(description="null where the script sent none, or a NaN or infinite loss")
    tokens: int | None
    nodes: int | None = Field(description="how many nodes its attempt ran on")
    rolled_back: bool = Field(description="a later attempt went back to an older step: wasted (docs/ett.md)")


class StepAttemptOut(BaseModel):
    attempt: int
    nodes: list[str] = Field(description="the nodes it ran on, from its `attempt_allocated` event")
    full_nodes: int | None = Field(description="the job's full size: more than its nodes where it ran reduced")


class StepPageOut(BaseModel):
    job_id: str
    steps: list[StepOut] = Field(description="by step number, then attempt")
    attempts: list[StepAttemptOut]
    next_since_step: int | None = Field(description="pass it as `since_step` for what follows; null: nothing more")
