"""OpenAI-compatible handlers of the engine: chat and text completions, streaming or not."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from mlxd.engine.chat.grammar import forced_call_grammar, response_format_grammar
from mlxd.engine.chat.reasoning import ReasoningSplitter, ThinkMarkers, starts_in_reasoning
from mlxd.engine.chat.tool_stream import Call, Content, Event, Markup, ToolCallStream
from mlxd.engine.chat.tools import ToolFormat, ToolRequest, check_tools, template_messages
from mlxd.engine.gpu.job import Job, PrefillGroup, SamplingParams
from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.http.admission import Slot
from mlxd.engine.http.keys import ADMISSION, GATEWAY
from mlxd.engine.http.sse import SSEWriter, keepalive_interval
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.protocol import openai as oa
from mlxd.protocol.errors import APIError
from mlxd.protocol.events import Done, Failed, Token, TokenLogprob
from mlxd.protocol.json_body import decode_as
from mlxd.protocol.process import USAGE_HEADER, RequestUsage

T = TypeVar("T")
LEGACY_COMPLETION_MAX_TOKENS = 16
KEEPALIVE_S = keepalive_interval()


async def decode_body(request: web.Request, kind: type[T], empty: T | None = None) -> T:
    """Read and decode a JSON body into `kind` (`empty` for no body, if given); a 400 as `decode_as` says."""
    body = await request.read()
    if empty is not None and not body.strip():
        return empty
    return decode_as(body, kind)


def ready_model(request: web.Request) -> LoadedModel:
    """The loaded model, or 503 while it is still loading."""
    loaded = request.app[GATEWAY].loaded
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
    """Request values, else the model's generation_config defaults, else OpenAI's."""
    d = loaded.generation_defaults
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    bad = [t for t in bias if not 0 <= t < loaded.vocab_size]
    if bad:
        raise APIError(400, f"logit_bias token id {bad[0]} is outside the vocabulary.", param="logit_bias")

    def pick(value: float | None, key: str, default: float) -> float:
        return float(value) if value is not None else d.get(key, default)

    top_k = int(pick(req.top_k, "top_k", 0))
    return SamplingParams(
        temperature=pick(req.temperature, "temperature", 1.0),
        top_p=pick(req.top_p, "top_p", 1.0),
        top_k=top_k if top_k < loaded.vocab_size else 0,  # keeping every token is no top-k at all
        min_p=pick(req.min_p, "min_p", 0.0),
        seed=req.seed,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else d.get("repetition_penalty"),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=bias,
    )


def submit(request: web.Request, slot: Slot, prompt: list[int], max_tokens: int, req: oa.SamplingFields,
           grammar: Any = None, logprobs: int | None = None, row: int = 0, group: PrefillGroup | None = None) -> Ticket:
    """Hand a job to the GPU thread; return the handler's ticket for it. `row` > 0: another
    choice of the same request (a seed is offset by it, so seeded choices differ too); the
    choices share `group`, so their prompt is prefilled once."""
    loaded = ready_model(request)
    ticket = Ticket(asyncio.get_running_loop())
    sampling = sampling_params(req, loaded)
    if row and sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=(sampling.seed + row + 2**63) % 2**64 - 2**63)
    job = Job(list(prompt), max_tokens, sampling, oa.stop_list(req.stop), ticket, grammar=grammar, logprobs=logprobs,
              group=group)
    slot.enter_gpu()
    request.app[GATEWAY].submit(job)
    return ticket


def summary_of(done: Done, *more: Done) -> RequestUsage:
    """The request's cost, for the supervisor (process.USAGE_HEADER / USAGE_COMMENT)."""
    every = (done, *more)
    return RequestUsage(
        done.prompt_tokens, done.cached_tokens, sum(d.completion_tokens for d in every), done.queue_ms,
        done.prefill_ms, max(d.decode_ms for d in every), done.finish_reason,
    )


def usage_headers(done: Done, *more: Done) -> dict[str, str]:
    """A whole answer's usage header."""
    return {USAGE_HEADER: _encoder.encode(summary_of(done, *more)).decode()}


