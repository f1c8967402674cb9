"""Drafts from a model: a small draft model of the same tokenizer, or the target's own first layers.

Both draft greedily, one token a pass, as many as the verification takes (`limit`); the serial
lane's Speculator (serial.py) asks for them when the row's KV holds all its tokens but the last.

- **ModelDrafter** runs a second, smaller model with a KV of its own. That KV outlives the
  request: the next one keeps the prefix both share (a conversation's next turn, an agent's
  next call) and feeds the draft model only the rest, in chunks, before its first token is timed.
- **SelfDrafter** (`self:N`) runs the target's first N layers, its final norm and its head: a
  shallow copy of the model whose layer list is cut, sharing the weights (no memory). Those
  layers' KV is the target's own: the drafter writes its tokens there, then trims them off,
  and the verification writes them again through every layer. It needs no prefill of its own.

`open_draft` makes what a model drafts with at load, and refuses a draft that cannot work: a
draft model whose tokenizer is not the target's, a self-draft as deep as the model.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from mlxd.engine.spec.config import DraftConfig
from mlxd.engine.spec.ngram import NgramDrafter

log = logging.getLogger("mlxd.engine")

# Texts both tokenizers must encode alike: words, digits, code, JSON, accents, CJK and an emoji.
PROBES = (
    "The 3 quick brown foxes jumped over the lazy dog?! Ünïcödé, 日本語 and 🦊 too.",
    'def total(items):\n    return sum(x["price"] * x["count"] for x in items)  # 42\n',
    '{"id": 1024, "tags": ["a", "b"], "ok": true, "ratio": 0.75}',
)


class Drafter(Protocol):
    """Drafts for one row (ngram.py's NgramDrafter and the drafters here)."""

    def start(self, tokens: list[int]) -> None:
        """The row's prompt is in the target's KV (all but its last token): get ready to draft."""

    def ready(self, tokens: list[int]) -> bool:
        """Whether a draft after `tokens` is likely (cheap: asked after every plain token)."""

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens to follow `tokens`."""


class DraftSource:
    """What one model drafts with; makes each row's drafter."""

    def __init__(self, config: DraftConfig, model: Any = None, vocab_size: int = 0, prefill_step: int = 512) -> None:
        self.config = config
        self._model = model  # the draft model, or the target cut to its first layers
        self._vocab_size = vocab_size  # the target's: a draft at or past it is cut
        self._prefill_step = prefill_step
        self._kept: ModelDrafter | None = None  # the draft model's drafter, with its KV, between requests
        self._cut: Any = None  # a self-draft's shallow model, made at first use (after the model's patches)
        self.kv_bytes_per_token = 0  # a draft model's KV for one token (the KV budget counts it beside the model's)

    @property
    def kind(self) -> str:
        return self.config.kind

    def draft_model(self) -> Any:
        """A draft model's model."""
        return self._model

    @property
    def prefill_step(self) -> int:
        return self._prefill_step

    def shallow_model(self) -> Any:
        """A self-draft's model: the target cut to its first layers (made at first use)."""
        if self._cut is None:
            self._cut = shallow(self._model, self.config.layers)
        return self._cut

    def drafter(self, kv: list[Any]) -> Drafter:
        """A drafter for a serial row whose target KV is `kv`."""
        if self.config.kind == "self":
            return SelfDrafter(self.shallow_model(), kv[:self.config.layers], self._vocab_size)
        if self.config.kind == "model":
            if self._kept is None:
                self._kept = ModelDrafter(self._model, self._vocab_size, self._prefill_step)
            return self._kept
        return NgramDrafter()


def open_draft(config: DraftConfig, model: Any, tokenizer: Any, vocab_size: int, prefill_step: int,
               load: Any = None) -> DraftSource | None:
    """What the target `model` drafts with (None: it does not); raises ValueError when the
    draft cannot work with it. `load(path)` loads a draft model: (model, tokenizer)."""
    if config.kind == "none":
        return None
    if config.kind == "ngram":
        return DraftSource(config)
    if config.kind == "self":
        shallow(model, config.layers)  # refuses a model it cannot cut
        return DraftSource(config, model, vocab_size)
    assert load is not None
    draft_model, draft_tokenizer = load(config.model)
    if why := tokenizer_mismatch(tokenizer, draft_tokenizer):
        raise ValueError(f"the draft model {config.model} does not share the model's tokenizer: {why}")
    if not can_trim_prompt_cache(make_prompt_cache(draft_model)):
        raise ValueError(f"the draft model {config.model} keeps a KV that cannot be rolled back "
                         "(sliding-window or recurrent layers): it cannot draft")
    return DraftSource(config, draft_model, vocab_size, prefill_step)


def shallow(model: Any, layers: int) -> Any:
    """`model` cut to its first `layers` decoder layers (its embedding, final norm and head kept),
    sharing its weights; raises ValueError where the model is not built that way."""
    inner: Any = getattr(model, "model", None)
    blocks = getattr(inner, "layers", None)
    if not isinstance(blocks, list) or not blocks:
        raise ValueError(f"self-drafts need a model whose decoder layers are model.layers; "
                         f"{type(model).__module__} is built otherwise")
    if layers >= len(blocks):
        raise ValueError(f"draft self:{layers} must use fewer layers than the model has ({len(blocks)})")
    kv = make_prompt_cache(model)
    if len(kv) != len(blocks) or not can_trim_prompt_cache(kv):
        raise ValueError("self-drafts need one trimmable KV cache per layer (this model has sliding-window or "
                         "recurrent layers)")
    cut = copy.copy(inner)
    cut.layers = blocks[:layers]
    top = copy.copy(model)
    top.model = cut
    return top


def tokenizer_mismatch(target: Any, draft: Any) -> str | None:
    """Why `draft`'s tokens do not mean what `target`'s do (None: they do)."""
    for probe in PROBES:
        a, b = list(target.encode(probe)), list(draft.encode(probe))
        if a != b:
            return f"{probe[:24]!r}... encodes as {a[:6]}... for the model and {b[:6]}... for the draft"
    ours, theirs = target.get_vocab(), draft.get_vocab()
    differ = [tok for tok, i in theirs.items() if ours.get(tok) != i]
    if differ:
        return (f"{len(differ)} of the draft's {len(theirs)} tokens are missing from the model's vocabulary or have "
                f"other ids there (such as {differ[0]!r})")
    return None


def greedy_pick(logits: mx.array) -> mx.array:
    """The greedy token of each row of `logits` (rows, vocab) as the target picks it: the argmax
    of the log probabilities in the model's dtype (mlx-lm's `logits - logsumexp(logits)`), not
    of the raw logits. In bfloat16 the subtraction rounds logits closer than its step (1/16 at
    10) to one value, and argmax then takes the lowest id among them. Drafts ranked by raw logits
    missed the target's pick wherever that happened: everywhere, for a random bf16 model's flat
    logits (0 of 128 drafts kept on the H200, docs/benchmarks.md)."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


def greedy_drafts(model: Any, kv: list[Any], inputs: mx.array, limit: int) -> mx.array:
    """(rows, limit) greedy tokens (`greedy_pick`), each row's first after the pass over its
    `inputs` (rows, tokens); the last is not fed (lazy until the caller evaluates it)."""
    out = []
    logits = model(inputs, cache=kv)[:, -1, :]
    for i in range(limit):
        token = greedy_pick(logits)[:, None]
        out.append(token)
        if i + 1 < limit:
            logits = model(token, cache=kv)[:, -1, :]
    return mx.concatenate(out, axis=1)


def _cut(drafts: list[int], vocab_size: int) -> list[int]:
    """The drafts before the first one the target cannot emit (a draft vocabulary's padding)."""
    for i, token in enumerate(drafts):
        if vocab_size and token >= vocab_size:
            return drafts[:i]
    return drafts


class SelfDrafter:
    """Drafts from the target's first layers, in those layers' own KV (trimmed after)."""

    def __init__(self, model: Any, kv: list[Any], vocab_size: int) -> None:
        self._model = model
        self._kv = kv
        self._vocab_size = vocab_size

    def start(self, tokens: list[int]) -> None:
        pass

    def ready(self, tokens: list[int]) -> bool:
        return True

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        if limit <= 0:
            return []
        assert self._kv[0].offset == len(tokens) - 1, "the row's KV holds all its tokens but the last"
        with mx.stream(generation_stream):
            drafts = greedy_drafts(self._model, self._kv, mx.array(tokens[-1:])[None], limit)[0]
            mx.eval(drafts)
        trim_prompt_cache(self._kv, limit)  # the last token and all drafts but the last were fed
        return _cut(drafts.tolist(), self._vocab_size)  # type: ignore[arg-type]


class ModelDrafter:
    """Drafts from a draft model, its KV kept between requests (the prefix they share is kept)."""

    def __init__(self, model: Any, vocab_size: int, prefill_step: int) -> None:
        self._model = model
        self._vocab_size = vocab_size
        self._prefill_step = max(1, prefill_step)
        self._kv = make_prompt_cache(model)
        self._fed: list[int] = []  # the tokens in `_kv`

    def start(self, tokens: list[int]) -> None:
        self._catch_up(tokens[:-1])

    def ready(self, tokens: list[int]) -> bool:
        return True

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        if limit <= 0:
            return []
        self._catch_up(tokens[:-1])
        pending = tokens[len(self._fed):]
        with mx.stream(generation_stream):
            drafts = greedy_drafts(self._model, self._kv, mx.array(pending)[None], limit)[0]
            mx.eval(drafts)
        out: list[int] = drafts.tolist()  # type: ignore[assignment]
        self._fed = [*tokens, *out[:-1]]
        return _cut(out, self._vocab_size)

    def _catch_up(self, tokens: list[int]) -> None:
        """Have the draft KV hold exactly `tokens`: keep the prefix it shares with them, feed the rest
        in chunks (all of it, or all but a last chunk `propose` feeds with its first pass)."""
        shared = 0
        for a, b in zip(self._fed, tokens, strict=False):
            if a != b:
                break
            shared += 1
        if len(self._fed) > shared:
            trim_prompt_cache(self._kv, len(self._fed) - shared)
            del self._fed[shared:]
        while len(tokens) - len(self._fed) > 0:
            chunk = tokens[len(self._fed):len(self._fed) + self._prefill_step]
            with mx.stream(generation_stream):
                self._model(mx.array(chunk)[None], cache=self._kv)
                mx.eval([c.state for c in self._kv])
            self._fed.extend(chunk)
