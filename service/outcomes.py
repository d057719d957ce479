"""How the domain says no: one exception per kind of refusal, raised (or returned, by the group
writers, whose requests each get their own answer) by domain code that knows nothing of HTTP.
One place, service/asgi/errors.py, turns each into its HTTP answer.
"""

from typing import Any


def problem(field: str, msg: str, kind: str = "value_error") -> dict[str, str]:
    """One entry of a 422's `detail`: the field as a path into the JSON that was sent."""
    return {"field": field, "msg": msg, "type": kind}


class Refused(Exception):
    """A request the service turns down; `status_code` is its HTTP answer's."""

    status_code = 400
    headers: dict[str, str] | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def detail(self) -> Any:
        return self.message


class Unauthorized(Refused):
    status_code = 401
    headers = {"WWW-Authenticate": "Bearer"}


class Forbidden(Refused):
    status_code = 403


class NotFound(Refused):
    status_code = 404


class Unprocessable(Refused):
    """A field of the request that cannot be accepted: the answer names it."""

    status_code = 422

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    @property
    def detail(self) -> Any:
        return [problem(self.field, self.message)]
