"""OpenAI's embeddings protocol as lenbatch speaks it: the request body of `POST /v1/embeddings`
and how vectors are encoded in the answer."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

__all__ = ["EmbeddingRequest", "Input", "dumps", "encode_vector"]

_Text = Annotated[StrictStr, Field(min_length=1)]
_TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Input = Annotated[
    _Text
    | Annotated[list[_Text], Field(min_length=1)]
    | _TokenIds
    | Annotated[list[_TokenIds], Field(min_length=1)],
    Field(description="Text, list of texts, token ids, or list of token-id lists."),
]


class EmbeddingRequest(BaseModel):
    """Body of `POST /v1/embeddings`, as in OpenAI's API, plus TEI's `truncate` and
    `prompt_name` and Cohere's `input_type`."""

    model_config = ConfigDict(extra="ignore")

    input: Input
    model: str | None = Field(None, description="Model name; must match the served model.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`float` lists or `base64` little-endian float32."
    )
    dimensions: int | None = Field(
        None,
        ge=1,
        description="Keep the first N components of each vector (Matryoshka), re-normalised "
        "when the model normalises; at most the model's width.",
    )
    prompt_name: str | None = Field(
        None,
        description="Name of one of the model's sentence-transformers prompts, put before "
        "each text (its tokens count in usage).",
    )
    input_type: str | None = Field(
        None,
        description="Cohere's input type (search_query, search_document, classification, "
        "clustering), mapped to the model's prompt of that name or the usual one for it.",
    )
    user: str | None = Field(None, description="Ignored; accepted for compatibility.")
    truncate: bool | None = Field(
        None, description="Cut inputs over the model limit instead of rejecting them."
    )
    priority: StrictInt | None = Field(
        None,
        description="Priority level, 0 (the default) to the server's priority_levels - 1; "
        "higher runs first. Overrides the X-Priority header.",
    )


def encode_vector(vec: np.ndarray[Any, Any], fmt: str) -> Any:
    """One vector as the answer carries it: the float32 array itself for `float` (orjson
    writes it, shortest round-trip digits, no Python float list in between), or base64 of
    little-endian float32 read straight from the array's buffer."""
    if fmt == "base64":
        buf = np.ascontiguousarray(vec, dtype="<f4")  # no copy when it already is
        return base64.b64encode(buf.data).decode("ascii")
    return np.ascontiguousarray(vec, dtype=np.float32)


def dumps(payload: Any) -> bytes:
    """The answer's JSON: orjson, numpy arrays written natively."""
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
