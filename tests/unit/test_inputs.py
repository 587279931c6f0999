"""One input check for every front door: the engine and the Ray ingress refuse alike."""

from __future__ import annotations

from typing import Any

import pytest

from lenbatch.config import BatchingConfig
from lenbatch.core.errors import BadInput
from lenbatch.embed.engine import Engine
from lenbatch.embed.inputs import check_texts, token_ids
from lenbatch.runners.fake import FakeRunner
from lenbatch.scaleout.board import RoutingBoard
from lenbatch.scaleout.frontend import Frontend

BAD: list[tuple[Any, str]] = [
    ([], "no inputs given"),
    (["ok", ""], "input 1 is an empty string"),
    (["ok", "bad \udc80"], "input 1 is not valid Unicode"),
    (["ok", [1, 2]], "mix texts and token arrays"),
    ([[1, 2], "text"], "mix texts and token arrays"),
    ([[1], []], "input 1 is an empty token array"),
    ([[1], [10**9]], r"input 1 has token ids outside \[0, "),
    ([[-1]], r"input 0 has token ids outside \[0, "),
]


def _front_doors() -> list[Any]:
    runner = FakeRunner(max_length=64)
    engine = Engine(runner, BatchingConfig(boundaries=(16,)))
    front = Frontend(None, RoutingBoard(1), FakeRunner(max_length=64).tokenize, runner.info, [16])
    return [engine.inputs.token_ids, front.inputs.token_ids]


@pytest.mark.parametrize(("inputs", "message"), BAD)
def test_engine_and_ray_ingress_refuse_the_same_inputs(inputs: Any, message: str) -> None:
    for door in _front_doors():
        with pytest.raises(BadInput, match=message):
            door(inputs, False)


def test_good_inputs_give_the_same_ids_at_both_doors() -> None:
    engine_ids, front_ids = (door(["a b c", "d"], False) for door in _front_doors())
    assert engine_ids == front_ids and all(engine_ids)
    assert token_ids([[3, 4]], lambda texts: [], vocab_size=10) == [[3, 4]]


def test_errors_never_quote_the_text() -> None:
    secret = "my-password-1234 \udc80"
    with pytest.raises(BadInput) as err:
        check_texts(["fine", secret])
    assert "my-password" not in str(err.value)
