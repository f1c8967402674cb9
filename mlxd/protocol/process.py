"""Names in the supervisor-engine process contract that both sides must spell the same."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

# The engine's routes, on its socket (never on TCP).
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"  # an embedding model's engine serves this (and no chat)
SIGNAL_PATH = "/signal"  # the curve designer's: where the next token's log-probabilities lie
GENERATE_PATH = "/generate"  # ... and n samples under a curve
RENDER_PATH = "/v1/chat/render"  # a chat request's prompt, rendered and counted, not generated
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"
STATS_PATH = "/admin/stats"
DRAIN_PATH = "/admin/drain"
LEASE_PATH = "/admin/lease"
ADAPTERS_PATH = "/admin/adapters"  # GET the mounted adapters, POST one to mount, DELETE .../{id}

# `python -m mlxd.engine --spare`: import everything, print SPARE_READY, then read the real
# command line (a JSON list) from stdin.
SPARE_FLAG = "--spare"
SPARE_READY = "spare engine: imports done"

# A request carrying a lease's id (supervisor) or token (engine) passes that lease.
LEASE_HEADER = "X-MLXD-Lease"
# The default `priority` of a request whose body sets none (the key's, `[server] key_priorities`),
# from the supervisor to the engine.
PRIORITY_HEADER = "X-MLXD-Priority"
# The adapter stack a request runs under, as the supervisor resolved it ("a+b", or "none"); over
# the body's `adapter`, which the supervisor may have read from a `base:adapter` model id.
ADAPTER_HEADER = "X-MLXD-Adapter"
# Asks a chat stream's opening chunk (with the first text) to carry `usage` with the prompt's
# tokens and those the prompt cache held: Anthropic's message_start says them before any text.
# Only translated streams ask (OpenAI's own chunks carry usage only at the end).
EARLY_USAGE_HEADER = "X-MLXD-Early-Usage"

# Engines' --generation-checkpoint default ([pool] generation_checkpoint): a running reply's KV
# is written to the SSD tier every this many tokens, so a continued reply prefills fewer.
DEFAULT_CHECKPOINT_TOKENS = 512

# Asks a streamed reply for its resume marks: after each write's events, an SSE comment
# `: ids INDEX TOTAL ID,ID,...` (the token ids those events carried; TOTAL: the reply's so far),
# so the supervisor can continue the reply on another engine (docs/resume.md). One write is one
# HTTP chunk, so a mark and the events before it arrive together or not at all. The answer's head
# then names the reply (REPLY_HEADER: `ID CREATED`), for the continuation's `resume`.
MARKS_HEADER = "X-MLXD-Marks"
# A caller's opt-out: `X-MLXD-Resume: off` (or 0, false, no) lets its reply end with the engine's crash.
RESUME_HEADER = "X-MLXD-Resume"
REPLY_HEADER = "X-MLXD-Reply"
MARK = b": ids "

# Seconds between SSE comments to a stream still waiting for its first token. The supervisor
# sets it from `server.stream_keepalive_s` (unless set already); engines inherit it.
STREAM_KEEPALIVE_ENV = "MLXD_STREAM_KEEPALIVE_S"


# An engine's 503 `error.code` for a request refused before anything ran (a drain; a lease
# held by another): nothing happened, so the supervisor may hold the request and retry it.
Refusal = Literal["draining", "leased"]
REFUSALS: frozenset[str] = frozenset(get_args(Refusal))


Seconds = Annotated[float, msgspec.Meta(gt=0)]


class DrainRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of the engine's POST /admin/drain (all optional)."""

    timeout_s: Seconds = 30.0
    resume: bool = False  # serve again afterwards (a drain), or stay closed (a stop follows)


class LeaseRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of the engine's POST /admin/lease (all optional)."""

    holder: str = ""
    wait_s: Seconds = 300.0


class LeaseLine(msgspec.Struct, omit_defaults=True):
    """One line of the engine's lease stream (NDJSON): the first carries the token to present
    in LEASE_HEADER, then a heartbeat each second while the lease is held."""

    status: Literal["held"]
    token: str | None = None
    holder: str | None = None


AdapterId = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[^+\s/:][^+\s/:]*$")]


class AdapterMount(msgspec.Struct, forbid_unknown_fields=True):
    """Body of the engine's POST /admin/adapters: read the adapter dir at `path` as `id`."""

    id: AdapterId
    path: str


class AdapterInfo(msgspec.Struct):
    """One adapter mounted on an engine (its /admin/adapters answer lists them)."""

    id: str
    path: str
    kind: str  # "lora" | "dora"
    rank: int
    scale: float
    layers: int  # the model's layers it adapts
    size_bytes: int


class AdapterList(msgspec.Struct):
    adapters: list[AdapterInfo]


class DrainResult(msgspec.Struct):
    """An engine's answer to POST /admin/drain (the supervisor passes it on)."""

    drained: bool
    finished: int
    cancelled: int
    waited_ms: float
    cache_written_bytes: int  # the prompt cache's RAM entries written to SSD by this drain
    resumed: bool
    cache_written_entries: int = 0
    cache_write_ms: float = 0.0
    cache_complete: bool = True  # False: the writes did not all finish within the timeout


# Every generation tells the supervisor what it cost, for its request log and charts: a whole
# answer in the USAGE_HEADER header, a stream in an SSE comment (`: mlxd-usage {json}`) just
# before `data: [DONE]`. SSE clients skip comments, so the stream stays OpenAI's.
USAGE_HEADER = "X-MLXD-Usage"
USAGE_COMMENT = b": mlxd-usage "


class RequestUsage(msgspec.Struct):
    """One request's tokens and engine-side timings (a request of `n` choices: their sum, and the longest decode)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_ms: float  # submitted -> the GPU thread picked it up
    prefill_ms: float  # picked up -> first token
    decode_ms: float  # first token -> last token
    finish_reason: str
    paused: int = 0  # times the engine paused it for a more urgent request
    draft_proposed: int = 0  # drafted tokens the model checked (speculative decoding)
    draft_accepted: int = 0  # ... and kept
    resumed: int = 0  # of completion_tokens, those an earlier engine made (a reply gone on after a crash)
