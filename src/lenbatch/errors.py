"""Errors a request can end with. Each says what was wrong and what the limit is, and never
contains request text. `status` is the HTTP status the server answers with."""

from __future__ import annotations

__all__ = [
    "BadInput",
    "DeadlineExceeded",
    "InputTooLong",
    "LenbatchError",
    "ModelFailed",
    "Overloaded",
    "Unavailable",
]


class LenbatchError(Exception):
    """Base of every error a client may see."""

    status = 500
    code = "internal_error"
    kind = "server_error"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class BadInput(LenbatchError):
    """The request is malformed (wrong type, empty, out-of-vocabulary ids, ...)."""

    status = 400
    code = "invalid_input"
    kind = "invalid_request_error"


class InputTooLong(LenbatchError):
    """An input is longer than the model, or any batch budget, can ever take."""

    status = 413
    code = "input_too_long"
    kind = "invalid_request_error"


class Overloaded(LenbatchError):
    """A queue or rate limit is full; try again after `retry_after` seconds."""

    status = 429
    code = "overloaded"
    kind = "rate_limit_error"


class Unavailable(LenbatchError):
    """The server is draining or its runner has failed."""

    status = 503
    code = "unavailable"
    kind = "server_error"


class DeadlineExceeded(LenbatchError):
    """The request's deadline passed before it could run."""

    status = 504
    code = "deadline_exceeded"
    kind = "timeout_error"


class ModelFailed(LenbatchError):
    """The model raised on this input."""

    status = 500
    code = "model_error"
    kind = "server_error"
