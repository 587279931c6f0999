"""What a cost model is a model of, and the cost models a server holds.

A measured cost (seconds per batch of a given shape) holds only for the work, model, processor,
thread count, float type and quantization it was measured with. `CostKey` names all of them;
`CostKey.difference` says why a cost model measured under one key does not describe another.
`ProcessorKey` is the processor part: vendor, family, **model number** and the ISA flags the
kernels use (a Zen 3 and a Zen 4 share a family but not a model number or AVX-512), plus the
torch thread count. `runners.hardware.processor_key()` builds it for the machine at hand;
its string form is what cost files store in `processor`.

`CostBook` holds one cost model per (served model, `WorkKind`), each behind the narrow protocol
its users need: `BatchCost.seconds(batch, padded_len)` for the schedulers and the simulator,
plus `LearningBatchCost.observe(...)` for a model the engine refits from its own batches.
`core.costfit.OnlineCostModel` (learning), `core.costfit.CostCoefficients` and
`plan.costmodel.CostModel` satisfy them as they are.

Pure: strings and numbers only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

__all__ = [
    "BatchCost",
    "CostBook",
    "CostKey",
    "LearningBatchCost",
    "MissingCostModel",
    "ProcessorKey",
    "WorkKind",
    "processor_difference",
]


class WorkKind(StrEnum):
    """A kind of work with a cost model of its own. `batch` and `padded_len` of
    `BatchCost.seconds` mean, for each:"""

    # rows x padded length of one encoder forward pass (embeddings; a scorer or classifier
    # runs encoder batches too)
    ENCODER_BATCH = "encoder_batch"
    # rows x padded chunk length of one causal-LM prefill pass (prompt tokens into the cache)
    PREFILL_CHUNK = "prefill_chunk"
    # rows decoding one token x the cache width they attend over
    DECODE_STEP = "decode_step"


# `cpu:NAME [VENDOR family F model M; FLAGS] xT`; F and M are `?` where the OS did not say,
# FLAGS `-` where none of the listed ones is present, ` xT` absent where threads do not apply.
_KEY = re.compile(
    r"^(?P<device>[a-z]+):(?P<name>.*) \[(?P<vendor>\S+) family (?P<family>\d+|\?) "
    r"model (?P<model>\d+|\?); (?P<isa>[^\]]*)\](?: x(?P<threads>\d+))?$"
)


@dataclass(frozen=True, slots=True)
class ProcessorKey:
    """The processor a cost was measured on, as far as it changes the cost.

    Two keys describe the same processor when `differences` is empty. A key without a model
    number (`model is None`: the OS did not say) is never the same as any other, itself
    included: it cannot tell the CPUs of one family apart.
    """

    device: str  # "cpu", or "cuda" for a GPU
    name: str  # the model name the OS or driver reports (the SKU: clocks, caches)
    vendor: str  # cpuinfo's vendor_id (AuthenticAMD, GenuineIntel), or the GPU maker
    family: int | None  # cpuinfo's `cpu family`; a GPU's compute capability major
    model: int | None  # cpuinfo's `model` number; a GPU's compute capability minor
    isa: tuple[str, ...] = ()  # the listed ISA flags present, sorted
    threads: int | None = None  # torch intra-op threads a run used (None: not applicable)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z]+", self.device):
            raise ValueError(f"processor key: device {self.device!r} must be lowercase letters")
        if not self.vendor or re.search(r"[\s\[\]]", self.vendor):
            raise ValueError(f"processor key: vendor {self.vendor!r} must be one word")
        if any(not re.fullmatch(r"[a-z0-9_]+", f) for f in self.isa):
            raise ValueError(f"processor key: ISA flags {self.isa!r} must be cpuinfo flag names")
        if tuple(sorted(set(self.isa))) != self.isa:
            raise ValueError(f"processor key: ISA flags {self.isa!r} must be sorted and unique")

    def __str__(self) -> str:
        fam = "?" if self.family is None else str(self.family)
        mod = "?" if self.model is None else str(self.model)
        flags = " ".join(self.isa) or "-"
        where = f"[{self.vendor} family {fam} model {mod}; {flags}]"
        threads = "" if self.threads is None else f" x{self.threads}"
        return f"{self.device}:{self.name} {where}{threads}"

    @classmethod
    def parse(cls, text: str) -> ProcessorKey | None:
        """The key `str(key)` wrote, or None for any other text (an older key without model
        number and flags, such as `cpu:AMD EPYC family 25 x2`, or none at all)."""
        found = _KEY.match(text)
        if found is None:
            return None
        isa = found["isa"]
        return cls(
            device=found["device"],
            name=found["name"],
            vendor=found["vendor"],
            family=None if found["family"] == "?" else int(found["family"]),
            model=None if found["model"] == "?" else int(found["model"]),
            isa=() if isa == "-" else tuple(isa.split()),
            threads=None if found["threads"] is None else int(found["threads"]),
        )

    def differences(self, other: ProcessorKey) -> tuple[str, ...]:
        """What differs between this key and `other`, each as `this vs other`; empty when
        they describe the same processor. A key without a model number always differs."""
        out: list[str] = []
        if self.model is None or other.model is None:
            out.append("model number not reported, so CPUs of one family cannot be told apart")
        pairs: tuple[tuple[str, object, object], ...] = (
            ("device", self.device, other.device),
            ("vendor", self.vendor, other.vendor),
            ("family", self.family, other.family),
            ("model number", self.model, other.model),
            ("model name", self.name, other.name),
        )
        out += [f"{what} {a!r} vs {b!r}" for what, a, b in pairs if a != b]
        if self.isa != other.isa:
            out.append(f"ISA flags {' '.join(self.isa) or '-'} vs {' '.join(other.isa) or '-'}")
        if self.threads != other.threads:
            out.append(f"threads {self.threads} vs {other.threads}")
        return tuple(out)


def processor_difference(measured: str, here: str) -> str | None:
    """Why a cost measured on processor `measured` does not hold on `here` (both the string
    form of a `ProcessorKey`), or None when it does. Empty or older keys never hold."""
    if not measured:
        return "no processor recorded (it predates processor keys)"
    old, new = ProcessorKey.parse(measured), ProcessorKey.parse(here)
    if old is None:
        return (
            f"{measured!r} is an older processor key without the CPU's model number and ISA "
            "flags: it cannot tell CPUs of one family apart (a Zen 3 from a Zen 4), so it "
            "never matches"
        )
    if new is None:
        return f"{here!r} is not a processor key of the current form"
    diffs = old.differences(new)
    return "; ".join(diffs) if diffs else None


@dataclass(frozen=True, slots=True)
class CostKey:
    """What one cost model describes: which served model doing which work, on which processor
    (with how many threads), in which float type and quantization."""

    model: str  # the served model name
    work: WorkKind
    processor: str  # the string form of a `ProcessorKey` (older files: another text, or "")
    dtype: str  # float32, bfloat16, float16 ("" where not recorded)
    quantization: str = "none"  # none, int8, int4

    @property
    def processor_key(self) -> ProcessorKey | None:
        """The structured processor key (None for an older or missing one)."""
        return ProcessorKey.parse(self.processor)

    @property
    def threads(self) -> int | None:
        """The torch thread count the cost was measured with (None where not known)."""
        key = self.processor_key
        return None if key is None else key.threads

    def __str__(self) -> str:
        return (
            f"{self.model} {self.work.value} {self.dtype or '?'} "
            f"quantization={self.quantization} on {self.processor or '?'}"
        )

    def file_name(self) -> str:
        """A stable file name for a cost model under this key (a cache folder holds one per
        key): readable parts, then a hash of the whole key so that no two keys share one."""
        proc = self.processor_key
        where = (
            f"{proc.vendor}-f{proc.family}-m{proc.model}-x{proc.threads}"
            if proc is not None
            else "unknown-processor"
        )
        parts = (self.model, self.work.value, self.dtype or "dtype-unknown", self.quantization)
        readable = "__".join(_slug(p) for p in (*parts, where))
        digest = hashlib.sha256(str(self).encode("utf-8")).hexdigest()[:10]
        return f"{readable}__{digest}.json"

    def difference(self, other: CostKey) -> str | None:
        """Why a cost model keyed `self` does not describe work keyed `other` (`this vs
        other` for each part that differs), or None when it does. A key with an older or
        missing processor key never describes anything."""
        out = [
            f"{what} {a!r} vs {b!r}"
            for what, a, b in (
                ("model", self.model, other.model),
                ("work", self.work.value, other.work.value),
                ("dtype", self.dtype, other.dtype),
                ("quantization", self.quantization, other.quantization),
            )
            if a != b
        ]
        proc = processor_difference(self.processor, other.processor)
        if proc is not None:
            out.append(f"processor: {proc}")
        return "; ".join(out) or None


def _slug(text: str) -> str:
    """`text` with every run of characters outside [A-Za-z0-9._] turned into one `-`."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-").lower() or "unnamed"


