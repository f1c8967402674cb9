"""The curve designer's two calls (protocol/curve.py says what a curve is; the page is the web
app's Curves view).

- `POST /signal` `{"prompt"}`: the chat template around the prompt as a user message, one
  forward pass, and where the next token's log-probabilities lie: how many of the vocabulary's
  tokens fall in each of SIGNAL_BINS bins over [CURVE_UMIN, 0] (so the page draws the signal
  under the curve), and the likeliest ones.
- `POST /generate` `{"prompt", "curve", "hlg", "n", "max_tokens", "seed", "default"}`: `n`
  replies (1-8, default 3) of at most `max_tokens` tokens (1-256, default 80) sampled under the
  curve, seeds `seed`, `seed + 1`, ...; they run together, as one request's choices do. With
  `default: true` or no curve, the model's own sampling (its defaults, mlxd's config's) as a
  chat request would get it, to compare against. Each sample says whether it looks like junk:
  other scripts than Latin in 2% or more of its letters, a replacement character or a
  `<unusedN>` token.
"""

from __future__ import annotations

import asyncio
import re
import time
import unicodedata

import mlx.core as mx
import numpy as np
from aiohttp import web

from mlxd.engine.gpu.job import PrefillGroup
from mlxd.engine.gpu.ticket import Ticket
from mlxd.engine.http.admission import Slot
from mlxd.engine.http.keys import GATEWAY
from mlxd.engine.http.openai_requests import (
    admitted,
    cancel_all_on_exit,
    collect,
    decode_body,
    json_response,
    ready_model,
    sampling_params,
    submit,
)
from mlxd.engine.http.openai_routes import rendered
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.protocol import openai as oa
from mlxd.protocol.curve import (
    CURVE_UMIN,
    SIGNAL_BINS,
    Generated,
    GenerateRequest,
    Hlg,
    Likely,
    Sample,
    Signal,
    SignalRequest,
)
from mlxd.protocol.errors import APIError

TOP = 10  # the likeliest next tokens /signal names


def user_chat(prompt: str, **fields: object) -> oa.ChatCompletionRequest:
    return oa.ChatCompletionRequest(messages=[oa.ChatMessage(role="user", content=prompt)], **fields)  # type: ignore[arg-type]


async def signal(request: web.Request) -> web.Response:
    """POST /signal."""
    req = await decode_body(request, SignalRequest)
    loaded = ready_model(request)
    prompt = (await rendered(loaded, user_chat(req.prompt))).prompt
    if len(prompt) >= loaded.context_window:
        raise APIError(400, f"The prompt is {len(prompt)} tokens, past the model's {loaded.context_window}.",
                       param="prompt", code="context_length_exceeded")
    logprobs = await asyncio.wrap_future(request.app[GATEWAY].call(lambda: next_logprobs(loaded, prompt)))
    t = np.clip((logprobs - CURVE_UMIN) / -CURVE_UMIN, 0.0, 1.0)
    bins = np.bincount(np.minimum(SIGNAL_BINS - 1, (t * SIGNAL_BINS).astype(np.int64)), minlength=SIGNAL_BINS)
    top = np.argsort(-logprobs)[:TOP]
    return json_response(Signal(loaded.model_id, [int(b) for b in bins], CURVE_UMIN, int(logprobs.size), len(prompt),
                                [Likely(int(i), loaded.decode([int(i)]), round(float(logprobs[i]), 4)) for i in top]))


def next_logprobs(loaded: LoadedModel, prompt: list[int]) -> np.ndarray:
    """The next token's log-probabilities after `prompt` (GPU thread: a pass of its own, in a KV
    of its own, between the lanes' steps)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(loaded.model)
    step = 2048
    for start in range(0, len(prompt) - 1, step):
        loaded.model(mx.array(prompt[start:min(start + step, len(prompt) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    logits = loaded.model(mx.array(prompt[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits)
    return np.array(logprobs[:loaded.vocab_size])


@admitted
async def generate(request: web.Request, slot: Slot) -> web.Response:
    """POST /generate."""
    req = await decode_body(request, GenerateRequest)
    loaded = ready_model(request)
    seed = req.seed if req.seed is not None else int(time.time() * 1000) & 0xFFFFFFFF
    shaped = not req.default and (req.curve is not None or (req.hlg is not None and req.hlg.enabled is not False))
    fields: dict[str, object] = {"max_tokens": req.max_tokens, "seed": seed, "n": req.n}
    if shaped:
        fields |= {"curve": req.curve, "hlg": None if req.curve is not None else (req.hlg or Hlg()).over(Hlg(enabled=True))}
    else:
        fields |= {"hlg": Hlg(enabled=False)}  # the model's own sampling, not a configured tone curve
    chat = user_chat(req.prompt, **fields)
    sampling = sampling_params(chat, loaded)  # a curve that cannot be sampled: the 400 names it
    prompt = (await rendered(loaded, chat)).prompt
    max_tokens = min(req.max_tokens, max(1, loaded.context_window - len(prompt)))
    tickets: list[Ticket] = []
    with cancel_all_on_exit(tickets):
        group = PrefillGroup(req.n, len(prompt) - 1) if req.n > 1 else None
        for i in range(req.n):
            tickets.append(submit(request, slot, prompt, max_tokens, chat, row=i, group=group))
        results = await asyncio.gather(*(collect(t) for t in tickets))
    samples = [Sample(text.strip(), looks_like_junk(text), done.finish_reason) for text, done, _ in results]
    mode = ("curve" if req.curve is not None else "hlg") if shaped else "default"
    recipe = None if shaped else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                  "top_k": float(sampling.top_k), "min_p": sampling.min_p}
    return json_response(Generated(loaded.model_id, mode, req.n, seed, samples, recipe))


UNUSED = re.compile(r"<unused\d+>")


def looks_like_junk(text: str) -> bool:
    """Another script than Latin in 2% or more of the letters, a replacement character, or an
    `<unusedN>` token: the reference's coherence flag."""
    if "\ufffd" in text or UNUSED.search(text):
        return True
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return False
    other = sum(1 for c in letters if not unicodedata.name(c, "").startswith("LATIN"))
    return other / len(letters) >= 0.02
