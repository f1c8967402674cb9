"""Ollama's API as a dialect: chat (or a text completion) on the engine, Ollama's shapes back.

Errors are `{"error": "..."}` with the status; a stream is NDJSON (`application/x-ndjson`),
so it has no comments: a stream that waits for its engine gets its head and then nothing until
the answer starts, and an error under way is one last `{"error": ...}` line, which Ollama's
clients raise.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from mlxd.protocol import ollama, ollama_answers
from mlxd.protocol.errors import APIError
from mlxd.protocol.process import CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH, RequestUsage
from mlxd.supervisor.relay.dialect import Dialect


class Ollama(Dialect):
    """`/api/*`: one request's dialect (`kind` chat or generate; `raw`: a text completion)."""

    name = "ollama"
    params: tuple[tuple[str, str], ...] = ollama.PARAMS
    stream_headers = ollama_answers.NDJSON_HEADERS
    request_headers = ()

    def __init__(self, model: str = "", kind: Literal["chat", "generate"] = "chat", started: float = 0.0,
                 raw: bool = False) -> None:
        self.model = model
        self.kind = kind
        self.started = started
        self.engine_path = COMPLETIONS_PATH if raw else CHAT_PATH
        self._translator: ollama_answers.OllamaStream | None = None
        self._usage: RequestUsage | None = None

    def engine_usage(self, usage: RequestUsage | None) -> None:
        self._usage = usage

    def comment(self, text: bytes) -> bytes:
        return b""

    def error_body(self, err: APIError) -> bytes:
        return ollama_answers.error_body(err.message)

    def error_event(self, err: APIError) -> bytes:
        if self._translator is not None:
            return self._translator.fail(err.status, err.message, err.code)
        return ollama_answers.error_body(err.message) + b"\n"

    def translator(self) -> ollama_answers.OllamaStream:
        if self._translator is None:
            self._translator = ollama_answers.OllamaStream(self.model, self.kind, self.started)
        return self._translator

    async def whole(self, status: int, data: bytes) -> tuple[int, bytes]:
        answer = msgspec.json.decode(data)
        timing = ollama_answers.Timing(self.started)
        if self._usage is not None:  # the engine's own clock: queued and prefilled, then decoded
            timing.split(self._usage.queue_ms + self._usage.prefill_ms, self._usage.decode_ms)
        return status, msgspec.json.encode(ollama_answers.answer(answer, self.model, self.kind, timing))


class OllamaEmbed(Ollama):
    """`/api/embed` (`legacy`: `/api/embeddings`): the engine's embeddings, Ollama's shape back."""

    def __init__(self, model: str, started: float, legacy: bool) -> None:
        super().__init__(model, "chat", started)
        self.engine_path = EMBEDDINGS_PATH
        self.legacy = legacy
        self.params: tuple[tuple[str, str], ...] = (("input", "prompt"),) if legacy else ()

    async def whole(self, status: int, data: bytes) -> tuple[int, bytes]:
        answer = ollama_answers.embed_answer(msgspec.json.decode(data), self.model, self.legacy, self.started)
        return status, msgspec.json.encode(answer)


OLLAMA = Ollama()
# Ollama's routes (the rest of /api/ is the lab's, as the reference server has it): those any key
# may call, and those that change what is on disk (an admin key's, as the lab's are)
OLLAMA_USER_PATHS = ("/api/chat", "/api/generate", "/api/tags", "/api/ps", "/api/show", "/api/version", "/api/embed",
                     "/api/embeddings")
OLLAMA_PATHS = (*OLLAMA_USER_PATHS, "/api/pull", "/api/delete", "/api/copy", "/api/create", "/api/push")
