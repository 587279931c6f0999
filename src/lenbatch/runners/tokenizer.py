"""A model's tokenizer alone: text to token ids and back, chat templates, never the weights.

The runners tokenize through a `TextTokenizer`, and so do the front-ends that must measure a
request's length without running the model (the Ray ingress, a process apart from the engine):
they load it from the model's folder with `TextTokenizer.load`, which reads the tokenizer files
only, so they get exactly the runner's token ids at a fraction of its memory and start-up time.

Two ways to cut a text over the limit, when the caller asks for truncation:

- `head` (encoders): keep the first tokens. One batch-encode call for all texts; a text far
  longer than the limit could need is cut first at a space, so a 1 MB input costs a few KB of
  tokenizing; a cut text that then falls short of the limit is tokenized whole instead, so the
  result is always what truncating the whole text gives.
- `tail` (causal LMs): keep the last `max_length - 1` tokens, so the end of a prompt, which the
  continuation follows, survives and one token is left to generate.

A (query, document) pair is tokenized as a pair (`tokenize_pairs`): the model's special tokens
around and between its texts, and segment ids (`token_type_ids`) where the model uses them.
Truncation cuts the document, never the query.

Single texts of a fast tokenizer go straight to its Rust `tokenizers.Tokenizer`, through two
copies of it made once (one that never cuts, one that cuts at `max_length` as transformers
would): transformers' `__call__` re-applies its truncation and padding settings to the shared
backend on every call and wraps the result, about a third of a one-line input's tokenizing
time (40 vs 28 us for MiniLM, Intel Xeon family 6 model 167), and a settings change from one
thread races an encode on another. Slow tokenizers and pairs keep transformers' call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["Pairs", "TextTokenizer"]

# Characters per token that a truncating cut leaves room for (English averages about 4): a cut
# text that still yields fewer tokens than the limit is tokenized whole (exact either way).
_CHARS_PER_TOKEN_BOUND = 16
# Tokenizers that state no limit report a huge sentinel (about 1e30); below this is a real one.
_NO_LIMIT = 10**6


@dataclass(frozen=True, slots=True)
class Pairs:
    """Tokenized (query, document) pairs: token ids, and segment ids per token where the model
    takes them (None when it has no segment embedding: every token is then segment 0)."""

    ids: list[list[int]]
    token_type_ids: list[list[int]] | None


class TextTokenizer:
    """Token ids of texts for one model with a length limit of `max_length` tokens."""

    def __init__(
        self, tokenizer: Any, max_length: int, *, keep: Literal["head", "tail"] = "head"
    ) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.keep = keep
        self._whole, self._cutting = _backends(tokenizer, max_length)

    @classmethod
    def load(
        cls,
        folder: str | Path,
        max_length: int | None = None,
        *,
        keep: Literal["head", "tail"] = "head",
        gguf_file: str | None = None,
    ) -> TextTokenizer:
        """The tokenizer of the model in `folder` (or of `gguf_file` inside it), with no
        weights loaded; it cuts at `max_length` (default: the tokenizer's own limit, if it
        states one)."""
        from transformers import AutoTokenizer

        extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(Path(folder), **extra)
        if max_length is None:
            stated = tokenizer.model_max_length
            max_length = int(stated) if stated < _NO_LIMIT else _NO_LIMIT
        return cls(tokenizer, max_length, keep=keep)

    # ------------------------------------------------------------------ facts

    @property
    def pad_token_id(self) -> int | None:
        """The tokenizer's padding id (None if it has none)."""
        pad = self.tokenizer.pad_token_id
        return None if pad is None else int(pad)

    @property
    def padding_side(self) -> Literal["left", "right"]:
        """Which side the tokenizer pads on."""
        return "left" if self.tokenizer.padding_side == "left" else "right"

    @property
    def model_max_length(self) -> int | None:
        """The tokenizer's own length limit, if it states a real one."""
        n = self.tokenizer.model_max_length
        return int(n) if n < _NO_LIMIT else None

    @property
    def has_chat_template(self) -> bool:
        """True if the tokenizer can format chat messages."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    # ------------------------------------------------------------------ text to ids and back

    def tokenize(self, texts: Sequence[str], truncate: bool = False) -> list[list[int]]:
        """Token ids of each text with the tokenizer's special tokens; over the limit only when
        `truncate` is false, so callers can tell overlong inputs apart (see the module's
        docstring for how each side cuts)."""
        if self.keep == "tail":
            out = self._encode(list(texts), False)
            if truncate:
                keep = self.max_length - 1
                out = [ids[-keep:] if len(ids) > keep else ids for ids in out]
            return out
        if not truncate:
            return self._encode(list(texts), False)
        cuts = [self._cut(t) for t in texts]
        ids = self._encode(cuts, True)
        short = [
            i
            for i, (t, c) in enumerate(zip(texts, cuts, strict=True))
            if c is not t and len(ids[i]) < self.max_length
        ]
        if short:
            for i, redone in zip(short, self._encode([texts[i] for i in short], True), strict=True):
                ids[i] = redone
        return ids

    def tokenize_pairs(self, pairs: Sequence[tuple[str, str]], truncate: bool = False) -> Pairs:
        """Token ids and segment ids of (query, document) pairs, one batch-encode call. Over
        the limit only when `truncate` is false; truncating cuts the document (first the cheap
        cut at a space, as for single texts, then exactly), never the query."""
        queries = [q for q, _ in pairs]
        docs = [d for _, d in pairs]
        if not truncate:
            return self._encode_pairs(queries, docs, False)
        cuts = [self._cut(d) for d in docs]
        out = self._encode_pairs(queries, cuts, True)
        short = [
            i
            for i, (d, c) in enumerate(zip(docs, cuts, strict=True))
            if c is not d and len(out.ids[i]) < self.max_length
        ]
        if short:
            redone = self._encode_pairs([queries[i] for i in short], [docs[i] for i in short], True)
            for k, i in enumerate(short):
                out.ids[i] = redone.ids[k]
                if out.token_type_ids is not None and redone.token_type_ids is not None:
                    out.token_type_ids[i] = redone.token_type_ids[k]
        return out

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a chat rendered with the tokenizer's chat template, ready for the
        assistant's turn, with `tools` (OpenAI's) where the template renders them. Raises
        ValueError when the tokenizer has no chat template."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(x) for x in ids]

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped."""
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text

    def _encode(self, texts: list[str], truncate: bool) -> list[list[int]]:
        backend = self._cutting if truncate else self._whole
        if backend is not None:
            if len(texts) == 1:
                # one text (most calls): `encode` runs on this thread, where `encode_batch`
                # goes through the library's thread pool even for one text
                return [backend.encode(texts[0], add_special_tokens=True).ids]
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=True)]
        enc = self.tokenizer(
            texts,
            add_special_tokens=True,
            truncation=truncate,
            max_length=self.max_length if truncate else None,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return [list(ids) for ids in enc["input_ids"]]

    def _encode_pairs(self, queries: list[str], docs: list[str], truncate: bool) -> Pairs:
        takes_types = "token_type_ids" in getattr(self.tokenizer, "model_input_names", ())
        enc = self.tokenizer(
            queries,
            docs,
            add_special_tokens=True,
            truncation="only_second" if truncate else False,
            max_length=self.max_length if truncate else None,
            return_attention_mask=False,
            return_token_type_ids=takes_types,
        )
        ids = [list(x) for x in enc["input_ids"]]
        types = [list(x) for x in enc["token_type_ids"]] if takes_types else None
        return Pairs(ids, types)

    def _cut(self, text: str) -> str:
        """`text`, or a prefix of it ending before a space that holds at least as many
        characters as the limit could take tokens (pre-tokenizers split at spaces, so the
        prefix's tokens are the whole text's first tokens)."""
        room = self.max_length * _CHARS_PER_TOKEN_BOUND
        if len(text) <= room:
            return text
        space = text.rfind(" ", 0, room)
        return text[:space] if space > 0 else text


def _backends(tokenizer: Any, max_length: int) -> tuple[Any, Any]:
    """Two copies of a fast tokenizer's Rust backend, (never cuts, cuts at `max_length` on the
    tokenizer's truncation side), or (None, None) for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return None, None
    from tokenizers import Tokenizer

    whole = Tokenizer.from_str(backend.to_str())
    whole.no_truncation()
    whole.no_padding()
    cutting = Tokenizer.from_str(backend.to_str())
    cutting.no_padding()
    side = "left" if getattr(tokenizer, "truncation_side", "right") == "left" else "right"
    cutting.enable_truncation(max_length, stride=0, strategy="longest_first", direction=side)
    return whole, cutting
