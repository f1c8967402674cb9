"""Structured output: grammars with llguidance, applied as a token mask while decoding.

A request's constraint (`response_format` `json_object` / `json_schema` / mlxd's `regex` and
`lark`, or the rest of a forced tool call) becomes an llguidance grammar, compiled against
the model's tokenizer off the event loop and off the GPU thread, and cached per grammar
text: a request gets a copy of the compiled matcher. On the GPU thread, `GrammarMask` is a
logits processor (mlx-lm's interface, so it runs in both lanes, per row in the batch lane):
each step it feeds the matcher the token sampled last, asks it for the bitmask of allowed
next tokens (llguidance's numpy-level API) and sets every other logit to -inf with one
compiled mx kernel, portable (llguidance's own `llguidance.mlx` helper is a Metal kernel).
Bitmasks repeat (a JSON string's, step after step), so they stay on the device by content.
The batch lane masks all its held rows in one op (batch_bias.py). Once the grammar is
complete only the end-of-sequence tokens are allowed, so the reply ends there.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from mlxd.protocol.errors import APIError

CACHE_ENTRIES = 128  # compiled grammars kept per model


class Grammars:
    """One model's llguidance tokenizer (built on first use: ~0.4 s) and compiled grammars."""

    def __init__(self, hf_tokenizer: Any, eos_ids: list[int]) -> None:
        self._hf = hf_tokenizer
        self._eos = eos_ids
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.compile_ms: dict[str, float] = {}  # the last compile time of each cached grammar

    def _lltokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, eos_token=self._eos)
            except TypeError:  # llguidance before 1.7 takes one end token (the mask allows them all at the end)
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, eos_token=self._eos[0] if self._eos else None)
        return self._tokenizer

    def matcher(self, grammar: str, param: str) -> Any:
        """A fresh matcher for `grammar` (llguidance's grammar text); a 400 naming `param` when
        it does not compile. Blocking (compiles on a miss): call it from a worker thread."""
        import llguidance

        with self._lock:
            tok = self._lltokenizer()
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
                return compiled.deep_copy()
        started = time.perf_counter()
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise APIError(400, f"The grammar is not usable: {error}", param=param)
        compiled = llguidance.LLMatcher(tok, grammar)
        if compiled.is_error():
            raise APIError(400, f"The grammar is not usable: {compiled.get_error()}", param=param)
        with self._lock:
            self._cache[grammar] = compiled
            self.compile_ms[grammar] = (time.perf_counter() - started) * 1000
            while len(self._cache) > CACHE_ENTRIES:
                old, _ = self._cache.popitem(last=False)
                self.compile_ms.pop(old, None)
        return compiled.deep_copy()


# --- what a request asks for, as grammar text -------------------------------------------------


