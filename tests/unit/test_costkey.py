"""The cost-model interface (lenbatch.core.costkey): keys, their differences, the book."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lenbatch.core.costfit import CostCoefficients, OnlineCostModel
from lenbatch.core.costkey import (
    BatchCost,
    CostBook,
    CostKey,
    LearningBatchCost,
    MissingCostModel,
    ProcessorKey,
    WorkKind,
    processor_difference,
)
from lenbatch.plan.costmodel import CostModel

ZEN4 = ProcessorKey(
    "cpu",
    "AMD EPYC 9654 96-Core Processor",
    "AuthenticAMD",
    25,
    17,
    ("avx2", "avx512_bf16", "avx512_vnni", "avx512f"),
    2,
)
KEY = CostKey("minilm", WorkKind.ENCODER_BATCH, str(ZEN4), "bfloat16")
LEGACY = "cpu:AMD EPYC family 25 x2"


def test_a_key_equal_in_every_part_describes_the_work() -> None:
    """Same model, work, processor, threads, dtype and quantization: no difference."""
    assert KEY.difference(dataclasses.replace(KEY)) is None
    assert KEY.threads == 2 and KEY.processor_key == ZEN4


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"processor": str(dataclasses.replace(ZEN4, model=1))}, "model number 17 vs 1"),
        ({"processor": str(dataclasses.replace(ZEN4, isa=("avx2",)))}, "ISA flags"),
        ({"processor": str(dataclasses.replace(ZEN4, threads=1))}, "threads 2 vs 1"),
        ({"processor": str(dataclasses.replace(ZEN4, family=26))}, "family 25 vs 26"),
        ({"dtype": "float32"}, "dtype 'bfloat16' vs 'float32'"),
        ({"quantization": "int8"}, "quantization 'none' vs 'int8'"),
        ({"work": WorkKind.DECODE_STEP}, "work 'encoder_batch' vs 'decode_step'"),
        ({"model": "other"}, "model 'minilm' vs 'other'"),
    ],
)
def test_keys_differing_in_one_part_say_which(change: dict[str, object], expected: str) -> None:
    """Each part of the key, changed alone, makes the keys differ and is named."""
    why = KEY.difference(dataclasses.replace(KEY, **change))  # type: ignore[arg-type]
    assert why is not None and expected in why


@pytest.mark.parametrize("processor", [LEGACY, ""])
def test_an_older_or_missing_processor_key_never_matches(processor: str) -> None:
    """A key without model number (every committed cost file's) matches nothing, not even an
    identical key; the reason says why."""
    old = dataclasses.replace(KEY, processor=processor)
    why = old.difference(dataclasses.replace(old))
    assert why is not None and "processor" in why
    assert processor_difference(processor, str(ZEN4)) is not None
    assert old.threads is None and old.processor_key is None


def test_older_key_reason_names_the_confusion() -> None:
    """The reason for an older key says it lacks the model number and ISA flags."""
    why = processor_difference(LEGACY, str(ZEN4))
    assert why is not None and "model number" in why and "never matches" in why


def test_file_names_are_stable_safe_and_distinct() -> None:
    """A key's file name is the same on every call, uses only safe characters, and two
    keys differing in any part (even one the readable part drops) get different names."""
    name = KEY.file_name()
    assert name == CostKey(**dataclasses.asdict(KEY)).file_name()
    assert re.fullmatch(r"[a-z0-9._-]+\.json", name)
    assert name.startswith("minilm__encoder_batch__bfloat16__none__authenticamd-f25-m17-x2__")
    renamed = dataclasses.replace(ZEN4, name="AMD EPYC 9654 (other SKU)")
    others = [
        dataclasses.replace(KEY, processor=str(renamed)),
        dataclasses.replace(KEY, quantization="int8"),
        dataclasses.replace(KEY, processor=LEGACY),
    ]
    assert len({name, *(k.file_name() for k in others)}) == 4


def test_the_cost_models_of_core_and_plan_keep_the_protocols() -> None:
    """The online model learns; coefficients and a profile's cost model only predict, and
    all three give the same seconds for the same coefficients."""
    online: LearningBatchCost = OnlineCostModel(CostCoefficients(0.01, 1e-4))
    assert isinstance(online, LearningBatchCost)
    fixed: list[BatchCost] = [CostCoefficients(0.01, 1e-4), CostModel(0.01, per_token=1e-4)]
    for cost in fixed:
        assert isinstance(cost, BatchCost) and not isinstance(cost, LearningBatchCost)
        assert cost.seconds(4, 32) == pytest.approx(online.seconds(4, 32))


def test_a_profile_says_its_key() -> None:
    """`CostModel.cost_key` carries the parts the file records (served name overridable);
    an old file's defaults are an unquantized encoder batch."""
    cost = CostModel(0.01, model="all-MiniLM-L6-v2", processor=str(ZEN4), dtype="bfloat16")
    key = cost.cost_key("minilm")
    assert key == KEY
    assert cost.cost_key().model == "all-MiniLM-L6-v2"
    assert CostModel.from_json({"const": 0.01}).cost_key().work is WorkKind.ENCODER_BATCH


def test_the_book_finds_what_it_holds_and_names_what_is_missing() -> None:
    """`get` returns the model put under (served model, work); a missing one is a KeyError
    naming the model, the work and what the book holds."""
    book = CostBook()
    online = OnlineCostModel()
    book.put("minilm", WorkKind.ENCODER_BATCH, online, KEY)
    book.put("smollm2", WorkKind.DECODE_STEP, CostCoefficients(0.02, 1e-5))
    assert book.get("minilm", WorkKind.ENCODER_BATCH) is online
    assert book.learner("minilm", WorkKind.ENCODER_BATCH) is online
    assert book.key("minilm", WorkKind.ENCODER_BATCH) == KEY
    assert book.key("smollm2", WorkKind.DECODE_STEP) is None
    assert list(book) == [("minilm", WorkKind.ENCODER_BATCH), ("smollm2", WorkKind.DECODE_STEP)]
    assert ("minilm", WorkKind.ENCODER_BATCH) in book and len(book) == 2
    with pytest.raises(KeyError) as missing:
        book.get("smollm2", WorkKind.PREFILL_CHUNK)
    assert isinstance(missing.value, MissingCostModel)
    msg = str(missing.value)
    assert "'smollm2' doing prefill_chunk" in msg and "'minilm' encoder_batch" in msg


def test_the_book_refuses_what_does_not_fit() -> None:
    """A fixed model asked to learn, a key for another place, and an object without
    `seconds` are refused."""
    book = CostBook()
    book.put("smollm2", WorkKind.DECODE_STEP, CostCoefficients(0.02, 1e-5))
    with pytest.raises(TypeError, match="does not observe"):
        book.learner("smollm2", WorkKind.DECODE_STEP)
    with pytest.raises(ValueError, match="disagree"):
        book.put("other", WorkKind.ENCODER_BATCH, OnlineCostModel(), KEY)
    with pytest.raises(TypeError, match="seconds"):
        book.put("minilm", WorkKind.ENCODER_BATCH, object())  # type: ignore[arg-type]
