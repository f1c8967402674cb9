"""The OpenAI handlers' shared half: reading a request, its budget and sampling, handing the job
to the GPU thread, waiting for a whole answer, usage, and JSON responses (openai_routes.py has
the handlers, openai_replies.py the reply objects, openai_streams.py the SSE relays)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from mlxd.engine.gpu.job import Job, PrefillGroup, SamplingParams
from mlxd.engine.gpu.sampling import PENALTY_CONTEXT, XTC_THRESHOLD
from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.http.admission import Slot
from mlxd.engine.http.keys import ADMISSION, GATEWAY, SETTINGS
from mlxd.engine.models.adapter_bank import Stack
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.models.vision import MediaPrompt
from mlxd.protocol import openai as oa
from mlxd.protocol import sampling
from mlxd.protocol.curve import curve_problem, resolve_hlg
from mlxd.protocol.errors import APIError
from mlxd.protocol.events import Done, Failed, Token, TokenLogprob
from mlxd.protocol.json_body import decode_as
from mlxd.protocol.process import ADAPTER_HEADER, PRIORITY_HEADER, USAGE_HEADER, RequestUsage

T = TypeVar("T")
LEGACY_COMPLETION_MAX_TOKENS = 16


async def decode_body(request: web.Request, kind: type[T], empty: T | None = None) -> T:
    """Read and decode a JSON body into `kind` (`empty` for no body, if given); a 400 as `decode_as` says."""
    body = await request.read()
    if empty is not None and not body.strip():
        return empty
    return decode_as(body, kind)


def ready_model(request: web.Request) -> LoadedModel:
    """The loaded model, or 503 while it is still loading (a 400 from an embedding model's engine)."""
    gateway = request.app[GATEWAY]
    if gateway.serves == "embeddings":
        model = request.app[SETTINGS].model_id
        raise APIError(400, f"Model {model} is an embedding model: it serves /v1/embeddings, not {request.path}.",
                       param="model", code="model_not_supported")
    loaded = gateway.loaded
    if loaded is None:
        raise APIError(
            503, "The model is still loading.", type="server_error", code="loading",
            headers={"Retry-After": "1"},
        )
    return loaded


def resolve_max_tokens(
    requested: int | None, num_prompt: int, window: int, default: int | None, kv_budget: int | None = None
) -> int:
    """The completion budget: what the caller asked for, clamped to what the context leaves.

    The room is the window, or the engine's KV budget (`kv_budget` tokens, which bounds what
    one sequence can book) if that ends first, less the prompt. Without `max_tokens`, a reply
    may run to the end of it; a `max_tokens` past it is clamped to it (agents send the API's
    largest, 32000 say, to any model: the reply then ends with `length`). Only a prompt that
    fills the window by itself is a 400.
    """
    if num_prompt >= window:
        raise APIError(
            400, f"The prompt is {num_prompt} tokens, but the model's context window is {window} tokens.",
            param="messages", code="context_length_exceeded",
        )
    room = window - num_prompt if kv_budget is None else max(1, min(window, kv_budget) - num_prompt)
    if requested is None:
        return min(default, room) if default else room
    return min(requested, room)


def sampling_params(req: oa.SamplingFields, loaded: LoadedModel) -> SamplingParams:
    """Request values, else the model's generation_config defaults, else mlxd's (protocol.sampling)."""
    d = sampling.in_use(loaded.generation_defaults, loaded.configured)
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    bad = [t for t in bias if not 0 <= t < loaded.vocab_size]
    if bad:
        raise APIError(400, f"logit_bias token id {bad[0]} is outside the vocabulary.", param="logit_bias")

    curve = None
    if req.curve is not None:
        if why := curve_problem(req.curve.points):
            raise APIError(400, f"{why}.", param="curve")
        curve = tuple((float(u), float(y)) for u, y in req.curve.points)
    hlg = None if curve is not None else resolve_hlg(req.hlg, loaded.configured.hlg)
    if curve is not None or hlg is not None:
        # The curve replaces temperature, and the truncations apply only where the request sets them
        d = {**d, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}

    def pick(value: float | None, key: str) -> float:
        return float(value) if value is not None else d[key]

    top_k = int(pick(req.top_k, "top_k"))
    return SamplingParams(
        temperature=1.0 if curve is not None or hlg is not None else pick(req.temperature, "temperature"),
        top_p=pick(req.top_p, "top_p"),
        top_k=top_k if top_k < loaded.vocab_size else 0,  # keeping every token is no top-k at all
        min_p=pick(req.min_p, "min_p"),
        seed=req.seed,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else d.get("repetition_penalty"),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=bias,
        repetition_context_size=req.repetition_context_size or PENALTY_CONTEXT,
        presence_context_size=req.presence_context_size or PENALTY_CONTEXT,
        frequency_context_size=req.frequency_context_size or PENALTY_CONTEXT,
        xtc_probability=req.xtc_probability or 0.0,
        xtc_threshold=req.xtc_threshold if req.xtc_threshold is not None else XTC_THRESHOLD,
        xtc_exempt=loaded.xtc_exempt if req.xtc_probability else (),
        curve=curve,
        hlg=hlg,
    )


def adapter_stack(request: web.Request, req: oa.SamplingFields, loaded: LoadedModel) -> Stack:
    """The adapters the request runs under: the supervisor's resolved ADAPTER_HEADER, else the
    body's `adapter`; a 400 naming one that is not loaded."""
    spec = request.headers.get(ADAPTER_HEADER, req.adapter)
    try:
        return loaded.adapters.resolve(spec)
    except ValueError as exc:
        raise APIError(400, f"{exc}.", param="adapter", code="adapter_not_found") from None


def header_priority(request: web.Request) -> int:
    """The priority the supervisor sends for the caller's key (PRIORITY_HEADER), else 0."""
    try:
        return int(request.headers.get(PRIORITY_HEADER, "0"))
    except ValueError:
        return 0


def submit(request: web.Request, slot: Slot, prompt: list[int], max_tokens: int, req: oa.SamplingFields,
           grammar: Any = None, logprobs: int | None = None, row: int = 0, group: PrefillGroup | None = None,
           media: MediaPrompt | None = None, continues_text: bool = False, resumed: list[int] | None = None,
           grammar_text: str | None = None) -> Ticket:
    """Hand a job to the GPU thread; return the handler's ticket for it. `row` > 0: another
    choice of the same request (a seed is offset by it, so seeded choices differ too); the
    choices share `group`, so their prompt is prefilled once. `resumed`: the reply's tokens
    already delivered (http/resume.py), run as the prompt's end and counted in `max_tokens`."""
    loaded = ready_model(request)
    ticket = Ticket(asyncio.get_running_loop())
    sampling = sampling_params(req, loaded)
    if row and sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=(sampling.seed + row + 2**63) % 2**64 - 2**63)
    resumed = resumed or []
    job = Job(list(prompt) + resumed, max_tokens - len(resumed), sampling, oa.stop_list(req.stop), ticket, grammar=grammar, logprobs=logprobs,
              group=group, priority=req.priority if req.priority is not None else header_priority(request), media=media,
              adapters=adapter_stack(request, req, loaded), continues_text=continues_text,
              # XTC's draws are not a distribution drafts can be checked against: such rows decode plainly
              speculate=req.speculation is not False and not (sampling.xtc_probability and sampling.temperature),
              resumed=len(resumed), grammar_text=grammar_text if grammar is not None else None)
    slot.enter_gpu()
    request.app[GATEWAY].submit(job)
    return ticket


