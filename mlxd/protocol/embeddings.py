"""OpenAI's embeddings API (`POST /v1/embeddings`): the request, its checks, and the answer.

`input` is a string, a list of strings, a list of token ids, or a list of such lists (at most
MAX_INPUTS of them). `dimensions` keeps the first N numbers of each vector, made unit length
again (Matryoshka-trained models keep their meaning so; others lose some). `encoding_format`
`base64` packs each vector as little-endian float32 bytes (what OpenAI's SDKs ask for by
default and unpack). mlxd's own `truncate`: an input longer than the model's window is cut to
it instead of refused (Ollama's `/api/embed` asks for that). Pure: the engine tokenizes and
runs it, the supervisor only relays it.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal, cast

import msgspec
from msgspec import Meta

from mlxd.protocol.errors import APIError

MAX_INPUTS = 2048  # OpenAI's limit on a batch's inputs

# A string, or a list of strings, of token ids, or of token-id lists (msgspec decodes one list
# type in a union: what the list holds is checked by `inputs_of`).
EmbeddingInput = str | list[str | int | list[int]]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)] | None = None
    input: EmbeddingInput
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    truncate: bool = False  # mlxd's: cut an input longer than the window instead of a 400


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


Inputs = list[str] | list[list[int]]


def inputs_of(req: EmbeddingRequest) -> Inputs:
    """The request's inputs as a list of texts or a list of token-id lists; a 400 for an empty
    input, an empty text or token list, or more than MAX_INPUTS."""
    value = req.input
    items: Inputs
    if isinstance(value, str):
        items = [value]
    elif all(isinstance(v, int) for v in value):
        items = [cast(list[int], value)] if value else []  # one input of token ids
    elif all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
        items = cast(Inputs, value)
    else:
        raise APIError(400, "input must be a string, or a list of strings, of token ids, or of token-id lists "
                       "(not a mix).", param="input")
    if not items:
        raise APIError(400, "input must not be empty.", param="input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input has {len(items)} items; at most {MAX_INPUTS} are taken in one request.",
                       param="input")
    for i, item in enumerate(items):
        if len(item) == 0:
            where = "input" if len(items) == 1 else f"input[{i}]"
            raise APIError(400, f"{where} is empty; each input needs at least one character or token.", param="input")
    return items


def encode_vector(vector: list[float] | bytes, fmt: Literal["float", "base64"]) -> list[float] | str:
    """One vector in the asked format: `vector` as floats, or (base64) its float32 bytes."""
    if fmt == "base64":
        assert isinstance(vector, bytes)
        return base64.b64encode(vector).decode("ascii")
    assert isinstance(vector, list)
    return vector
