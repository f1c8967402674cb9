"""POST /v1/embeddings on the engine: tokenize on the executor, embed on the GPU thread (gateway.py)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
from aiohttp import web

from mlxd.engine.embed.gateway import EmbedGateway
from mlxd.engine.http.admission import Slot
from mlxd.engine.http.keys import GATEWAY, SETTINGS
from mlxd.engine.http.openai_requests import admitted, decode_body, json_response
from mlxd.protocol.embeddings import (
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    encode_vector,
    inputs_of,
)
from mlxd.protocol.errors import APIError
from mlxd.protocol.process import USAGE_HEADER, RequestUsage

_encoder = msgspec.json.Encoder()


@admitted
async def embeddings(request: web.Request, slot: Slot) -> web.StreamResponse:
    """POST /v1/embeddings."""
    started = time.perf_counter()
    req = await decode_body(request, EmbeddingRequest)
    gateway = request.app[GATEWAY]
    model_id = request.app[SETTINGS].model_id
    if not isinstance(gateway, EmbedGateway):
        raise APIError(400, f"Model {model_id} is not an embedding model: it generates text. Embeddings come from "
                       "an embedding model (a sentence-transformers dir, or an encoder such as BERT).",
                       param="model", code="model_not_supported")
    model = gateway.embedder
    if model is None:
        raise APIError(503, "The model is still loading.", type="server_error", code="loading",
                       headers={"Retry-After": "1"})
    inputs = inputs_of(req)
    if req.dimensions is not None and req.dimensions > model.dimensions:
        raise APIError(400, f"dimensions is {req.dimensions}; model {model_id} makes vectors of {model.dimensions}.",
                       param="dimensions")
    rows = await asyncio.get_running_loop().run_in_executor(None, model.tokenize, inputs, req.truncate)
    slot.enter_gpu()
    queued = time.perf_counter()
    vectors = await asyncio.wrap_future(gateway.embed(rows))
    embedded = time.perf_counter()
    if req.dimensions is not None and req.dimensions < vectors.shape[-1]:
        vectors = vectors[:, : req.dimensions]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    data = [Embedding(i, encode_vector(v.tobytes() if req.encoding_format == "base64" else v.tolist(),
                                       req.encoding_format))
            for i, v in enumerate(vectors)]
    tokens = sum(len(r) for r in rows)
    usage = RequestUsage(tokens, 0, 0, round((queued - started) * 1000, 3), 0.0,
                         round((embedded - queued) * 1000, 3), "stop")
    return json_response(EmbeddingList(data, model_id, EmbeddingUsage(tokens, tokens)),
                         headers={USAGE_HEADER: _encoder.encode(usage).decode()})