def response_format_grammar(response_format: Any) -> str | None:
    """The grammar of a chat request's `response_format`; None for plain text. A malformed
    format is a 400 naming the field. llguidance is imported only once a grammar is asked for."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise APIError(400, "response_format must be an object.", param="response_format")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    import llguidance

    if kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "response_format json_schema needs a 'json_schema' object.",
                           param="response_format.json_schema")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise APIError(400, "json_schema.name must be a string.", param="response_format.json_schema.name")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict | bool):
            raise APIError(400, "json_schema.schema must be a JSON Schema object.",
                           param="response_format.json_schema.schema")
        return json_schema_grammar(schema, "response_format.json_schema.schema")
    if kind == "regex":
        pattern = response_format.get("regex")
        if not isinstance(pattern, str):
            raise APIError(400, "response_format regex needs a 'regex' string.", param="response_format.regex")
        return str(llguidance.LLMatcher.grammar_from_regex(pattern))
    if kind == "lark":
        lark = response_format.get("lark")
        if not isinstance(lark, str):
            raise APIError(400, "response_format lark needs a 'lark' string (a Lark grammar).",
                           param="response_format.lark")
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object, json_schema, "
                        "regex, lark).", param="response_format.type")


def json_schema_grammar(schema: Any, param: str) -> str:
    import llguidance

    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema))
    except Exception as exc:  # llguidance refuses what it cannot read
        raise APIError(400, f"The JSON schema is not usable: {exc}", param=param) from exc


def forced_call_grammar(fmt_name: str, tools: list[dict[str, Any]], function: str | None, end: str) -> str | None:
    """The rest of a forced tool call after the prefix ToolFormat.forced put in the prompt:
    the arguments held to the function's schema, then the call's closing markup; None for a
    format mlxd cannot write it for. `function` None: any of `tools`, by name."""
    schemas = {t["function"]["name"]: (t["function"].get("parameters") or {"type": "object"}) for t in tools}
    closing = "}" + ("\n" + end if end else "")
    if fmt_name in ("json_tools", "hermes_fallback"):
        key = '"arguments": '
    elif fmt_name == "llama3_json":
        key = '"parameters": '
    else:
        return None
    if function is not None:
        return "start: %json " + json.dumps(schemas[function]) + " " + json.dumps(closing)
    alternatives = " | ".join("(" + json.dumps(name + '", ' + key) + " %json " + json.dumps(schema) + ")"
                              for name, schema in schemas.items())
    return f"start: ({alternatives}) {json.dumps(closing)}"


# --- the mask on the GPU thread ---------------------------------------------------------------


ALL_ALLOWED = np.uint32(0xFFFFFFFF)


@mx.compile
def apply_words(logits: mx.array, words: mx.array) -> mx.array:
    """`logits` (rows, vocab) with every token whose bit is clear in its row of `words`
    (rows, ceil(vocab / 32) uint32, bit i of word j: token 32 j + i) set to -inf; one fused
    kernel for all rows (compiled per shape)."""
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1  # (an array made at import would
    # belong to the importing thread's stream: CUDA refuses it on the GPU thread)
    allowed = bits.reshape(words.shape[0], -1)[:, : logits.shape[-1]]
    return mx.where(allowed.astype(mx.bool_), logits, -mx.inf)


class DeviceWords:
    """Bitmasks already on the device, by content: a JSON string's or a number's mask repeats
    step after step, so most steps upload nothing (GPU thread)."""

    def __init__(self, size: int = 16) -> None:
        self._size = size
        self._arrays: OrderedDict[int, mx.array] = OrderedDict()

    def get(self, words: np.ndarray) -> mx.array:
        key = xxhash.xxh3_64_intdigest(words.tobytes()) ^ words.shape[0]
        array = self._arrays.get(key)
        if array is None:
            array = self._arrays[key] = mx.array(words)
            if len(self._arrays) > self._size:
                self._arrays.popitem(last=False)
        else:
            self._arrays.move_to_end(key)
        return array


EARLY_READ = True  # read_early's queueing (benchmarks/grammar_step.py measures without it too)


def read_early(sampled: mx.array, logits: mx.array) -> list[int]:
    """The host's copy of the tokens sampled last, read once this step's forward pass (which
    `logits` comes from, and which needs those tokens only on the GPU) is queued behind them:
    the GPU runs it while the host waits for the tokens and works out the mask. Without it
    the GPU sat idle meanwhile, every step: a held lone stream on the H200 decoded at 0.83 of
    a free one. `sampled` is queued first: the stream runs in order, and a read of an array
    queued after the forward pass would wait for that too."""
    if EARLY_READ:
        mx.async_eval(sampled)
        mx.async_eval(logits)
    return sampled.tolist()  # type: ignore[return-value]


class GrammarMask:
    """A logits processor holding a row to its grammar (see the module doc). GPU thread.

    `words` is the host half (feed the matcher, get its bitmask), shared with the batch lane's
    one-op step (batch_bias.py), which masks all held rows at once instead of row by row.
    """

    def __init__(self, matcher: Any, eos_ids: list[int]) -> None:
        self._m = matcher
        self._eos = eos_ids
        self._seen: int | None = None  # tokens in the history at the last call (None: not called yet)
        self._device = DeviceWords()

    @property
    def started(self) -> bool:
        """Called once: the row's prompt is in, and each later step brings one sampled token."""
        return self._seen is not None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        flat = tokens.reshape(-1)
        n = flat.size
        new: list[int] = []
        if self._seen is not None and n > self._seen:
            new = read_early(flat[self._seen:], logits)
        self._seen = n
        vocab = logits.shape[-1]
        words = self._device.get(self.words(new, vocab)[None])
        return apply_words(logits.reshape(1, vocab), words).reshape(logits.shape)

    def draft_limit(self, history: list[int], drafts: list[int]) -> int:
        """How many of `drafts` (tokens that would follow `history`, the row's tokens so far)
        the grammar allows in a row; the matcher is left as it was (speculation, spec/)."""
        return self.allowed_after(self._pending(history), drafts)

    def allowed_after(self, pending: list[int], drafts: list[int]) -> int:
        """How many of `drafts` the grammar allows after the matcher's tokens and `pending`."""
        if not drafts or self._m.is_error() or self._m.is_stopped():
            return 0
        return max(0, int(self._m.validate_tokens(pending + drafts)) - len(pending))

    def forced(self, history: list[int], limit: int) -> list[int]:
        """Tokens the grammar forces after `history` (a JSON key's rest, say): a draft that the
        mask would let through alone. The matcher is left as it was."""
        return self.forced_after(self._pending(history), limit)

    def forced_after(self, pending: list[int], limit: int) -> list[int]:
        """Tokens the grammar forces after the matcher's tokens and `pending`."""
        if limit <= 0 or self._m.is_error() or self._m.is_stopped():
            return []
        if pending and int(self._m.try_consume_tokens(pending)) != len(pending):
            return []
        try:
            return [int(t) for t in self._m.compute_ff_tokens()[:limit]]
        finally:
            if pending:
                self._m.rollback(len(pending))

    def _pending(self, history: list[int]) -> list[int]:
        return history[self._seen:] if self._seen is not None else []

    def rollback(self, count: int) -> None:
        """Forget the last `count` tokens the matcher took (drafts the target rejected)."""
        if count > 0:
            self._m.rollback(count)
            assert self._seen is not None
            self._seen -= count

    def catch_up(self, history: list[int]) -> None:
        """Feed the matcher the tokens of `history` it has not seen, as the next call would (a
        row handed to a lane that makes a fresh mask over the same matcher)."""
        if self._seen is not None and len(history) > self._seen:
            self._m.consume_tokens(history[self._seen:])
            self._seen = len(history)

    def words(self, new_tokens: list[int], vocab: int) -> np.ndarray:
        """Host: feed the matcher the tokens sampled since the last step; the allowed next
        tokens as ceil(vocab / 32) uint32 words. Once the grammar is complete (or lost): only
        the end-of-sequence tokens."""
        if new_tokens:
            self._m.consume_tokens(new_tokens)
        size = -(-vocab // 32)
        if self._m.is_error() or self._m.is_stopped():
            if not self._eos:
                return np.full(size, ALL_ALLOWED, dtype=np.uint32)
            out = np.zeros(size, dtype=np.uint32)
            for t in self._eos:
                if t < vocab:
                    out[t >> 5] |= np.uint32(1 << (t & 31))
            return out
        words = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint32)
        if words.size >= size:
            return words[:size]
        return np.concatenate([words, np.zeros(size - words.size, dtype=np.uint32)])  # tokens past the tokenizer's
