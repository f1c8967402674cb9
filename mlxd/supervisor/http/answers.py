"""The supervisor's own JSON answers: a Struct from mlxd/protocol/, the type the OpenAPI document
is generated from, encoded by msgspec (a dict has no schema to drift from, so none is taken)."""

from __future__ import annotations

import msgspec
from aiohttp import web

_encoder = msgspec.json.Encoder()


def json_answer(answer: msgspec.Struct, status: int = 200) -> web.Response:
    """`answer` as `application/json; charset=utf-8` (the header aiohttp's json_response sent)."""
    return web.Response(status=status, body=_encoder.encode(answer), content_type="application/json",
                        charset="utf-8")
