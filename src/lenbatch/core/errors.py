"""Errors a request can end with, and the runner-side signals that lead to them.

Each `LenbatchError` says what was wrong and what the limit is, and never contains request text;
`status` is the HTTP status the server answers with and `code` the machine-readable reason
(a few limits override it per instance, e.g. `queue_full` vs `rate_limited`, both 429).

`RunnerCrashed` is not an answer: a runner raises it to say it is unusable, and the engine then
reports itself not ready and fails every waiting request with `Unavailable`.
"""

from __future__ import annotations

__all__ = [
    "BadInput",
    "DeadlineExceeded",
    "InputTooLong",
    "LenbatchError",
    "ModelFailed",
    "ModelNotFound",
    "OutOfMemory",
    "Overloaded",
    "ResponseNotFound",
    "RunnerCrashed",
    "Unavailable",
    "drain_timed_out",
    "draining",
    "is_out_of_memory",
]


class LenbatchError(Exception):
    """Base of every error a client may see."""

    status = 500
    code = "internal_error"
    kind = "server_error"

    def __init__(
        self, message: str, *, retry_after: float | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        if code is not None:
            self.code = code

    def __init_subclass__(
        cls, *, status: int | None = None, code: str | None = None, kind: str | None = None
    ) -> None:
        # A subclass states its answer in its header: `class X(LenbatchError, status=400, ...)`.
        super().__init_subclass__()
        if status is not None:
            cls.status = status
        if code is not None:
            cls.code = code
        if kind is not None:
            cls.kind = kind


class BadInput(LenbatchError, status=400, code="invalid_input", kind="invalid_request_error"):
    """The request is malformed (wrong type, empty, out-of-vocabulary ids, ...)."""


class ModelNotFound(
    LenbatchError, status=404, code="model_not_found", kind="invalid_request_error"
):
    """The request names a model this server does not serve."""


class ResponseNotFound(
    LenbatchError, status=404, code="response_not_found", kind="invalid_request_error"
):
    """No stored response has the id a request names (`/v1/responses`)."""


class InputTooLong(LenbatchError, status=413, code="input_too_long", kind="invalid_request_error"):
    """An input (or a call) is larger than the model, or any budget, can ever take."""


class Overloaded(LenbatchError, status=429, code="overloaded", kind="rate_limit_error"):
    """A queue or rate limit is full; try again after `retry_after` seconds."""


class Unavailable(LenbatchError, status=503, code="unavailable", kind="server_error"):
    """The server is draining or its runner has failed."""


def draining() -> Unavailable:
    """The answer to a request that arrives while the server drains (both engines)."""
    return Unavailable(
        "server is shutting down (draining); not accepting new requests",
        retry_after=1.0,
        code="shutting_down",
    )


def drain_timed_out(timeout: float | None) -> Unavailable:
    """The answer to an admitted request still unfinished when the drain timeout passes."""
    return Unavailable(
        f"the server shut down before this request finished (drain timeout {timeout} s)",
        code="shutdown",
    )


class OutOfMemory(LenbatchError, status=503, code="out_of_memory", kind="server_error"):
    """The model ran out of memory even on this input alone; memory may free up later."""


class DeadlineExceeded(LenbatchError, status=504, code="deadline_exceeded", kind="timeout_error"):
    """The request's deadline passed before it could run."""


class ModelFailed(LenbatchError, status=500, code="model_error", kind="server_error"):
    """The model raised on this input."""


class RunnerCrashed(Exception):
    """Raised by a runner to say it is unusable (device lost, worker dead): the engine stops
    using it, reports not-ready, and answers every waiting request with an error."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for Python's `MemoryError` and torch's out-of-memory errors.

    Matched by class name so the engine does not import torch: `torch.cuda.OutOfMemoryError`
    (an alias of `torch.OutOfMemoryError`) and, for older builds, a RuntimeError whose message
    starts with "CUDA out of memory".
    """
    if isinstance(exc, MemoryError):
        return True
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith("CUDA out of memory")
