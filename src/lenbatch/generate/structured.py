"""Structured outputs: text that follows a JSON schema, a regular expression, a list of choices
or a grammar, by masking at each step every token the constraint does not allow.

The grammars and their token masks are llguidance's (the Rust library behind Guidance, one of
vLLM's structured-output backends): a request's constraint becomes llguidance's serialized
grammar when the request is parsed (`grammar_of`; a malformed schema or pattern is a 400), is
checked against the model's vocabulary and priced before admission, in a worker thread
(`Grammars.check`: a first token mask over `MAX_MASK_MS` is a 400), and each admitted
generation gets a matcher of its own (`Grammars.matcher`), advanced by every token it is given.
At each step the sampler sets the logits of the tokens the matcher refuses to -inf (`mask`)
before temperature, `top_p` or sampling act, as vLLM does; reported log-probabilities stay the
model's own. Once the grammar is complete only end-of-sequence may follow, and that token ends
the text even with `ignore_eos` (`Generation.add_token`).

`Grammars` wraps one model's tokenizer as llguidance sees it (about half a second to build for
a 49k vocabulary, so once per tokenizer: `grammars_of`).
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from lenbatch.core.errors import BadInput
from lenbatch.serving.messages import OutputConstraint

__all__ = ["CONSTRAINT_KINDS", "Grammars", "Matcher", "grammar_of", "grammars_for", "grammars_of"]

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""What a constraint may be: a JSON schema, any JSON object, a regular expression (the whole
text must match it), one of a list of strings, or a grammar (Lark in llguidance's dialect, or
llama.cpp's GBNF)."""

MAX_CONSTRAINT_CHARS = 100_000
"""Longest schema, pattern, grammar or list of choices taken (as JSON text), in characters."""

_STARTS = 64  # grammars whose start a `Grammars` keeps

MAX_MASK_MS = 20.0
"""Most milliseconds a constraint's first token mask may take to compute (measured at
admission, on a worker thread). Masks are computed on the decode thread at every step, so a
costly grammar would stall every stream: `a{1000000}` takes ~1.3 s a step with SmolLM2's
vocabulary, where the JSON schemas and patterns of ordinary use take 0.05-3 ms."""


def grammar_of(kind: str, spec: Any, *, compact: bool = False) -> OutputConstraint:
    """The constraint of `kind` given by `spec` (a schema as a dict or JSON text, a pattern, a
    list of strings, a grammar's text; ignored for `json_object`), compiled to llguidance's
    serialized grammar (well under a millisecond; `Grammars.check` validates it against the
    vocabulary and prices it, off the event loop). JSON may carry whitespace wherever JSON
    allows it, as in vLLM by default; `compact` allows none (vLLM's `disable_any_whitespace`),
    so a model cannot spend its tokens on it. Raises `BadInput` naming what is wrong with the
    constraint."""
    import llguidance

    json_defaults: Any = {"whitespace_flexible": not compact}  # llguidance's JsonCompileOptions
    if kind not in CONSTRAINT_KINDS:
        raise BadInput(f"unknown constraint {kind!r}; one of {', '.join(CONSTRAINT_KINDS)}")
    size = len(spec) if isinstance(spec, str) else len(json.dumps(spec, default=str))
    if size > MAX_CONSTRAINT_CHARS:
        raise BadInput(
            f"the {kind} constraint has {size} characters; the limit is {MAX_CONSTRAINT_CHARS}"
        )
    try:
        if kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=json_defaults
            )
        elif kind == "json":
            schema = json.loads(spec) if isinstance(spec, str) else spec
            if not isinstance(schema, dict):
                raise BadInput("a JSON schema must be an object")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_defaults)
        elif kind == "choice":
            if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
                raise BadInput("choice must be a non-empty list of strings")
            if any(not c for c in spec):
                raise BadInput("a choice is an empty string")
            grammar = llguidance.grammar_from("choice", json.dumps(spec))
        else:
            if not isinstance(spec, str) or not spec:
                raise BadInput(f"a {kind} constraint must be a non-empty string")
            # "grammar": Lark, or GBNF (llama.cpp's, as vLLM takes it) converted to Lark
            grammar = llguidance.grammar_from("regex" if kind == "regex" else "grammar", spec)
    except BadInput:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise BadInput(f"invalid {kind} constraint: {_short(exc)}") from None
    return OutputConstraint(kind, grammar)


