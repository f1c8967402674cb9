"""OpenAI-compatible handlers of the engine: chat and text completions, streaming or not, and
the chat render. Their shared request handling is openai_requests.py's; replies and streams
are openai_replies.py's and openai_streams.py's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import time
from typing import Any

from aiohttp import web

from mlxd.engine.chat.grammar import forced_call_grammar, response_format_grammar
from mlxd.engine.chat.reasoning import starts_in_reasoning
from mlxd.engine.chat.tools import ToolFormat, ToolRequest, check_tools, template_messages
from mlxd.engine.gpu.job import PrefillGroup
from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.http.admission import Slot
from mlxd.engine.http.keys import GATEWAY
from mlxd.engine.http.openai_replies import ChatReply, TextReply, chat_logprobs, text_logprobs
from mlxd.engine.http.openai_requests import (
    LEGACY_COMPLETION_MAX_TOKENS,
    admitted,
    cancel_all_on_exit,
    cancel_on_exit,
    collect,
    decode_body,
    json_response,
    ready_model,
    resolve_max_tokens,
    submit,
    usage_headers,
    usage_of,
)
from mlxd.engine.http.openai_streams import stream, stream_choices
from mlxd.engine.http.resume import Continued, continued, ended_ticket, lead, prime, reply_meta
from mlxd.engine.models.image_memo import PromptMedia, read_media
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.models.vision import MAX_IMAGES, MediaPrompt
from mlxd.protocol import openai as oa
from mlxd.protocol.errors import APIError
from mlxd.protocol.media import AudioPart, ImagePart, content_parts, has_media
from mlxd.protocol.process import EARLY_USAGE_HEADER


@admitted
async def chat_completions(request: web.Request, slot: Slot) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    started = time.perf_counter()
    req = await decode_body(request, oa.ChatCompletionRequest)
    oa.check_chat(req)
    loaded = ready_model(request)
    chat = await rendered(loaded, req)
    if chat.media is not None:  # for its log line: the body read, its images decoded, the prompt rendered
        chat.media.request_ms = (time.perf_counter() - started) * 1000
    tool_req, fmt, forced, prompt, in_reasoning = chat.tool_req, chat.fmt, chat.forced, chat.prompt, chat.in_reasoning
    budget = req.max_completion_tokens or req.max_tokens
    max_tokens = resolve_max_tokens(budget, len(prompt), loaded.context_window, loaded.configured.max_tokens,
                                    request.app[GATEWAY].kv_budget)
    grammars, grammar_text = await constraints(loaded, req, tool_req, fmt, forced)
    top = (req.top_logprobs or 0) if req.logprobs else None
    conts = [await replayed(loaded, r, prompt, max_tokens, oa.stop_list(req.stop)) for r in per_choice(req)]
    meta = reply_meta("chatcmpl-", req.resume, loaded.model_id)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    replies = [ChatReply(*meta, tool_req=tool_req, markup=fmt.markup, forced=forced, think=loaded.think_markers,
                         in_reasoning=in_reasoning, index=i) for i in range(req.n)]
    primed = [prime(reply, cont) for reply, cont in zip(replies, conts, strict=True)]
    resumed, lead_with = lead(req.resume, conts[0], primed[0])
    for cont, grammar in zip(conts, grammars, strict=True):
        if cont is not None and grammar is not None:
            grammar.consume_tokens(cont.ids)  # the matcher stands where the delivered tokens left it
    ended = {i for i, c in enumerate(req.resume.choices or []) if c.ended} if req.resume is not None else set()
    tickets: list[Ticket] = []
    with cancel_all_on_exit(tickets):  # rows submitted before a later one is refused are cancelled too
        # Choices with images each prefill their own (their prompts' rows start from its embeddings);
        # continued ones each go on from their own tokens.
        group = (PrefillGroup(req.n, len(prompt) - 1) if req.n > 1 and chat.media is None and req.resume is None
                 else None)
        for i, cont in enumerate(conts):
            tickets.append(ended_ticket(cont, len(prompt)) if cont is not None and (cont.finish or i in ended) else
                           submit(request, slot, prompt, max_tokens, req, grammars[i], top, row=i, group=group,
                                  media=chat.media, resumed=cont.ids if cont is not None else None,
                                  grammar_text=grammar_text))
        if req.stream:
            if req.n == 1:
                return await stream(request, tickets[0], replies[0], include_usage,
                                    early_usage=EARLY_USAGE_HEADER in request.headers, resumed=resumed,
                                    lead=lead_with)
            return await stream_choices(request, tickets, replies, include_usage, ended=ended,
                                        resumed=[len(c.ids) if c else 0 for c in conts] if req.resume else None)
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
# Images are decoded (base64, then Pillow, which lets go of the GIL) on these, several at once, before
# their request's turn on TEMPLATING: requests with images do not wait for each other's decoding.
IMAGE_DECODING = concurrent.futures.ThreadPoolExecutor(max(2, (os.cpu_count() or 2) // 2),
                                                       thread_name_prefix="mlxd-images")


def per_choice(req: oa.ChatCompletionRequest) -> list[oa.Resume | None]:
    """Each choice's `resume` (None: it continues nothing): `resume` itself for one choice, one
    made of each of `resume.choices` for several."""
    resume = req.resume
    if resume is None or resume.choices is None:
        return [resume] * req.n
    return [oa.Resume(tokens=c.tokens, segments=c.segments, id=resume.id, created=resume.created)
            for c in resume.choices]


async def replayed(loaded: LoadedModel, resume: oa.Resume | None, prompt: list[int], max_tokens: int,
                   stops: list[str], continues_text: bool = False) -> Continued | None:
    """resume.py's `continued` on TEMPLATING (a long reply's replay detokenizes every token: not
    on the loop, where the engine's other streams are relayed)."""
    if resume is None:
        return None
    return await asyncio.get_running_loop().run_in_executor(
        TEMPLATING, functools.partial(continued, loaded, resume, prompt, max_tokens, stops, continues_text))


