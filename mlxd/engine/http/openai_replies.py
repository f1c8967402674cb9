"""The OpenAI reply objects: a chat reply (reasoning split off, tool calls parsed) and a text
completion, as streamed chunks or one whole answer, and their `logprobs` objects."""

from __future__ import annotations

from typing import Any

from mlxd.engine.chat.reasoning import ReasoningSplitter, ThinkMarkers
from mlxd.engine.chat.tool_stream import Call, Content, Event, Markup, ToolCallStream
from mlxd.engine.chat.tools import ToolRequest
from mlxd.protocol import openai as oa
from mlxd.protocol.events import Done, TokenLogprob


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

    @property
    def meta(self) -> tuple[str, int, str]:
        """The reply's id, `created` and model."""
        return self._meta

    def opening(self) -> list[Any]:
        return [self._chunk(oa.Delta(role="assistant", content=""))]

    @property
    def holds_logprobs(self) -> bool:
        """Log probabilities wait for text the reply holds (a tool call or a think marker being
        parsed): their tokens are not delivered yet, so a resume mark does not name them."""
        return bool(self._logprobs)

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
        return [self._chunk(oa.Delta(reasoning_content=text, reasoning=text))]

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
            return (oa.AssistantMessage("assistant", content, reasoning_content=reasoning, reasoning=reasoning),
                    done.finish_reason)
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in self._calls]
        return (oa.AssistantMessage("assistant", content or None, tool_calls=calls, reasoning_content=reasoning,
                                    reasoning=reasoning), self.finish_reason(done))

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

    @property
    def meta(self) -> tuple[str, int, str]:
        """The reply's id, `created` and model."""
        return self._meta

    def opening(self) -> list[Any]:  # text completions have no role-only opening chunk
        return [self._chunk(self._echo, None)] if self._echo else []

    holds_logprobs = False  # each token's log probability goes with its text

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
