"""What the relay records on a request, for the access log and metrics to read."""

from __future__ import annotations

from aiohttp import web

from mlxd.protocol.process import RequestUsage
from mlxd.supervisor.relay.dialect import Dialect
from mlxd.supervisor.relay.resume import ReplyMarks

MODEL_KEY = web.RequestKey("mlxd.model", str)  # the model id a handler routed to
FIRST_CHUNK_KEY = web.RequestKey("mlxd.first_chunk", float)  # perf_counter() when the first streamed event went out
USAGE_KEY = web.RequestKey("mlxd.usage", RequestUsage)  # the engine's report of the answer relayed (if any)
DIALECT_KEY = web.RequestKey("mlxd.dialect", Dialect)  # the API the route answers in (its own instance)
RESUMES_KEY = web.RequestKey("mlxd.resumes", ReplyMarks)  # a request whose engine died under it: how it went on
MARKS_KEY = web.RequestKey("mlxd.marks", ReplyMarks)  # a stream that can go on: the reply's token ids so far