def usage_of(done: Done, *more: Done) -> oa.Usage:
    """OpenAI usage from the Done events of a request's choices (the prompt counted once)."""
    completion = done.completion_tokens + sum(d.completion_tokens for d in more)
    return oa.Usage(
        done.prompt_tokens, completion, done.prompt_tokens + completion, oa.PromptTokensDetails(done.cached_tokens),
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


AdmittedHandler = Callable[[web.Request, Slot], Awaitable[web.StreamResponse]]


def admitted(handler: AdmittedHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Run an inference handler inside an admission slot (held until the response, stream included, ends)."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        with request.app[ADMISSION].admit(request.headers) as slot:
            return await handler(request, slot)

    return wrapper


@admitted
async def chat_completions(request: web.Request, slot: Slot) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    req = await decode_body(request, oa.ChatCompletionRequest)
    oa.check_chat(req)
    loaded = ready_model(request)
    chat = await asyncio.get_running_loop().run_in_executor(TEMPLATING, render_chat, loaded, req)
    tool_req, fmt, forced, prompt, in_reasoning = chat.tool_req, chat.fmt, chat.forced, chat.prompt, chat.in_reasoning
    budget = req.max_completion_tokens or req.max_tokens
    max_tokens = resolve_max_tokens(budget, len(prompt), loaded.context_window, None, request.app[GATEWAY].kv_budget)
    grammars = await constraints(loaded, req, tool_req, fmt, forced)
    top = (req.top_logprobs or 0) if req.logprobs else None
    meta = ("chatcmpl-" + uuid.uuid4().hex, int(time.time()), loaded.model_id)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    replies = [ChatReply(*meta, tool_req=tool_req, markup=fmt.markup, forced=forced, think=loaded.think_markers,
                         in_reasoning=in_reasoning, index=i) for i in range(req.n)]
    tickets: list[Ticket] = []
    with cancel_all_on_exit(tickets):  # rows submitted before a later one is refused are cancelled too
        group = PrefillGroup(req.n, len(prompt) - 1) if req.n > 1 else None
        for i in range(req.n):
            tickets.append(submit(request, slot, prompt, max_tokens, req, grammars[i], top, row=i, group=group))
        if req.stream:
            if req.n == 1:
                return await stream(request, tickets[0], replies[0], include_usage)
            return await stream_choices(request, tickets, replies, include_usage)
        results = await asyncio.gather(*(collect(t) for t in tickets))
        choices = []
        for i, (reply, (text, done, logprobs)) in enumerate(zip(replies, results, strict=True)):
            reply.text(text)
            message, finish = reply.message(done)
            choices.append(oa.ChatChoice(i, message, finish, chat_logprobs(logprobs) if req.logprobs else None,
                                         done.stop_sequence))
        dones = [r[1] for r in results]
        return json_response(oa.ChatCompletion(*meta, choices=choices, usage=usage_of(*dones)), headers=usage_headers(*dones))


# Chat templates are rendered (and prompts tokenized) on this thread: off the event loop, and
# one at a time (a Hugging Face tokenizer is not meant to be used from two threads at once).
TEMPLATING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxd-template")


@dataclasses.dataclass(frozen=True, slots=True)
class RenderedChat:
    prompt: list[int]  # token ids, a forced call's start included
    tool_req: ToolRequest | None
    fmt: ToolFormat
    forced: str  # the start of a call put after the template's prompt ("" for none)
    in_reasoning: bool  # the prompt ends inside an open think block


def render_chat(loaded: LoadedModel, req: oa.ChatCompletionRequest) -> RenderedChat:
    """A chat request's prompt as the model gets it (a 400 for what cannot be rendered).
    Blocking: run it on TEMPLATING."""
    tool_req = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    fmt = loaded.tool_format
    messages = template_messages([chat_message_dict(m, i) for i, m in enumerate(req.messages)], fmt,
                                 tool_req.tools if tool_req else None)
    kwargs = {"reasoning_effort": req.reasoning_effort} if req.reasoning_effort is not None else {}
    prompt = loaded.chat_prompt(messages, tool_req.tools if tool_req and fmt.in_template else None,
                                {**kwargs, **(req.chat_template_kwargs or {})})
    if not prompt:
        raise APIError(400, "The chat template produced an empty prompt.", param="messages")
    forced = forced_call(tool_req, fmt)
    prompt += loaded.encode_text(forced) if forced else []
    think = loaded.think_markers
    in_reasoning = starts_in_reasoning(loaded.decode(prompt[-64:]), think) if think is not None and not forced else False
    return RenderedChat(prompt, tool_req, fmt, forced, in_reasoning)


async def render(request: web.Request) -> web.Response:
    """POST /v1/chat/render: a chat request's prompt, rendered and tokenized without generating
    (for counting tokens: Anthropic's count_tokens, admission). The body is a chat request."""
    req = await decode_body(request, oa.ChatCompletionRequest)
    oa.check_chat(req)
    loaded = ready_model(request)
    chat = await asyncio.get_running_loop().run_in_executor(TEMPLATING, render_chat, loaded, req)
    return json_response(oa.RenderedPrompt(len(chat.prompt), chat.prompt, loaded.decode(chat.prompt),
                                           loaded.context_window, loaded.model_id))


async def constraints(loaded: LoadedModel, req: oa.ChatCompletionRequest, tool_req: ToolRequest | None,
                      fmt: ToolFormat, forced: str) -> list[Any]:
    """For each of the `n` rows, the llguidance matcher its reply is held to, or None: a forced
    tool call's arguments to the function's schema, else `response_format`. Compiled in a
    worker thread (once; cached), a matcher a row."""
    if forced and tool_req is not None:
        text = forced_call_grammar(fmt.name, tool_req.tools, tool_req.forced_function, fmt.markup.end)
        param = "tools"
    else:
        text = response_format_grammar(req.response_format)
        param = "response_format"
    if text is None:
        return [None] * req.n
    loop = asyncio.get_running_loop()
    return [await loop.run_in_executor(None, loaded.grammars.matcher, text, param) for _ in range(req.n)]


def forced_call(tool_req: ToolRequest | None, fmt: ToolFormat) -> str:
    """The start of a call put after the prompt for tool_choice `required` or a named function
    (a 400 where the model's tool format cannot be steered so)."""
    if tool_req is None or tool_req.choice not in ("required", "function"):
        return ""
    forced = fmt.forced(tool_req.forced_function)
    if forced is None:
        what = f"naming a function ({tool_req.function!r})" if tool_req.function else "'required'"
        raise APIError(400, f"tool_choice {what} is not supported with this model's tool format ({fmt.name}); "
                            "use 'auto'.", param="tool_choice")
    return forced


@admitted
async def completions(request: web.Request, slot: Slot) -> web.StreamResponse:
    """POST /v1/completions (a raw prompt, no chat template)."""
    req = await decode_body(request, oa.CompletionRequest)
    oa.check_completion(req)
    loaded = ready_model(request)
    prompt = loaded.text_prompt(oa.completion_prompt(req))
    if not prompt:
        raise APIError(400, "The prompt is empty.", param="prompt")
    max_tokens = resolve_max_tokens(
        req.max_tokens, len(prompt), loaded.context_window, LEGACY_COMPLETION_MAX_TOKENS, request.app[GATEWAY].kv_budget
    )
    ticket = submit(request, slot, prompt, max_tokens, req, logprobs=req.logprobs)
    meta = ("cmpl-" + uuid.uuid4().hex, int(time.time()), loaded.model_id)
    echo = loaded.decode(prompt) if req.echo else ""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    with cancel_on_exit(ticket):
        if req.stream:
            return await stream(request, ticket, TextReply(*meta, echo=echo, logprobs=req.logprobs), include_usage)
        text, done, logprobs = await collect(ticket)
        lp = text_logprobs(logprobs, len(echo), req.logprobs) if req.logprobs is not None else None
        choice = oa.TextChoice(0, echo + text, done.finish_reason, lp, done.stop_sequence)
        return json_response(oa.Completion(*meta, choices=[choice], usage=usage_of(done)), headers=usage_headers(done))


def chat_message_dict(msg: oa.ChatMessage, index: int) -> dict[str, Any]:
    """A message as the chat template expects it (developer -> system, text parts joined)."""
    out: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role}
    out["content"] = oa.message_text(msg, index) or ""
    for key in ("name", "tool_calls", "tool_call_id"):
        if (value := getattr(msg, key)) is not None:
            out[key] = value
    return out


class ChatReply:
    """One chat reply as it streams: the text goes through the tool-call parser when the
    request has tools, and comes out as chat.completion.chunk objects (or, at the end, as
    one message)."""

    def __init__(self, cid: str, created: int, model: str, *, tool_req: ToolRequest | None = None,
                 markup: Markup | None = None, forced: str = "", think: ThinkMarkers | None = None,
                 in_reasoning: bool = False, index: int = 0) -> None:
        self._meta = (cid, created, model)
        self.index = index
        self._tools = tool_req
        self._parser = (ToolCallStream(markup, tool_req.tools, tool_names=tool_req.names)
                        if tool_req is not None and markup is not None else None)
        # a forced call starts the reply: no reasoning before it
        self._splitter = ReasoningSplitter(think, in_reasoning) if think is not None and not forced else None
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[Call] = []
        self._logprobs: list[TokenLogprob] = []  # not yet sent: they go with the next chunk
        if self._parser is not None and forced:
            self._take(self._parser.feed(forced))

    def opening(self) -> list[Any]:
        return [self._chunk(oa.Delta(role="assistant", content=""))]

    def text(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[Any]:
        if self._splitter is None:
            chunks = self._answer(text)
        else:
            reasoning, content = self._splitter.feed(text)
            chunks = self._think(reasoning) + self._answer(content)
        return self._with_logprobs(chunks, logprobs)

    def closing(self, done: Done) -> list[Any]:
        chunks = [*self._flush(), self._chunk(oa.Delta(), self.finish_reason(done), done.stop_sequence)]
        return self._with_logprobs(chunks, None)

    def _with_logprobs(self, chunks: list[Any], logprobs: list[TokenLogprob] | None) -> list[Any]:
        """The tokens' log probabilities ride on the first chunk their text made (or a later one)."""
        self._logprobs += logprobs or []
        if chunks and self._logprobs:
            chunks[0].choices[0].logprobs = chat_logprobs(self._logprobs)
            self._logprobs = []
        return chunks

    def _flush(self) -> list[Any]:
        chunks: list[Any] = []
        if self._splitter is not None:
            reasoning, content = self._splitter.finish()
            chunks += self._think(reasoning) + self._answer(content)
        if self._parser is not None:
            chunks += self._take(self._parser.finish())
        return chunks

    def _think(self, text: str) -> list[Any]:
        if not text:
            return []
        self._reasoning.append(text)
        return [self._chunk(oa.Delta(reasoning_content=text))]

    def _answer(self, text: str) -> list[Any]:
        if self._parser is not None:
            return self._take(self._parser.feed(text))
        if not text:
            return []
        self._content.append(text)
        return [self._chunk(oa.Delta(content=text))]

    def usage(self, usage: oa.Usage) -> Any:
        return oa.ChatCompletionChunk(*self._meta, [], usage)

    def finish_reason(self, done: Done) -> str:
        return "tool_calls" if self._calls and done.finish_reason in ("stop", "length") else done.finish_reason

    def message(self, done: Done) -> tuple[oa.AssistantMessage, str]:
        """The whole reply (non-streaming), after `text` got all of it."""
        self._flush()
        content = "".join(self._content)
        reasoning = "".join(self._reasoning) or None
        if not self._calls:
            return oa.AssistantMessage("assistant", content, reasoning_content=reasoning), done.finish_reason
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in self._calls]
        return (oa.AssistantMessage("assistant", content or None, tool_calls=calls, reasoning_content=reasoning),
                self.finish_reason(done))

    def _take(self, events: list[Event]) -> list[Any]:
        chunks: list[Any] = []
        for e in events:
            if isinstance(e, Content):
                self._content.append(e.text)
                chunks.append(self._chunk(oa.Delta(content=e.text)))
            elif self._tools is not None and not self._tools.parallel and self._calls:
                continue  # parallel_tool_calls: false keeps the first call
            else:
                self._calls.append(e)
                index = len(self._calls) - 1
                # OpenAI's streaming shape: id, type and name first, then the arguments
                chunks.append(self._chunk(oa.Delta(tool_calls=[{
                    "index": index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}])))
                chunks.append(self._chunk(oa.Delta(tool_calls=[{"index": index, "function": {"arguments": e.arguments}}])))
        return chunks

    def _chunk(self, delta: oa.Delta, finish: str | None = None, stop: str | None = None) -> Any:
        return oa.ChatCompletionChunk(*self._meta, [oa.ChunkChoice(self.index, delta, finish, stop_reason=stop)])


class TextReply:
    """A text completion as it streams (`echo` first)."""

    def __init__(self, cid: str, created: int, model: str, *, echo: str = "", logprobs: int | None = None) -> None:
        self._meta = (cid, created, model)
        self._echo = echo
        self._top = logprobs
        self._offset = len(echo)  # where the next token's text starts in the whole text

    def opening(self) -> list[Any]:  # text completions have no role-only opening chunk
        return [self._chunk(self._echo, None)] if self._echo else []

    def text(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[Any]:
        if not text:
            return []
        chunk = self._chunk(text, None)
        if self._top is not None:
            chunk.choices[0].logprobs = text_logprobs(logprobs or [], self._offset, self._top)
        self._offset += len(text)
        return [chunk]

    def closing(self, done: Done) -> list[Any]:
        return [self._chunk("", done.finish_reason, done.stop_sequence)]

    def usage(self, usage: oa.Usage) -> Any:
        return oa.Completion(*self._meta, [], usage)

    def _chunk(self, text: str, finish: str | None, stop: str | None = None) -> Any:
        return oa.Completion(*self._meta, [oa.TextChoice(0, text, finish, stop_reason=stop)])


Reply = ChatReply | TextReply


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for these tokens."""
    return {"content": [
        {"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.text.encode()),
         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top]}
        for lp in logprobs], "refusal": None}


def text_logprobs(logprobs: list[TokenLogprob], offset: int, top: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object; `offset`: where the first token's text starts."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.text)
    return {"tokens": [lp.text for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [dict(lp.top) for lp in logprobs] if top > 0 else None, "text_offset": offsets}


async def stream(request: web.Request, ticket: Ticket, reply: Reply, include_usage: bool) -> web.StreamResponse:
    """Relay a generation as OpenAI SSE chunks, ending with `data: [DONE]`."""
    sse = SSEWriter()
    resp = await sse.start(request)
    # The opening chunks go out with the first generated text, so a client's (and the
    # supervisor's) first chunk marks the first token.
    opening = reply.opening()
    try:
        await keep_alive_until_first_event(sse, ticket)
        async for batch in ticket.events():
            for chunk in opening:
                await sse.send(chunk)
            opening = []
            tokens = [e for e in batch if isinstance(e, Token)]
            logprobs = [lp for e in tokens for lp in e.logprobs or []]
            for chunk in reply.text("".join(e.text for e in tokens), logprobs):
                await sse.send(chunk)
            await finish_stream(sse, reply, batch[-1], include_usage)
    except ConnectionResetError:
        ticket.cancel()  # the client went away mid-stream
    return resp


async def keep_alive_until_first_event(sse: SSEWriter, ticket: Ticket) -> None:
    """While the job waits its turn, send an SSE comment every KEEPALIVE_S seconds.

    A request queued behind others would otherwise be silent until its first token, and a
    client's read timeout could end it. Written from this task only, so writes never interleave.
    """
    while not await ticket.wait_for_event(KEEPALIVE_S):
        await sse.comment("keep-alive")


async def finish_stream(sse: SSEWriter, reply: Reply, end: Any, include_usage: bool) -> None:
    """Write the closing events for a Done or Failed event; nothing for a Token."""
    if isinstance(end, Failed):
        await sse.send_error(APIError(end.status, end.message, type="server_error", code=end.code))
    elif isinstance(end, Done) and end.finish_reason == "cancelled":
        await sse.send_error(APIError(503, "The engine is shutting down.", type="server_error", code="engine_stopping"))
    elif isinstance(end, Done):
        for chunk in reply.closing(end):
            await sse.send(chunk)
        if include_usage:
            await sse.send(reply.usage(usage_of(end)))
        await sse.usage(summary_of(end))
        await sse.done()


async def stream_choices(request: web.Request, tickets: list[Ticket], replies: list[ChatReply],
                         include_usage: bool) -> web.StreamResponse:
    """Relay `n` choices as one SSE stream: each choice's chunks carry its index, in the order
    they come; a failure of any ends the stream with an error; usage (all choices) at the end."""
    sse = SSEWriter()
    resp = await sse.start(request)
    events: asyncio.Queue[tuple[int, list[Any] | None]] = asyncio.Queue()

    async def pump(i: int, ticket: Ticket) -> None:
        async for batch in ticket.events():
            await events.put((i, batch))
        await events.put((i, None))

    pumps = [asyncio.create_task(pump(i, t)) for i, t in enumerate(tickets)]
    opening = [c for r in replies for c in r.opening()]
    dones: dict[int, Done] = {}
    try:
        open_rows = len(tickets)
        while open_rows:
            if opening:  # nothing sent yet: keep the client's read timeout at bay while queued
                try:
                    i, batch = await asyncio.wait_for(events.get(), KEEPALIVE_S)
                except TimeoutError:
                    await sse.comment("keep-alive")
                    continue
            else:
                i, batch = await events.get()
            if batch is None:
                open_rows -= 1
                continue
            for chunk in opening:
                await sse.send(chunk)
            opening = []
            tokens = [e for e in batch if isinstance(e, Token)]
            logprobs = [lp for e in tokens for lp in e.logprobs or []]
            for chunk in replies[i].text("".join(e.text for e in tokens), logprobs):
                await sse.send(chunk)
            end = batch[-1]
            if isinstance(end, Failed) or (isinstance(end, Done) and end.finish_reason == "cancelled"):
                await finish_stream(sse, replies[i], end, include_usage)
                return resp
            if isinstance(end, Done):
                dones[i] = end
                for chunk in replies[i].closing(end):
                    await sse.send(chunk)
        if dones:
            first, *rest = dones.values()
            if include_usage:
                await sse.send(replies[0].usage(usage_of(first, *rest)))
            await sse.usage(summary_of(first, *rest))
        await sse.done()
    except ConnectionResetError:
        for t in tickets:
            t.cancel()
    finally:
        for task in pumps:
            task.cancel()
    return resp


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
