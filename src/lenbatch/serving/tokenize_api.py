"""`POST /tokenize`, `/detokenize` and `/decode` for any served model, the LLM included.

Two anchors' shapes, told apart by the body:

- vLLM: `{model, prompt | messages, add_special_tokens?}` -> `{count, max_model_len, tokens,
  token_strs}`; `POST /detokenize` `{model, tokens}` -> `{prompt}` (special tokens kept, as
  vLLM's tokenizer decode does).
- TEI: `{inputs: str | [str], add_special_tokens?}` -> one list per input of
  `{id, text, special, start, stop}` (character offsets); `POST /decode`
  `{ids: [int] | [[int]], skip_special_tokens?}` -> one string per id list.

Ids are the model's own tokenizer's (`TextTokenizer.tokenizer`, the one the runner tokenizes
with), computed in a worker thread, never on the event loop. Nothing here logs request text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Annotated, Any, cast

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from lenbatch.core.errors import BadInput
from lenbatch.runners.tokenizer import TextTokenizer
from lenbatch.serving.http import check_model

__all__ = ["DecodeRequest", "DetokenizeRequest", "TokenizeRequest", "add_tokenize_routes"]

_Id = Annotated[StrictInt, Field(ge=0)]


class TokenizeRequest(BaseModel):
    """Body of `POST /tokenize`: vLLM's `prompt` or `messages`, or TEI's `inputs`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: StrictStr | None = Field(None, description="vLLM: the text to tokenize.")
    messages: list[dict[str, Any]] | None = Field(
        None, description="vLLM: chat messages, rendered with the model's chat template."
    )
    inputs: StrictStr | list[StrictStr] | None = Field(
        None, description="TEI: a text or a list of texts."
    )
    add_special_tokens: bool = Field(True, description="Add the model's special tokens.")
    add_generation_prompt: bool = Field(True, description="vLLM chat: open the assistant turn.")
    return_token_strs: bool = Field(False, description="vLLM: also each token's string.")


class DetokenizeRequest(BaseModel):
    """Body of `POST /detokenize` (vLLM)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[_Id]


class DecodeRequest(BaseModel):
    """Body of `POST /decode` (TEI)."""

    model_config = ConfigDict(extra="ignore")

    ids: list[_Id] | list[list[_Id]]
    skip_special_tokens: bool = True


def add_tokenize_routes(
    app: FastAPI,
    text: TextTokenizer,
    max_model_len: int,
    accepted: Collection[str],
    served: str,
) -> None:
    """Add `/tokenize`, `/detokenize` and `/decode` for the model whose tokenizer is `text`."""
    tok = text.tokenizer
    vocab = len(tok)

    def check_ids(ids: list[int]) -> None:
        if ids and max(ids) >= vocab:
            raise BadInput(f"token ids must be in [0, {vocab}) for this model's tokenizer")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        """vLLM's shape (`prompt` or `messages`) or TEI's (`inputs`), told apart by the body."""
        check_model(body.model, accepted, served)
        given = [x is not None for x in (body.prompt, body.messages, body.inputs)]
        if sum(given) != 1:
            raise BadInput("give exactly one of prompt, messages (vLLM) or inputs (TEI)")
        if body.inputs is not None:
            texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
            tokens = await asyncio.to_thread(_tei_tokens, tok, texts, body.add_special_tokens)
            return JSONResponse(tokens)
        if body.messages is not None:
            if not text.has_chat_template:
                raise BadInput("this model has no chat template: send prompt instead")
            ids = await asyncio.to_thread(_chat_ids, tok, body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None
            ids = await asyncio.to_thread(_ids, tok, body.prompt, body.add_special_tokens)
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": max_model_len,
            "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        }
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        """vLLM's shape: the text of `tokens` (special tokens kept)."""
        check_model(body.model, accepted, served)
        check_ids(body.tokens)
        prompt = await asyncio.to_thread(tok.decode, body.tokens)
        return JSONResponse({"prompt": prompt})

    @app.post("/decode")
    async def decode(body: DecodeRequest) -> JSONResponse:
        """TEI's shape: one text per id list (special tokens skipped unless asked)."""
        lists = cast(
            "list[list[int]]",
            [body.ids] if body.ids and isinstance(body.ids[0], int) else body.ids,
        )
        for ids in lists:
            check_ids(ids)
        texts = await asyncio.to_thread(
            tok.batch_decode, lists, skip_special_tokens=body.skip_special_tokens
        )
        return JSONResponse(list(texts))


def _ids(tok: Any, prompt: str, special: bool) -> list[int]:
    return [int(x) for x in tok(prompt, add_special_tokens=special)["input_ids"]]


def _chat_ids(tok: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    try:
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
    except Exception as exc:
        raise BadInput(
            f"the chat template could not render messages ({type(exc).__name__})"
        ) from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(x) for x in ids]


def _tei_tokens(tok: Any, texts: list[str], special: bool) -> list[list[dict[str, Any]]]:
    """TEI's `SimpleToken`s of each text: id, its text, whether special, character offsets
    (start and stop are null for a special token, which covers no text)."""
    enc = tok(texts, add_special_tokens=special, return_offsets_mapping=True)
    specials = set(tok.all_special_ids)
    out = []
    for text, ids, offsets in zip(texts, enc["input_ids"], enc["offset_mapping"], strict=True):
        row = []
        for i, (start, stop) in zip(ids, offsets, strict=True):
            special_token = int(i) in specials
            piece = tok.convert_ids_to_tokens(int(i)) if special_token else text[start:stop]
            row.append(
                {
                    "id": int(i),
                    "text": piece,
                    "special": special_token,
                    "start": None if special_token else int(start),
                    "stop": None if special_token else int(stop),
                }
            )
        out.append(row)
    return out