def _limits() -> Any:
    """llguidance's parser limits, its defaults but with short errors (a verbose one can quote
    the grammar and the parser's state)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def _short(error: object, limit: int = 300) -> str:
    """An error's message, cut to `limit` characters (it may quote the whole grammar)."""
    text = str(error).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Matcher:
    """One generation's place in its grammar: which tokens may come next, and the tokens given."""

    __slots__ = ("_m", "_vocab")

    def __init__(self, matcher: Any, vocab: int) -> None:
        self._m = matcher
        self._vocab = vocab

    @property
    def stopped(self) -> bool:
        """True once the grammar is complete (only end-of-sequence may follow) or broken."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        """Why the matcher broke (a token it did not allow was given), or ''."""
        return str(self._m.get_error() or "")

    def allowed(self) -> torch.Tensor:
        """`[vocab]` bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        # llguidance's mask is 32-bit words, token 32w + k at bit k of word w (little-endian):
        # byte order and bit order agree, so the bytes unpack least significant bit first.
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab].view(bool))

    def mask(self, row: torch.Tensor, allowed: torch.Tensor) -> None:
        """Set the logits in `row` (`[vocab]`) of tokens not `allowed` to -inf, in place."""
        width = min(int(row.shape[0]), int(allowed.shape[0]))
        row[:width].masked_fill_(~allowed[:width], float("-inf"))
        row[width:] = float("-inf")

    def consume(self, token: int) -> bool:
        """Advance past `token`; False when the grammar did not allow it (the matcher breaks)."""
        if self._m.is_stopped():
            return True
        return bool(self._m.consume_token(token))


class Grammars:
    """llguidance's view of one model's tokenizer: checks constraints against it and makes
    matchers. `vocab` is the model's logits width (the masks cover every logit)."""

    def __init__(self, hf_tokenizer: Any, vocab: int) -> None:
        self._hf = hf_tokenizer
        self.vocab = vocab
        self._lock = threading.Lock()
        self._ll: Any = None
        # Recent grammars' matchers at their start, copied for each generation: an app tends
        # to send the same schema with every call, and a copy skips building its grammar.
        self._starts: OrderedDict[str, Any] = OrderedDict()
        self._starts_lock = threading.Lock()

    def tokenizer(self) -> Any:
        """The llguidance tokenizer (built on first use)."""
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self._hf, self.vocab)
            return self._ll

    def check(self, constraint: OutputConstraint) -> None:
        """Raise `BadInput` when `constraint` is malformed, cannot be followed with this
        vocabulary, or its first token mask takes over `MAX_MASK_MS` (a blocking call: run it
        off the event loop; llguidance releases the GIL while it builds a grammar)."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(
            constraint.grammar, self.tokenizer(), limits=_limits()
        )
        if error:
            raise BadInput(f"invalid {constraint.kind} constraint: {_short(error)}")
        matcher = self.matcher(constraint)
        start = time.perf_counter()
        matcher.allowed()
        took = 1000 * (time.perf_counter() - start)
        if took > MAX_MASK_MS:
            raise BadInput(
                f"the {constraint.kind} constraint is too costly to follow: its first token "
                f"mask took {took:.0f} ms; the limit is {MAX_MASK_MS:.0f} ms"
            )
        if matcher.error:
            raise BadInput(f"invalid {constraint.kind} constraint: {_short(matcher.error)}")

    def matcher(self, constraint: OutputConstraint) -> Matcher:
        """A fresh matcher at the start of `constraint`'s grammar (a copy of the last one
        built for the same grammar, where one of the last `_STARTS` is kept)."""
        import llguidance

        key = constraint.grammar
        with self._starts_lock:
            start = self._starts.get(key)
            if start is not None:
                self._starts.move_to_end(key)
        if start is not None:
            return Matcher(start.deep_copy(), self.vocab)
        m = llguidance.LLMatcher(
            self.tokenizer(), constraint.grammar, log_level=0, limits=_limits()
        )
        if m.is_error():
            raise BadInput(f"invalid {constraint.kind} constraint: {_short(m.get_error())}")
        with self._starts_lock:
            self._starts[key] = m.deep_copy()
            while len(self._starts) > _STARTS:
                self._starts.popitem(last=False)
        return Matcher(m, self.vocab)


_by_tokenizer: weakref.WeakKeyDictionary[Any, Grammars] = weakref.WeakKeyDictionary()
_by_tokenizer_lock = threading.Lock()


def grammars_of(hf_tokenizer: Any, vocab: int) -> Grammars:
    """The one `Grammars` of `hf_tokenizer` (a transformers fast tokenizer) with `vocab` logits."""
    with _by_tokenizer_lock:
        found = _by_tokenizer.get(hf_tokenizer)
        if found is None or found.vocab != vocab:
            found = Grammars(hf_tokenizer, vocab)
            _by_tokenizer[hf_tokenizer] = found
        return found


def grammars_for(owner: Any, vocab: int) -> Grammars:
    """The `Grammars` of `owner`'s tokenizer (a runner's or a `TextTokenizer`'s `tokenizer`,
    a transformers fast tokenizer). Raises `BadInput` where there is none to follow a
    constraint with."""
    hf = getattr(owner, "tokenizer", None)
    if hf is None or not getattr(hf, "is_fast", False):
        raise BadInput("this model's tokenizer cannot follow structured outputs")
    return grammars_of(hf, vocab)
