"""A draft model drafting for the batch: its own batch KV, kept in step with the batch's rows (GPU thread).

Each row's draft KV holds a prefix of the row's tokens (`fed`). A drafting step first syncs the
rows (those that left are filtered out; a new one has its history prefilled alone and joins at
the end, as mlx-lm's batch appends rows), then feeds every row what it has not yet seen (the
tokens since, and the row's next token), padded to the longest with positions that become holes
(holes.py), and drafts greedily for all rows at once. After the verification `settle` keeps, per
row, the drafts the target kept (those fed), and drops the rest as holes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxd.engine.spec.drafters import greedy_pick
from mlxd.engine.spec.holes import punch


class DraftModelBatch:
    """The draft model's KV for the batch's rows, by uid, in the batch's order."""

    def __init__(self, model: Any, prefill_step: int = 512) -> None:
        self._model = model
        self._prefill_step = max(1, prefill_step)
        self._kv: list[Any] | None = None
        self._uids: list[int] = []
        self._fed: list[int] = []  # tokens of each row in the draft KV
        self._count = 0  # drafts a row of the last proposal has (0: none waits for `settle`)
        self._base: list[int] = []  # each row's token count before that proposal

    @property
    def pending(self) -> bool:
        """A proposal waits for `settle`."""
        return self._count > 0

    def sync(self, uids: list[int], histories: list[list[int]]) -> None:
        """Match the batch's rows `uids` (their known tokens `histories`, all but the next one)."""
        live = set(uids)
        keep = [i for i, uid in enumerate(self._uids) if uid in live]
        if len(keep) < len(self._uids):
            if keep and self._kv is not None:
                for c in self._kv:
                    c.filter(keep)
            else:
                self._kv = None
            self._uids = [self._uids[i] for i in keep]
            self._fed = [self._fed[i] for i in keep]
        if self._uids != uids[:len(self._uids)]:  # not the order mlx-lm keeps: start again
            self._kv, self._uids, self._fed = None, [], []
        for uid, history in zip(uids[len(self._uids):], histories[len(self._uids):], strict=True):
            self._join(uid, history)

    def _join(self, uid: int, history: list[int]) -> None:
        kv = make_prompt_cache(self._model)
        with mx.stream(generation_stream):
            for start in range(0, len(history), self._prefill_step):
                self._model(mx.array(history[start:start + self._prefill_step])[None], cache=kv)
                mx.eval([c.state for c in kv])
        row = [BatchKVCache.merge([c]) for c in kv]
        if self._kv is None:
            self._kv = row
        else:
            for c, o in zip(self._kv, row, strict=True):
                c.extend(o)
        self._uids.append(uid)
        self._fed.append(len(history))

    def propose(self, tokens: list[list[int]], count: int) -> list[list[int]]:
        """`count` greedy drafts for each row after its `tokens` (its history and next token)."""
        assert self._kv is not None and len(tokens) == len(self._uids)
        pending = [t[fed:] for t, fed in zip(tokens, self._fed, strict=True)]
        width = max(len(p) for p in pending)
        inputs = mx.array([p + [p[-1]] * (width - len(p)) for p in pending])
        with mx.stream(generation_stream):
            logits = self._model(inputs, cache=self._kv)
            last = mx.array([len(p) - 1 for p in pending])
            token = greedy_pick(mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0, :])[:, None]
        punch(self._kv, [width - len(p) for p in pending])  # the padding: never seen
        out = [token]
        with mx.stream(generation_stream):
            for _ in range(count - 1):
                token = greedy_pick(self._model(token, cache=self._kv)[:, -1, :])[:, None]
                out.append(token)
            drafts = mx.concatenate(out, axis=1)
            mx.eval(drafts)
        self._base = [len(t) for t in tokens]
        self._count = count
        self._fed = [n + count - 1 for n in self._base]
        return drafts.tolist()  # type: ignore[return-value]

    def settle(self, kept: list[int]) -> None:
        """Row i kept its first `kept[i]` drafts: the draft KV keeps those it was fed, no more."""
        fed = self._count - 1  # the last draft was not fed
        keep = [min(k, fed) for k in kept]
        drop = [fed - k for k in keep]
        assert self._kv is not None
        low = min(drop)
        if low:
            for c in self._kv:
                c.trim(low)
        punch(self._kv, [d - low for d in drop])
        self._fed = [b + k for b, k in zip(self._base, keep, strict=True)]
        self._count = 0
