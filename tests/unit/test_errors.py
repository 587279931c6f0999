"""The errors a request can end with: each class's HTTP status, code and kind."""

from __future__ import annotations

import pytest

from lenbatch.core.errors import (
    BadInput,
    DeadlineExceeded,
    InputTooLong,
    LenbatchError,
    ModelFailed,
    ModelNotFound,
    OutOfMemory,
    Overloaded,
    Unavailable,
)


@pytest.mark.parametrize(
    ("cls", "status", "code", "kind"),
    [
        (LenbatchError, 500, "internal_error", "server_error"),
        (BadInput, 400, "invalid_input", "invalid_request_error"),
        (ModelNotFound, 404, "model_not_found", "invalid_request_error"),
        (InputTooLong, 413, "input_too_long", "invalid_request_error"),
        (Overloaded, 429, "overloaded", "rate_limit_error"),
        (Unavailable, 503, "unavailable", "server_error"),
        (OutOfMemory, 503, "out_of_memory", "server_error"),
        (DeadlineExceeded, 504, "deadline_exceeded", "timeout_error"),
        (ModelFailed, 500, "model_error", "server_error"),
    ],
)
def test_each_error_answers_with_its_status_code_and_kind(
    cls: type[LenbatchError], status: int, code: str, kind: str
) -> None:
    """A raised error carries its class's status, code and kind, and its message."""
    err = cls("what was wrong", retry_after=2.0)
    assert (err.status, err.code, err.kind) == (status, code, kind)
    assert err.message == str(err) == "what was wrong" and err.retry_after == 2.0


def test_an_instance_code_overrides_only_that_instance() -> None:
    """`code=` names a finer reason for one error; the class keeps its own."""
    assert Overloaded("full", code="queue_full").code == "queue_full"
    assert Overloaded("full").code == "overloaded"


def test_a_subclass_without_a_header_inherits_its_base() -> None:
    """A subclass that states nothing answers as its base does."""

    class Relayed(Unavailable):
        pass

    assert (Relayed.status, Relayed.code, Relayed.kind) == (503, "unavailable", "server_error")
