"""The one place a refusal becomes an HTTP answer: the domain's (service/outcomes.py) and a
request that does not validate. A 422 names each field as a path into the JSON that was sent."""

from fastapi import Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from service.outcomes import Refused, problem
from service.schemas import field_and_message


def field_path(loc: tuple | list) -> str:
    # ("body", "events", 3, "ts") -> "events.3.ts": the path a person finds in the JSON they sent.
    parts = [str(p) for p in loc]
    return ".".join(parts[1:] if parts and parts[0] in ("body", "query", "path") else parts) or "body"


class FieldProblem(BaseModel):
    field: str
    msg: str
    type: str


class ValidationProblem(BaseModel):
    """The 422 answer, declared in the OpenAPI schema in place of FastAPI's default shape."""

    detail: list[FieldProblem]


async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [problem(*field_and_message(field_path(e["loc"]), e["msg"]), e["type"]) for e in exc.errors()]
    # The input is not echoed back: it may hold secrets (env values of a job spec).
    return JSONResponse({"detail": errors}, status.HTTP_422_UNPROCESSABLE_CONTENT)


def refused_answer(refused: Refused) -> JSONResponse:
    return JSONResponse({"detail": refused.detail}, refused.status_code, headers=refused.headers)


async def refused_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Refused)
    return refused_answer(exc)
