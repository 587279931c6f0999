"""The error shape every lenbatch HTTP answer uses, apart from the app (`serving/http.py`) so
that the app, its hot routes (`serving/hotroute.py`) and the several-model router answer alike.

Errors use OpenAI's shape, `{"error": {"message", "type", "code", "param"}}`, are 4xx for
anything the client sent wrong, and never echo request content. `BodyTooLarge` is what the
app's guard raises from `receive` once a streamed body passes the limit: the hot routes and the
FastAPI app both answer it 413.
"""

from __future__ import annotations

import numpy as np
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lenbatch.core.errors import LenbatchError

__all__ = ["BodyTooLarge", "error_json", "error_response"]


def error_json(
    status: int, message: str, kind: str, code: str, retry_after: float | None = None
) -> JSONResponse:
    """A response in the error shape: `status`, and `Retry-After` in whole seconds (at
    least 1) when `retry_after` is given."""
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(np.ceil(retry_after))))
    body = {"error": {"message": message, "type": kind, "code": code, "param": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(err: LenbatchError) -> JSONResponse:
    """The HTTP response for a lenbatch error."""
    return error_json(err.status, err.message, err.kind, err.code, err.retry_after)


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` when a streamed body passes the limit; answered 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")
