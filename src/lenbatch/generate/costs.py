"""The cost models of strategy `adaptive` for causal LMs: seconds of a prefill chunk and of a
decode step, learned online from the engine's own units.

`GenCosts` holds the two models (`core.costfit.OnlineCostModel`, booked in the house's
`WorkKind` terms: `PREFILL_CHUNK` for `seconds(rows, chunk columns)`, `DECODE_STEP` for
`seconds(rows, cache width)`), each seeded by a generic prior until the fit takes over, and
`drift`, the recent ratio of the loop's measured turn time to the models' prediction, by which
every prediction is multiplied. A prefill chunk is priced by its real prompt tokens where the
runner leaves a chunk's left padding out of its products (`real_tokens`: the lean Llama path),
else by its padded shape (rows x chunk columns, as transformers' forward runs it).
`generate.adaptive.AdaptiveGenPolicy` reads them to size the running batch and the prefill
chunks and to price admission; the engine feeds them every unit it runs. Pure: no clock, no
torch.
"""

from __future__ import annotations

from typing import Any, Protocol

from lenbatch.core.costfit import CostCoefficients, OnlineCostModel
from lenbatch.core.costkey import CostBook, WorkKind

__all__ = ["DECODE_PRIOR", "PREFILL_PRIOR", "GenCosts"]

# Generic priors for a ~100M-parameter Llama in bf16 on two CPU cores (SmolLM2-135M's order of
# magnitude): ~35 ms per decode step plus attention over the cache, ~3k prompt tokens/s. The
# online fit replaces them within a few dozen units.
PREFILL_PRIOR = CostCoefficients(0.02, 3e-4, 0.0)  # rows x chunk columns
DECODE_PRIOR = CostCoefficients(0.035, 8e-6, 0.0)  # rows x cache width


class _Result(Protocol):
    """A unit's figures (`generate.jobs.UnitResult`)."""

    @property
    def kind(self) -> str: ...

    @property
    def rows(self) -> int: ...

    @property
    def padded(self) -> int: ...

    @property
    def compute_s(self) -> float: ...

    @property
    def prefill_rows(self) -> int: ...

    @property
    def prefill_padded(self) -> int: ...

    @property
    def tokens(self) -> int: ...

    @property
    def prefill_tokens(self) -> int: ...


class GenCosts:
    """The two cost models of a causal LM, learned online from the engine's own units.

    `prefill`: `seconds(rows, chunk columns)` of one prefill chunk (`WorkKind.PREFILL_CHUNK`);
    `decode`: `seconds(rows, cache width)` of one decode step (`WorkKind.DECODE_STEP`).
    `drift` is the recent measured/predicted ratio of whole loop turns. With `real_tokens`, a
    chunk is learnt as `rows x (its real tokens / rows)`: what the runner's products ran, where
    its left padding runs through none of them (`CausalLMRunner.prefill_skips_padding`).
    """

    def __init__(
        self,
        model: str,
        window: int = 256,
        *,
        real_tokens: bool = False,
        prefill_prior: CostCoefficients = PREFILL_PRIOR,
        decode_prior: CostCoefficients = DECODE_PRIOR,
    ) -> None:
        self.prefill = OnlineCostModel(prefill_prior, window)
        self.decode = OnlineCostModel(decode_prior, window)
        self.prefill.source = self.decode.source = "generic prior"
        self.book = CostBook()
        self.book.put(model, WorkKind.PREFILL_CHUNK, self.prefill)
        self.book.put(model, WorkKind.DECODE_STEP, self.decode)
        self.real_tokens = real_tokens
        self.drift = 1.0
        self.width = 128.0  # moving average of the decode batch's cache width

    def prefill_s(self, rows: float, cols: float) -> float:
        """Predicted seconds of a prefill chunk, drift included."""
        return self.drift * self.prefill.seconds(max(rows, 1), max(cols, 1))

    def decode_s(self, rows: float, width: float | None = None) -> float:
        """Predicted seconds of a decode step of `rows` rows (0 rows: none), drift included."""
        if rows <= 0:
            return 0.0
        return self.drift * self.decode.seconds(rows, max(width or self.width, 1))

    def observe(self, result: _Result, turn_s: float | None = None) -> None:
        """Learn from one unit: the model call's seconds go to its cost model; the whole loop
        turn (`turn_s`, when measured) against the prediction moves `drift`.

        A mixed unit (a decode step and a prefill chunk in one forward) teaches the prefill
        model what the chunk added to the decode step the decode model predicts: the chunk's
        cost beside a step, which is what chunk sizing and the first-token prediction add to
        the steps they count."""
        if result.rows < 1 or result.padded < 1:
            return
        width = result.padded / result.rows
        if result.kind == "mixed":
            step = self.decode.seconds(result.rows, width)
            predicted = step
            prows = result.prefill_rows
            ptokens = result.prefill_tokens if self.real_tokens else result.prefill_padded
            if prows >= 1 and ptokens >= 1:
                pcols = ptokens / prows
                predicted += self.prefill.seconds(prows, pcols)
                added = max(result.compute_s - step, 0.0)
                self.prefill.observe(prows, max(1, round(pcols)), added)
        elif result.kind == "prefill":
            tokens = result.tokens if self.real_tokens else result.padded
            if tokens < 1:  # a chunk of padding alone: no product ran, nothing to learn
                return
            cols = tokens / result.rows
            predicted = self.prefill.seconds(result.rows, cols)
            self.prefill.observe(result.rows, max(1, round(cols)), result.compute_s)
        else:
            predicted = self.decode.seconds(result.rows, width)
            self.decode.observe(result.rows, max(1, round(width)), result.compute_s)
        if result.kind != "prefill":
            self.width += 0.1 * (width - self.width)
        if turn_s is not None and turn_s > 0 and predicted > 0:
            ratio = min(4.0, max(0.25, turn_s / predicted))
            # ~10 units of memory: a slowdown of the shared cores counts within a second.
            self.drift = min(4.0, max(0.5, self.drift + 0.1 * (ratio - self.drift)))

    def describe(self) -> dict[str, Any]:
        """What `/stats` shows."""
        return {
            "prefill_chunk": self.prefill.describe(),
            "decode_step": self.decode.describe(),
            "prefill_priced_by": "real tokens" if self.real_tokens else "padded shape",
            "drift": round(self.drift, 3),
            "decode_width": round(self.width, 1),
        }