@runtime_checkable
class BatchCost(Protocol):
    """Predicted seconds of one batch: what the schedulers and the simulator read."""

    def seconds(self, batch: float, padded_len: float) -> float:
        """Seconds to run `batch` rows of `padded_len` tokens (see `WorkKind` for what the
        two mean for each kind of work); fractional values give the mean over batches."""
        ...


@runtime_checkable
class LearningBatchCost(BatchCost, Protocol):
    """A `BatchCost` the engine refits from the batches it runs."""

    def observe(self, batch: int, padded_len: int, seconds: float) -> None:
        """Record one batch's measured execution time."""
        ...


class MissingCostModel(KeyError):
    """A `CostBook` has no cost model for a (served model, work kind)."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; this one is a sentence.
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, slots=True)
class _Entry:
    cost: BatchCost
    key: CostKey | None


class CostBook:
    """The cost models a server holds: one per (served model, work kind).

    `put` adds or replaces one (with the `CostKey` it was measured under, where known), `get`
    finds one or raises `MissingCostModel` naming what is missing and what the book holds,
    `learner` does the same for a model the engine refits from its own batches.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[tuple[str, WorkKind], _Entry] = {}

    def put(self, model: str, work: WorkKind, cost: BatchCost, key: CostKey | None = None) -> None:
        """Hold `cost` as the cost model of `model` doing `work` (replacing any before).
        Raises ValueError when `key` names another model or work."""
        if not isinstance(cost, BatchCost):
            raise TypeError(f"cost model for {model!r} {work.value} has no seconds(batch, len)")
        if key is not None and (key.model, key.work) != (model, work):
            raise ValueError(
                f"cost model keyed {key.model!r} {key.work.value} put under {model!r} "
                f"{work.value}: the key and the place disagree"
            )
        self._entries[(model, work)] = _Entry(cost, key)

    def get(self, model: str, work: WorkKind) -> BatchCost:
        """The cost model of `model` doing `work`; raises MissingCostModel when there is none."""
        entry = self._entries.get((model, work))
        if entry is None:
            raise MissingCostModel(self._missing(model, work))
        return entry.cost

    def learner(self, model: str, work: WorkKind) -> LearningBatchCost:
        """The cost model of `model` doing `work`, which must learn from observed batches;
        raises MissingCostModel when there is none, TypeError when it does not learn."""
        cost = self.get(model, work)
        if not isinstance(cost, LearningBatchCost):
            raise TypeError(
                f"the cost model of {model!r} {work.value} ({type(cost).__name__}) is fixed: "
                "it does not observe batches"
            )
        return cost

    def key(self, model: str, work: WorkKind) -> CostKey | None:
        """The key the cost model of `model` doing `work` was measured under (None: not
        known); raises MissingCostModel when there is no such cost model."""
        entry = self._entries.get((model, work))
        if entry is None:
            raise MissingCostModel(self._missing(model, work))
        return entry.key

    def __contains__(self, place: object) -> bool:
        return place in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[tuple[str, WorkKind]]:
        """The (served model, work kind) pairs held, in the order they were put."""
        return iter(self._entries)

    def _missing(self, model: str, work: WorkKind) -> str:
        held = ", ".join(f"{m!r} {w.value}" for m, w in self._entries) or "nothing"
        return f"no cost model for served model {model!r} doing {work.value}; held: {held}"