AdmittedHandler = Callable[[web.Request, Slot], Awaitable[web.StreamResponse]]


def admitted(handler: AdmittedHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Run an inference handler inside an admission slot (held until the response, stream included, ends)."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        with request.app[ADMISSION].admit(request.headers) as slot:
            return await handler(request, slot)

    return wrapper


def summary_of(done: Done, *more: Done) -> RequestUsage:
    """The request's cost, for the supervisor (process.USAGE_HEADER / USAGE_COMMENT)."""
    every = (done, *more)
    return RequestUsage(
        done.prompt_tokens, done.cached_tokens, sum(d.completion_tokens for d in every), done.queue_ms,
        done.prefill_ms, max(d.decode_ms for d in every), done.finish_reason, sum(d.paused for d in every),
        sum(d.speculation.proposed for d in every if d.speculation is not None),
        sum(d.speculation.accepted for d in every if d.speculation is not None), sum(d.resumed for d in every),
    )


def usage_headers(done: Done, *more: Done) -> dict[str, str]:
    """A whole answer's usage header."""
    return {USAGE_HEADER: _encoder.encode(summary_of(done, *more)).decode()}


def usage_of(done: Done, *more: Done) -> oa.Usage:
    """OpenAI usage from the Done events of a request's choices (the prompt counted once)."""
    completion = done.completion_tokens + sum(d.completion_tokens for d in more)
    drafted = [d.speculation for d in (done, *more) if d.speculation is not None]
    speculation = (oa.SpeculationUsage(sum(x.proposed for x in drafted), sum(x.accepted for x in drafted))
                   if drafted else None)
    return oa.Usage(
        done.prompt_tokens, completion, done.prompt_tokens + completion, oa.PromptTokensDetails(done.cached_tokens),
        speculation,
    )


async def collect(ticket: Ticket) -> tuple[str, Done, list[TokenLogprob]]:
    """Wait for a whole generation (its text, end, and token log probabilities if asked for);
    raise an APIError if it failed."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async for batch in ticket.events():
        for e in batch:
            if isinstance(e, Token):
                parts.append(e.text)
                logprobs += e.logprobs or []
        end = batch[-1]
        if isinstance(end, Failed):
            raise APIError(end.status, end.message, type="server_error", code=end.code)
        if isinstance(end, Done):
            if end.finish_reason == "cancelled":
                raise APIError(503, "The engine is shutting down.", type="server_error", code="engine_stopping")
            return "".join(parts), end, logprobs
    raise APIError(500, "generation ended without a result", type="server_error")


@contextlib.contextmanager
def cancel_all_on_exit(tickets: list[Ticket]) -> Iterator[list[Ticket]]:
    """Cancel every choice's job still running when the handler leaves."""
    try:
        yield tickets
    finally:
        for ticket in tickets:
            if not ticket.is_finished:
                ticket.cancel()


@contextlib.contextmanager
def cancel_on_exit(ticket: Ticket) -> Iterator[Ticket]:
    """Cancel the job if the handler leaves early (a client disconnect cancels the handler)."""
    try:
        yield ticket
    finally:
        if not ticket.is_finished:
            ticket.cancel()


_encoder = msgspec.json.Encoder()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with msgspec."""
    return web.Response(body=_encoder.encode(obj), status=status, content_type="application/json", headers=headers)