@dataclasses.dataclass(frozen=True, slots=True)
class ReadMessages:
    """A request's messages as the chat template takes them, and its images, read and decoded."""

    messages: list[dict[str, Any]]
    media: PromptMedia | None  # its images and audio (None: none)


def read_messages(loaded: LoadedModel, req: oa.ChatCompletionRequest) -> ReadMessages:
    """The messages' parts read, their images and audio decoded (a 400 naming a part that cannot
    be) or, when the same images were seen lately, found in the image memo (models/image_memo.py).
    Blocking."""
    parts: list[ImagePart | AudioPart] = []
    messages = [chat_message_dict(m, i, loaded, parts) for i, m in enumerate(req.messages)]
    if not parts:
        return ReadMessages(messages, None)
    return ReadMessages(messages, read_media(loaded.image_memo, parts, loaded.audio_rate, loaded.audio_seconds))


async def rendered(loaded: LoadedModel, req: oa.ChatCompletionRequest) -> RenderedChat:
    """render_chat on TEMPLATING, a request with images read and decoded before, on IMAGE_DECODING."""
    loop = asyncio.get_running_loop()
    read = None
    if any(has_media(m.content) for m in req.messages):
        read = await loop.run_in_executor(IMAGE_DECODING, read_messages, loaded, req)
    return await loop.run_in_executor(TEMPLATING, render_chat, loaded, req, read)


@dataclasses.dataclass(frozen=True, slots=True)
class RenderedChat:
    prompt: list[int]  # token ids, a forced call's start included
    tool_req: ToolRequest | None
    fmt: ToolFormat
    forced: str  # the start of a call put after the template's prompt ("" for none)
    in_reasoning: bool  # the prompt ends inside an open think block
    media: MediaPrompt | None = None  # the prompt's images (a vision-language model's)


def effort_kwargs(effort: str | None) -> dict[str, Any]:
    """The chat template's arguments for a `reasoning_effort`: "none" turns thinking off, a
    level turns it on and is passed on (chat_template_kwargs, applied after, win)."""
    if effort is None:
        return {}
    if effort == "none":
        return {"enable_thinking": False}
    return {"enable_thinking": True, "reasoning_effort": effort}


def render_chat(loaded: LoadedModel, req: oa.ChatCompletionRequest, read: ReadMessages | None = None) -> RenderedChat:
    """A chat request's prompt as the model gets it (a 400 for what cannot be rendered).
    Blocking: run it on TEMPLATING."""
    tool_req = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    fmt = loaded.tool_format
    read = read or read_messages(loaded, req)
    messages = template_messages(read.messages, fmt, tool_req.tools if tool_req else None)
    thinking = loaded.configured.thinking  # mlxd's config's default, under the request's own
    kwargs = {**({"enable_thinking": thinking} if thinking is not None else {}), **effort_kwargs(req.reasoning_effort)}
    tools = tool_req.tools if tool_req and fmt.in_template else None
    media: MediaPrompt | None = None
    if read.media is not None:
        prompt, media = loaded.media_prompt(messages, tools, {**kwargs, **(req.chat_template_kwargs or {})},
                                            read.media)
    else:
        prompt = loaded.chat_prompt(messages, tools, {**kwargs, **(req.chat_template_kwargs or {})})
    if not prompt:
        raise APIError(400, "The chat template produced an empty prompt.", param="messages")
    forced = forced_call(tool_req, fmt)
    prompt += loaded.encode_text(forced) if forced else []
    think = loaded.think_markers
    in_reasoning = starts_in_reasoning(loaded.decode(prompt[-64:]), think) if think is not None and not forced else False
    return RenderedChat(prompt, tool_req, fmt, forced, in_reasoning, media)


async def render(request: web.Request) -> web.Response:
    """POST /v1/chat/render: a chat request's prompt, rendered and tokenized without generating
    (for counting tokens: Anthropic's count_tokens, admission). The body is a chat request."""
    req = await decode_body(request, oa.ChatCompletionRequest)
    oa.check_chat(req)
    loaded = ready_model(request)
    chat = await rendered(loaded, req)
    return json_response(oa.RenderedPrompt(len(chat.prompt), chat.prompt, loaded.decode(chat.prompt),
                                           loaded.context_window, loaded.model_id))


