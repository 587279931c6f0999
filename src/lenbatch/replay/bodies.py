"""Request bodies of an exact token length, cut from real text bundled with the package.

Traces give token counts, not text. To replay them against a real server we need inputs whose
tokenization by the *served model's* tokenizer has exactly the trace's length. `TextBuilder`
tokenizes real text once (GSM8K questions and the paragraphs of US inaugural addresses; State of
the Union addresses are added when very long inputs are asked for), lays the tokens out as one
stream, and cuts windows that start and end on word boundaries. Every window is re-tokenized to
check its length; windows that miss are redrawn. What could not be matched exactly is reported
through the returned lengths, never hidden.

The same corpora give the length distributions the scenarios draw from (`unit_lengths`).
Sources and licences: `data/README.md`.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from lenbatch.plan.trace import IntArray

__all__ = ["Bodies", "TextBuilder", "corpus_units", "load_tokenizer", "model_max_length"]


_MAX_ROUNDS = 12  # redraws for windows whose re-tokenized length missed


def _data_path(name: str) -> Path:
    return Path(str(resources.files("lenbatch") / "data" / "text" / name))


def _gsm8k(field: str) -> list[str]:
    out = []
    with _data_path("gsm8k_test.jsonl").open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(str(json.loads(line)[field]).strip())
    return out


def _speech_paragraphs(zip_name: str) -> list[tuple[str, str]]:
    """(speech file, paragraph) pairs of one NLTK speech corpus, in order."""
    out: list[tuple[str, str]] = []
    with zipfile.ZipFile(_data_path(zip_name)) as z:
        for name in sorted(z.namelist()):
            if not name.endswith(".txt") or "README" in name:
                continue
            text = z.read(name).decode("utf-8", errors="replace").replace("\r\n", "\n")
            blocks = [p.strip() for p in text.split("\n\n")]
            if len(blocks) < 3:  # some files have one paragraph per line
                blocks = [p.strip() for p in text.split("\n")]
            out.extend((name, " ".join(p.split())) for p in blocks if p.strip())
    return out


@cache
def corpus_units(source: str) -> tuple[tuple[str, str], ...]:
    """Units of real text as (group, text): `gsm8k` questions, `gsm8k-answers`, or the
    paragraphs of `inaugural` / `state_union` (group = the speech they belong to)."""
    if source == "gsm8k":
        return tuple(("gsm8k", q) for q in _gsm8k("question"))
    if source == "gsm8k-answers":
        return tuple(("gsm8k", a) for a in _gsm8k("answer"))
    if source == "inaugural":
        return tuple(_speech_paragraphs("nltk_inaugural.zip"))
    if source == "state_union":
        return tuple(_speech_paragraphs("nltk_state_union.zip"))
    raise ValueError(f"unknown text source {source!r}")


def load_tokenizer(model: str) -> Any:
    """The Hugging Face tokenizer of a served model (alias such as `minilm` or `smollm2`, a
    `.gguf` file, or a local folder): the one `lenbatch serve` tokenizes with, no weights."""
    from lenbatch.runners.loading import load_tokenizer as load_text_tokenizer
    from lenbatch.runners.tokenizer import TextTokenizer

    text = load_text_tokenizer(model)
    if not isinstance(text, TextTokenizer):
        raise ValueError(f"model {model!r} has no Hugging Face tokenizer")
    return text.tokenizer


def _gguf_ref(model: str) -> Any:
    """The causal-LM reference of `model` when it is a GGUF file (or alias of one), else None."""
    from lenbatch.runners.causal import resolve_causal_model

    ref = resolve_causal_model(model)
    return ref if ref is not None and ref.gguf_file is not None else None


def model_max_length(model: str) -> int | None:
    """The input limit `lenbatch serve` uses for an encoder model (sentence-transformers'
    `max_seq_length`, else the position embeddings), or None if it cannot tell."""
    from lenbatch.runners import resolve_model
    from lenbatch.runners.encoder import read_pooling

    if _gguf_ref(model) is not None:
        return None  # a causal LM: its limit is prompt plus output, set by its server
    folder, _ = resolve_model(model)
    _, _, st_max = read_pooling(folder)
    if st_max:
        return int(st_max)
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    n = cfg.get("max_position_embeddings")
    return int(n) if n else None


@dataclass(frozen=True)
class Bodies:
    """Request inputs built for a list of target lengths."""

    inputs: list[str] | list[list[int]]
    lengths: IntArray  # the real token count of each input, as the model's tokenizer sees it
    exact: int  # how many hit their target exactly

    @property
    def mismatched(self) -> int:
        """Inputs whose length differs from the target (too short a target, or no window)."""
        return len(self.lengths) - self.exact


class TextBuilder:
    """Cuts real text into inputs of a requested token length for one tokenizer."""

    def __init__(self, tokenizer: Any, sources: Sequence[str] = ("gsm8k", "inaugural")) -> None:
        self.tokenizer = tokenizer
        # The special tokens the tokenizer wraps around a text, found on a probe.
        with_special = list(tokenizer("hello", add_special_tokens=True)["input_ids"])
        bare = list(tokenizer("hello", add_special_tokens=False)["input_ids"])
        k = next(
            (i for i in range(len(with_special)) if with_special[i : i + len(bare)] == bare), 0
        )
        self._prefix = with_special[:k]
        self._suffix = with_special[k + len(bare) :]
        self.n_special = len(self._prefix) + len(self._suffix)
        self._sources: list[str] = []
        self._text = ""
        self._ids = np.zeros(0, dtype=np.int64)
        self._starts = np.zeros(0, dtype=np.int64)  # char offset where each token starts
        self._ends = np.zeros(0, dtype=np.int64)
        self._word_start = np.zeros(1, dtype=bool)  # per token, plus a final True sentinel
        self._unit_lengths: dict[str, IntArray] = {}
        for s in sources:
            self._add_source(s)

    @property
    def min_length(self) -> int:
        """The shortest input that can be built: the special tokens plus one real token."""
        return self.n_special + 1

    @property
    def stream_tokens(self) -> int:
        """Tokens of real text available for windows."""
        return len(self._ids)

    def _tokenize_units(self, texts: list[str]) -> Any:
        return self.tokenizer(
            texts,
            add_special_tokens=False,
            return_offsets_mapping=True,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,
        )

    def _add_source(self, source: str) -> None:
        if source in self._sources:
            return
        units = corpus_units(source)
        enc = self._tokenize_units([t for _, t in units])
        ids: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        parts = [self._text] if self._text else []
        base = len(self._text) + (2 if self._text else 0)
        lengths = []
        for (_, text), unit_ids, offsets in zip(
            units, enc["input_ids"], enc["offset_mapping"], strict=True
        ):
            ids.extend(unit_ids)
            starts.extend(base + a for a, _ in offsets)
            ends.extend(base + b for _, b in offsets)
            lengths.append(len(unit_ids) + self.n_special)
            parts.append(text)
            base += len(text) + 2  # joined by a blank line
        self._text = "\n\n".join(parts)
        self._ids = np.concatenate([self._ids, np.asarray(ids, dtype=np.int64)])
        self._starts = np.concatenate([self._starts, np.asarray(starts, dtype=np.int64)])
        self._ends = np.concatenate([self._ends, np.asarray(ends, dtype=np.int64)])
        # A token starts a word when whitespace (or the text's start) precedes it.
        codes = np.frombuffer(self._text.encode("utf-32-le"), dtype=np.uint32)
        before = codes[np.maximum(self._starts - 1, 0)]
        spaces = np.asarray([ord(c) for c in " \t\n\r\x0b\x0c\xa0"], dtype=np.uint32)
        ws = np.ones(len(self._ids) + 1, dtype=bool)
        ws[:-1] = (self._starts == 0) | np.isin(before, spaces)
        self._word_start = ws
        self._unit_lengths[source] = np.asarray(lengths, dtype=np.int64)
        self._sources.append(source)

    def unit_lengths(self, source: str) -> IntArray:
        """Token lengths (special tokens included) of each unit of `source` (see
        `corpus_units`), or of each whole speech for `inaugural-speech` / `state_union-speech`."""
        if source.endswith("-speech"):
            base = source.removesuffix("-speech")
            per_unit = self.unit_lengths(base)
            groups = [g for g, _ in corpus_units(base)]
            totals: dict[str, int] = {}
            for g, n in zip(groups, per_unit.tolist(), strict=True):
                totals[g] = totals.get(g, self.n_special) + n - self.n_special
            return np.asarray(list(totals.values()), dtype=np.int64)
        if source not in self._unit_lengths:
            if source == "gsm8k-answers":
                enc = self._tokenize_units([t for _, t in corpus_units(source)])
                self._unit_lengths[source] = np.asarray(
                    [len(x) + self.n_special for x in enc["input_ids"]], dtype=np.int64
                )
            else:
                self._add_source(source)
        return self._unit_lengths[source]

    def _ensure_room(self, longest: int) -> None:
        if longest * 2 > len(self._ids) and "state_union" not in self._sources:
            self._add_source("state_union")
        if longest > len(self._ids):
            raise ValueError(
                f"cannot build a {longest}-token input: the bundled text has "
                f"{len(self._ids)} tokens for this tokenizer"
            )

    def _window(self, n: int, rng: np.random.Generator) -> tuple[int, int]:
        """(first token, token count) of a window of `n` tokens starting and, if possible,
        ending on a word boundary."""
        total = len(self._ids)
        last = total - n
        for _ in range(64):
            s = int(rng.integers(0, last + 1))
            if self._word_start[s] and self._word_start[s + n]:
                return s, n
        return int(rng.integers(0, last + 1)), n

    def texts(self, lengths: Sequence[int] | IntArray, seed: int = 0) -> Bodies:
        """One real-text input per target length; each is checked with the tokenizer."""
        targets = np.maximum(np.asarray(lengths, dtype=np.int64), self.min_length)
        if len(targets) == 0:
            return Bodies([], np.zeros(0, dtype=np.int64), 0)
        self._ensure_room(int(targets.max()))
        rng = np.random.default_rng(seed)
        out: list[str] = [""] * len(targets)
        got = np.zeros(len(targets), dtype=np.int64)
        todo = np.arange(len(targets))
        for _ in range(_MAX_ROUNDS):
            cand = []
            for i in todo.tolist():
                s, n = self._window(int(targets[i]) - self.n_special, rng)
                cand.append(self._text[self._starts[s] : self._ends[s + n - 1]])
            enc = self.tokenizer(
                cand,
                add_special_tokens=True,
                return_attention_mask=False,
                return_token_type_ids=False,
                verbose=False,
            )
            still = []
            for i, text, ids in zip(todo.tolist(), cand, enc["input_ids"], strict=True):
                n_ids = len(ids)
                # Keep the closest candidate so far; redraw those that missed.
                if not out[i] or abs(n_ids - targets[i]) < abs(got[i] - targets[i]):
                    out[i], got[i] = text, n_ids
                if n_ids != targets[i]:
                    still.append(i)
            todo = np.asarray(still, dtype=np.int64)
            if not len(todo):
                break
        exact = int((got == np.asarray(lengths)).sum())
        return Bodies(out, got, exact)

    def token_ids(self, lengths: Sequence[int] | IntArray, seed: int = 0) -> Bodies:
        """One token-id array per target length: a window of real text's ids with the
        model's special tokens around it (exact by construction)."""
        targets = np.maximum(np.asarray(lengths, dtype=np.int64), self.min_length)
        if len(targets) == 0:
            return Bodies([], np.zeros(0, dtype=np.int64), 0)
        self._ensure_room(int(targets.max()))
        rng = np.random.default_rng(seed)
        out: list[list[int]] = []
        for t in targets.tolist():
            n = t - self.n_special
            s = int(rng.integers(0, len(self._ids) - n + 1))
            body = self._ids[s : s + n].tolist()
            out.append([*self._prefix, *body, *self._suffix])
        got = np.asarray([len(x) for x in out], dtype=np.int64)
        return Bodies(out, got, int((got == np.asarray(lengths)).sum()))
