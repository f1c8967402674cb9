"""A batch KV with holes: a row's refused drafts masked out where they lie instead of rolled away.

mlx-lm's `BatchKVCache` keeps each row's keys contiguous and right-aligned at one shared end,
left padding before them. After a verification rows keep different numbers of tokens; making
each row contiguous again rolls its whole buffer (`prepare(right_padding)` + `finalize`), a
copy of the batch's KV at every such step: on the 2-core CPU, with 8 rows of 700 tokens of
SmolLM2, 200 ms on top of a 340 ms pass (docs/benchmarks.md).

`HoleyKV` is that cache with a boolean mask of dropped positions: a row's refused drafts stay
in the buffer as holes; attention never sees them (`make_mask`), and the row's position (its
`offset`, which RoPE reads) goes back by their count, so the row's next tokens take the
positions they would have had. A row leaving (`extract`) takes only its kept keys. When
holes reach a quarter of the buffer, `compact` gathers each row's kept keys together once and
the cache is a plain `BatchKVCache` again.

A cache becomes one by `punch` (its class swapped in place: mlx-lm's batch keeps the objects);
`filter`, `extend`, `trim` and `extract` keep the holes in step with the keys.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

COMPACT_SHARE = 0.25  # holes past this share of the buffer: gather the kept keys together
COMPACT_MIN = 64  # ... and past this many positions (a short buffer is not worth a copy)


def punch(caches: list[Any], drop: list[int]) -> None:
    """Row i of every cache in `caches` (one per layer, in step) drops its last `drop[i]` positions."""
    if not any(drop):
        return
    for c in caches:
        if type(c) is BatchKVCache:
            become_holey(c)
        c.punch(drop)
    first = caches[0]
    if first.hole_count() > max(COMPACT_MIN, COMPACT_SHARE * first._idx * first.offset.shape[0]):
        for c in caches:
            c.compact()


def become_holey(c: Any) -> None:
    c.__class__ = HoleyKV
    c.holes = mx.zeros((c.offset.shape[0], c._idx), dtype=mx.bool_)


class HoleyKV(BatchKVCache):
    """A BatchKVCache whose rows may have holes: positions kept in the buffer and masked out."""

    holes: mx.array  # (rows, at least _idx): True where a position was dropped

    def _holes(self, width: int) -> mx.array:
        """The hole mask cut or padded (no holes) to `width` positions."""
        have = self.holes.shape[1]
        if have >= width:
            return self.holes[:, :width]
        return mx.concatenate([self.holes, mx.zeros((self.holes.shape[0], width - have), dtype=mx.bool_)], axis=1)

    def punch(self, drop: list[int]) -> None:
        ends = self._idx - mx.array(drop)[:, None]
        self.holes = self._holes(self._idx) | (mx.arange(self._idx)[None, :] >= ends)
        self.offset = self.offset - mx.array(drop)

    def hole_count(self) -> int:
        return int(self._holes(self._idx).sum().item())  # type: ignore[arg-type]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        return mask & ~self._holes(self._idx + N)[:, None, None, :]

    def trim(self, n: int) -> int:
        before = self._idx
        n = super().trim(n)  # every row's offset back by n...
        self.offset = self.offset + self._holes(before)[:, self._idx:].sum(axis=1)  # ... of which holes never counted
        self.holes = self._holes(self._idx)  # positions past the end are written again
        return n

    def filter(self, batch_indices: Any) -> None:
        before = self._idx
        holes = self._holes(before)[mx.array(batch_indices)]
        super().filter(batch_indices)
        self.holes = holes[:, before - self._idx:]  # the padding all rows shared is cut off the front

    def extend(self, other: Any) -> None:
        ours = self._holes(self._idx)
        theirs = (other._holes(other._idx) if isinstance(other, HoleyKV)
                  else mx.zeros((other.offset.shape[0], other._idx), dtype=mx.bool_))
        super().extend(other)  # both right-aligned to the longer one's end
        width = self._idx

        def left_pad(h: mx.array) -> mx.array:
            pad = width - h.shape[1]
            return mx.concatenate([mx.zeros((h.shape[0], pad), dtype=mx.bool_), h], axis=1) if pad else h

        self.holes = mx.concatenate([left_pad(ours), left_pad(theirs)], axis=0)

    def extract(self, idx: int) -> KVCache:
        """Row `idx`'s kept keys alone, as a plain cache (a finished or paused row's KV)."""
        mx.eval(self.left_padding, self.holes)
        start = int(self.left_padding[idx].item())  # type: ignore[arg-type]
        holes: list[bool] = self._holes(self._idx)[idx].tolist()  # type: ignore[assignment]
        kept = mx.array([p for p in range(start, self._idx) if not holes[p]], dtype=mx.int32)
        cache = KVCache()
        assert self.keys is not None and self.values is not None
        cache.keys = mx.contiguous(mx.take(self.keys[idx:idx + 1], kept, axis=2))
        cache.values = mx.contiguous(mx.take(self.values[idx:idx + 1], kept, axis=2))
        cache.offset = cache.keys.shape[2]
        return cache

    def prepare(self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
        if right_padding is not None and max(right_padding) > 0:
            self.compact()  # the roll below moves whole rows: no holes in them first
            self.prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
            return
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)

    def compact(self) -> None:
        """Gather each row's kept keys together, right-aligned as before; a plain BatchKVCache after."""
        holes = self._holes(self._idx)
        mx.eval(holes, self.left_padding)
        width = self._idx
        rows: list[list[int]] = []
        pads: list[int] = []
        starts: list[int] = self.left_padding.tolist()  # type: ignore[assignment]
        masks: list[list[bool]] = holes.tolist()  # type: ignore[assignment]
        for row, start in zip(masks, starts, strict=True):
            kept = [p for p in range(start, width) if not row[p]]
            pads.append(width - len(kept))
            rows.append([kept[0] if kept else 0] * (width - len(kept)) + kept)
        index = mx.array(rows, dtype=mx.int32)[:, None, :, None]
        if self.keys is not None:
            self.keys = mx.take_along_axis(self.keys[..., :width, :], index, axis=2)
            self.values = mx.take_along_axis(self.values[..., :width, :], index, axis=2)
        self.left_padding = mx.array(pads)
        del self.holes
        self.__class__ = BatchKVCache  # type: ignore[assignment]
        shift = min(pads)
        if shift and self.keys is not None:  # padding every row has: cut, as filter does
            self.keys = self.keys[..., shift:, :]
            self.values = self.values[..., shift:, :]
            self._idx -= shift
            self.left_padding = self.left_padding - shift
