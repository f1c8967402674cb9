"""Events the GPU thread sends back to a request's handler: a tagged union."""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token's log probability, and the likeliest alternatives if asked for."""

    text: str
    logprob: float
    top: list[tuple[str, float]]


class Token(msgspec.Struct, tag="token"):
    """A piece of text that is safe to send (stop strings already held back), with the log
    probabilities of the tokens released with it when the request asked for them."""

    text: str
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int | None = None  # on a reply's first Token: the prompt's size ...
    cached_tokens: int | None = None  # ... and the tokens of it the prompt cache held
    ids: list[int] | None = None  # the token ids generated since the previous Token, this text's among them


class Speculation(msgspec.Struct):
    """A reply's drafted tokens: how many drafts the target checked, and how many it kept."""

    proposed: int
    accepted: int


class Done(msgspec.Struct, tag="done"):
    """Generation ended normally."""

    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    queue_ms: float = 0.0  # submitted -> the GPU thread picked it up
    prefill_ms: float = 0.0  # picked up -> first token sampled
    decode_ms: float = 0.0  # first token -> last token
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason "stop")
    paused: int = 0  # times it was paused for a more urgent request (and resumed)
    speculation: Speculation | None = None  # drafts, when it decoded with them (None: it did not)
    resumed: int = 0  # of completion_tokens, those delivered before (a continued reply's, http/resume.py)
    tail: tuple[int, ...] = ()  # generated ids no Token carried (an EOS, what followed a stop string): its end's mark names them


class Failed(msgspec.Struct, tag="failed"):
    """Generation raised; the engine keeps serving."""

    message: str
    status: int = 500
    code: str = "generation_failed"


Event = Token | Done | Failed
