"""Token choice and incremental detokenization with stop strings."""

from __future__ import annotations

import pytest
import torch

from lenbatch.generate.sampling import TextTracker, choose_tokens, make_generator
from lenbatch.serving.messages import SamplingParams

WORDS = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "\ufffd"}


def _decode(ids: list[int]) -> str:
    text = "".join(WORDS[i] for i in ids)
    # A trailing replacement character stands for an incomplete multi-byte character.
    return text


def _push_all(tracker: TextTracker, ids: list[int]) -> list[str]:
    return [tracker.push(ids[: n + 1]) for n in range(len(ids))]


def test_tracker_without_stop_streams_every_piece() -> None:
    """Each push returns exactly the new text."""
    tr = TextTracker(_decode)
    assert _push_all(tr, [1, 2, 3, 4]) == ["Hel", "lo", " wor", "ld"]


def test_tracker_cuts_at_stop_string_and_never_shows_it() -> None:
    """Text up to the stop string is returned; the stop string and what follows never is."""
    tr = TextTracker(_decode, stop=["o w"])
    pieces = _push_all(tr, [1, 2, 3, 4])
    assert "".join(pieces) == "Hell"
    assert tr.stopped
    assert tr.text == "Hell"


def test_tracker_holds_back_a_possible_stop_prefix_then_releases_it() -> None:
    """'lo' might start the stop string 'lo!'; it is held until ' wor' rules that out."""
    tr = TextTracker(_decode, stop=["lo!"])
    assert tr.push([1, 2]) == "Hel"
    assert tr.push([1, 2, 3]) == "lo wor"
    assert not tr.stopped


def test_tracker_holds_back_incomplete_characters() -> None:
    """A trailing replacement character is not shown until the next token completes it."""
    tr = TextTracker(_decode)
    assert tr.push([1, 6]) == "Hel"
    assert tr.flush() == "\ufffd"


def test_greedy_takes_the_argmax_per_row() -> None:
    """Temperature 0 picks the largest logit of each row."""
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 0.0]])
    p = SamplingParams(temperature=0)
    assert choose_tokens(logits, [p, p], [None, None]) == [1, 0]
    # ties go to the first, as transformers' greedy `argmax`
    tied = torch.randint(0, 3, (16, 500), generator=torch.Generator().manual_seed(0)).float()
    assert choose_tokens(tied, [p] * 16, [None] * 16) == tied.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-6, 5e-324])  # 5e-324 rounds to 0 in float32
def test_tiny_top_p_keeps_only_the_top_token(top_p: float) -> None:
    """top_p near 0 leaves only the most likely token, whatever the seed."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    p = SamplingParams(temperature=1.0, top_p=top_p, seed=7)
    for seed in range(5):
        gen = make_generator(SamplingParams(seed=seed), torch.device("cpu"))
        assert choose_tokens(logits, [p], [gen]) == [1]


@pytest.mark.parametrize("temperature", [1e-3, 1.18e-259, 5e-324])  # 5e-324: 0 in float32
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_tiny_temperature_samples_the_top_token(temperature: float, top_p: float) -> None:
    """A temperature near 0 (any positive one is valid) samples the largest logit, as in the
    limit, instead of failing on NaN probabilities (the fuzzer found 1.18e-259 and 5e-324
    answered 500: the logits over it were inf, and inf - inf is NaN); a masked (-inf)
    token stays unchosen, and large logits do not overflow."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, float("-inf")], [80.0, 95.0, 94.9, 0.0, 1.0]])
    p = SamplingParams(temperature=temperature, top_p=top_p)
    for seed in range(5):
        gens = [make_generator(SamplingParams(seed=seed + k), torch.device("cpu")) for k in (0, 9)]
        assert choose_tokens(logits, [p, p], gens) == [1, 1]


def test_seeded_sampling_repeats_and_depends_on_the_seed() -> None:
    """The same seed draws the same tokens; draws follow the distribution's support."""
    logits = torch.zeros((1, 50))

    def draw(seed: int) -> list[int]:
        p = SamplingParams(seed=seed)
        gen = make_generator(p, torch.device("cpu"))
        return [choose_tokens(logits, [p], [gen])[0] for _ in range(20)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"temperature": -1}, {"temperature": 3}, {"top_p": 0}, {"stop": ("",)}],
)
def test_invalid_params_are_refused(kwargs: dict[str, object]) -> None:
    """Out-of-range options raise ValueError naming the option."""
    with pytest.raises(ValueError, match=next(iter(kwargs)).split("_")[0]):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_mask_eos_keeps_young_rows_from_ending() -> None:
    """Rows below min_tokens cannot choose an end-of-sequence token; other rows still can."""
    from lenbatch.generate.sampling import mask_eos

    logits = torch.tensor([[0.0, 9.0, 1.0], [0.0, 9.0, 1.0]])
    mask_eos(logits, [0], frozenset({1}))
    p = SamplingParams(temperature=0)
    assert choose_tokens(logits, [p, p], [None, None]) == [2, 1]
