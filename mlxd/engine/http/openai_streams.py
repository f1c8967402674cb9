"""The OpenAI SSE relays: one generation's events as chunks, or `n` choices in one stream,
keep-alive comments while a job waits, and the closing events (usage, [DONE] or an error)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.http.openai_replies import ChatReply, Reply
from mlxd.engine.http.openai_requests import summary_of, usage_of
from mlxd.engine.http.sse import DONE, SSEWriter, event, keepalive_interval, mark, usage_comment
from mlxd.protocol import openai as oa
from mlxd.protocol.errors import APIError
from mlxd.protocol.events import Done, Failed, Token
from mlxd.protocol.process import MARKS_HEADER, REPLY_HEADER

KEEPALIVE_S = keepalive_interval()


async def stream(request: web.Request, ticket: Ticket, reply: Reply, include_usage: bool,
                 early_usage: bool = False, resumed: int | None = None,
                 lead: tuple[list[Any], list[int]] | None = None) -> web.StreamResponse:
    """Relay a generation as OpenAI SSE chunks, ending with `data: [DONE]`; with `early_usage`
    (process.EARLY_USAGE_HEADER) the opening chunk carries the prompt's usage.

    Each batch of events goes out in one write, and with process.MARKS_HEADER a resume mark
    ends it (the batch's token ids). `resumed`: the reply continues one whose first `resumed`
    tokens were delivered, opening chunks included (http/resume.py): none are sent again.
    `lead`: a continued reply that resends its start: the chunks to send after the opening, and
    the token ids they carry (the first write's mark names them)."""
    marks = MARKS_HEADER in request.headers
    sse = SSEWriter({REPLY_HEADER: f"{reply.meta[0]} {reply.meta[1]}"} if marks else None)
    resp = await sse.start(request)
    # The opening chunks go out with the first generated text, so a client's (and the
    # supervisor's) first chunk marks the first token.
    lead_chunks, lead_ids = lead or ([], [])
    opening = [*reply.opening(), *lead_chunks] if resumed is None else []
    total = resumed or 0
    held: list[int] = []  # ids whose log probabilities wait in the reply: not named yet
    try:
        await keep_alive_until_first_event(sse, ticket)
        async for batch in ticket.events():
            if opening and early_usage:
                opening[0].usage = prompt_usage(batch)
            tokens = [e for e in batch if isinstance(e, Token)]
            logprobs = [lp for e in tokens for lp in e.logprobs or []]
            chunks = [*opening, *reply.text("".join(e.text for e in tokens), logprobs)]
            opening = []
            out = b"".join(map(event, chunks))
            end = batch[-1]
            if marks and not (isinstance(end, Done) and end.finish_reason != "cancelled"):
                # marked unless [DONE] ends it: a stream cut by a drain or shutdown may go on
                ids = [*held, *(i for e in tokens for i in e.ids or ())]
                if reply.holds_logprobs:  # a resume makes these tokens again, with their logprobs
                    ids, held = [], ids
                else:
                    held = []
                ids, lead_ids = [*lead_ids, *ids], []
                total += len(ids)
                out += mark(0, total, ids)
            if isinstance(end, Token):
                await sse.write(out)
            else:
                await sse.write(out + closing_events(reply, end, include_usage), end=True)
    except ConnectionResetError:
        ticket.cancel()  # the client went away mid-stream
    return resp


def prompt_usage(batch: list[Any]) -> oa.Usage | None:
    """The prompt's usage from a reply's first Token (None: the batch starts with none)."""
    first = batch[0] if batch else None
    if not isinstance(first, Token) or first.prompt_tokens is None:
        return None
    return oa.Usage(first.prompt_tokens, 0, first.prompt_tokens, oa.PromptTokensDetails(first.cached_tokens or 0))


async def keep_alive_until_first_event(sse: SSEWriter, ticket: Ticket) -> None:
    """While the job waits its turn, send an SSE comment every KEEPALIVE_S seconds.

    A request queued behind others would otherwise be silent until its first token, and a
    client's read timeout could end it. Written from this task only, so writes never interleave.
    """
    while not await ticket.wait_for_event(KEEPALIVE_S):
        await sse.comment("keep-alive")


def closing_events(reply: Reply, end: Done | Failed, include_usage: bool) -> bytes:
    """The events that end a stream: the reply's last chunks, usage and [DONE]; or an error
    event (a failure, or a drain or shutdown that cancelled it), with no [DONE]."""
    if isinstance(end, Failed):
        return event(APIError(end.status, end.message, type="server_error", code=end.code).to_openai())
    if end.finish_reason == "cancelled":
        return event(APIError(503, "The engine is shutting down.", type="server_error", code="engine_stopping").to_openai())
    out = [event(chunk) for chunk in reply.closing(end)]
    if include_usage:
        out.append(event(reply.usage(usage_of(end))))
    return b"".join([*out, usage_comment(summary_of(end)), DONE])


async def stream_choices(request: web.Request, tickets: list[Ticket], replies: list[ChatReply],
                         include_usage: bool, resumed: list[int] | None = None,
                         ended: set[int] | None = None) -> web.StreamResponse:
    """Relay `n` choices as one SSE stream: each choice's chunks carry its index, in the order
    they come; a failure of any ends the stream with an error; usage (all choices) at the end.

    Each batch of one choice's events goes out in one write, and with process.MARKS_HEADER a
    resume mark ends it (the choice's index and token ids; ` end` once its closing chunks went
    out). `resumed`: the choices continue ones already delivered in part, this many tokens each
    (no opening chunks); `ended`: those whose end was delivered too (no closing chunks again)."""
    marks = MARKS_HEADER in request.headers
    sse = SSEWriter({REPLY_HEADER: f"{replies[0].meta[0]} {replies[0].meta[1]}"} if marks else None)
    resp = await sse.start(request)
    events: asyncio.Queue[tuple[int, list[Any] | None]] = asyncio.Queue()

    async def pump(i: int, ticket: Ticket) -> None:
        async for batch in ticket.events():
            await events.put((i, batch))
        await events.put((i, None))

    pumps = [asyncio.create_task(pump(i, t)) for i, t in enumerate(tickets)]
    opening = [] if resumed is not None else [c for r in replies for c in r.opening()]
    totals = list(resumed) if resumed is not None else [0] * len(replies)
    held: list[list[int]] = [[] for _ in replies]  # per choice, as `stream`'s
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
            tokens = [e for e in batch if isinstance(e, Token)]
            logprobs = [lp for e in tokens for lp in e.logprobs or []]
            chunks = [*opening, *replies[i].text("".join(e.text for e in tokens), logprobs)]
            opening = []
            end = batch[-1]
            failed = isinstance(end, Failed) or (isinstance(end, Done) and end.finish_reason == "cancelled")
            if isinstance(end, Done) and not failed:
                dones[i] = end
                if i not in (ended or ()):
                    chunks += replies[i].closing(end)
            out = b"".join(map(event, chunks))
            if marks:  # an error's write too: a drain's or shutdown's may go on, its events not sent twice
                ids, held[i] = [*held[i], *(t for e in tokens for t in e.ids or ())], []
                if i in dones:  # its end: every token it made is named, so a resume counts them all
                    ids += dones[i].tail
                elif replies[i].holds_logprobs:
                    ids, held[i] = [], ids
                totals[i] += len(ids)
                out += mark(i, totals[i], ids, end=i in dones)
            if failed:
                await sse.write(out + closing_events(replies[i], end, include_usage), end=True)
                return resp
            await sse.write(out)
        if dones:
            first, *rest = dones.values()
            tail = [event(replies[0].usage(usage_of(first, *rest)))] if include_usage else []
            await sse.write(b"".join([*tail, usage_comment(summary_of(first, *rest)), DONE]), end=True)
    except ConnectionResetError:
        for t in tickets:
            t.cancel()
    finally:
        for task in pumps:
            task.cancel()
    return resp