def held_grammar(req: oa.SamplingFields) -> tuple[str | None, str]:
    """The grammar text a request's reply is held to (None: free text), and the field its
    errors name: `response_format`, or the vLLM field the format came from."""
    fmt, param = oa.held_format(req)
    try:
        return response_format_grammar(fmt), param
    except APIError as err:
        if param != "response_format" and (err.param or "").startswith("response_format"):
            err.param = param  # the caller sent guided_json, not a response_format
        raise


async def constraints(loaded: LoadedModel, req: oa.ChatCompletionRequest, tool_req: ToolRequest | None,
                      fmt: ToolFormat, forced: str) -> tuple[list[Any], str | None]:
    """For each of the `n` rows, the llguidance matcher its reply is held to, or None: a forced
    tool call's arguments to the function's schema, else `response_format`. Compiled in a
    worker thread (once; cached), a matcher a row; and the grammar's text (an engine group's
    other ranks compile it too)."""
    if forced and tool_req is not None:
        text = forced_call_grammar(fmt.name, tool_req.tools, tool_req.forced_function, fmt.markup.end)
        param = "tools"
    else:
        text, param = held_grammar(req)
    if text is None:
        return [None] * req.n, None
    loop = asyncio.get_running_loop()
    return [await loop.run_in_executor(None, loaded.grammars.matcher, text, param) for _ in range(req.n)], text


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
        req.max_tokens, len(prompt), loaded.context_window, loaded.configured.max_tokens or LEGACY_COMPLETION_MAX_TOKENS,
        request.app[GATEWAY].kv_budget
    )
    held, param = held_grammar(req)  # response_format and vLLM's guided fields, as on chat
    grammar = (await asyncio.get_running_loop().run_in_executor(None, loaded.grammars.matcher, held, param)
               if held is not None else None)
    cont = await replayed(loaded, req.resume, prompt, max_tokens, oa.stop_list(req.stop), continues_text=True)
    if cont is not None and grammar is not None:
        grammar.consume_tokens(cont.ids)
    ticket = (ended_ticket(cont, len(prompt)) if cont is not None and cont.finish is not None else
              submit(request, slot, prompt, max_tokens, req, grammar=grammar, logprobs=req.logprobs,
                     continues_text=True, resumed=cont.ids if cont is not None else None, grammar_text=held))
    meta = reply_meta("cmpl-", req.resume, loaded.model_id)
    echo = loaded.decode(prompt) if req.echo else ""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    reply = TextReply(*meta, echo=echo, logprobs=req.logprobs)
    resumed, lead_with = lead(req.resume, cont, prime(reply, cont))
    with cancel_on_exit(ticket):
        if req.stream:
            return await stream(request, ticket, reply, include_usage, resumed=resumed, lead=lead_with)
        text, done, logprobs = await collect(ticket)
        lp = text_logprobs(logprobs, len(echo), req.logprobs) if req.logprobs is not None else None
        before = cont.text if cont is not None else ""
        choice = oa.TextChoice(0, echo + before + text, done.finish_reason, lp, done.stop_sequence)
        return json_response(oa.Completion(*meta, choices=[choice], usage=usage_of(done)), headers=usage_headers(done))


def chat_message_dict(msg: oa.ChatMessage, index: int, loaded: LoadedModel,
                      media: list[ImagePart | AudioPart]) -> dict[str, Any]:
    """A message as the chat template expects it (developer -> system, text parts joined; with
    images or audio, a list of text, image and audio parts, the media parts added to `media`).
    A part the model cannot take is a 400 naming it and the model."""
    out: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role}
    parts = content_parts(msg.content, index)
    if all(isinstance(p, str) for p in parts):
        out["content"] = "".join(p for p in parts if isinstance(p, str))
    else:
        content: list[dict[str, Any]] = []
        for part in parts:
            if isinstance(part, str):
                content.append({"type": "text", "text": part})
            elif isinstance(part, AudioPart):
                if not loaded.takes_audio:
                    raise APIError(400, f"Model {loaded.model_id} does not take audio ({part.where} is an input_audio "
                                        "part).", param=part.where, code="unsupported_content")
                if len(media) >= MAX_IMAGES:
                    raise APIError(400, f"At most {MAX_IMAGES} images and audio clips are taken in one request.",
                                   param=part.where, code="too_many_images")
                content.append({"type": "audio"})
                media.append(part)
            elif not loaded.takes_images:
                raise APIError(400, f"Model {loaded.model_id} does not take images ({part.where} is an image_url part).",
                               param=part.where, code="unsupported_content")
            elif len(media) >= MAX_IMAGES:
                raise APIError(400, f"At most {MAX_IMAGES} images are taken in one request.", param=part.where,
                               code="too_many_images")
            else:
                content.append({"type": "image"})
                media.append(part)
        out["content"] = content
    for key in ("name", "tool_calls", "tool_call_id"):
        if (value := getattr(msg, key)) is not None:
            out[key] = value
    return out
