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

The holes and each row's left padding are also kept on the host (`host_holes`,
`host_padding`), in step with the device's: every change to them comes from the host (the
drafts each row dropped, the rows that stay), so a row that ends, a filter or a compaction
reads them there instead of from the device. Reading them from the device (as mlx-lm's
`filter` and the first `extract` did) waits for the step the GPU is running and breaks the
pipelining of one step ahead, once per layer for `extract`: on an H100 a turn in which one row
of an 8-row batch ended took 35-71 ms where a plain step took 20 (docs/benchmarks.md, issue 27).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

COMPACT_SHARE = 0.25  # holes past this share of the buffer: gather the kept keys together
COMPACT_MIN = 64  # ... and past this many positions (a short buffer is not worth a copy)


def punch(caches: list[Any], drop: list[int]) -> None:
    """Row i of every cache in `caches` (one per layer, in step) drops its last `drop[i]` positions."""
    if not any(drop):
        return
    padding: np.ndarray | None = None  # every layer's rows start where the first layer's do
    for c in caches:
        if type(c) is BatchKVCache:
            if padding is None:
                padding = np.asarray(c.left_padding.tolist(), dtype=np.int64)
            become_holey(c, padding)
        c.punch(drop)
    first = caches[0]
    if first.hole_count() > max(COMPACT_MIN, COMPACT_SHARE * first._idx * first.offset.shape[0]):
        for c in caches:
            c.compact()


def become_holey(c: Any, padding: np.ndarray | None = None) -> None:
    """A BatchKVCache becomes a HoleyKV with no holes yet (`padding`: its rows' left padding, if
    the caller read it already)."""
    c.__class__ = HoleyKV
    c.host_padding = (np.asarray(c.left_padding.tolist(), dtype=np.int64) if padding is None
                      else np.array(padding, dtype=np.int64))
    rows = c.offset.shape[0]
    c.host_holes = np.zeros((rows, c._idx), dtype=np.bool_)
    c.holes = mx.zeros((rows, c._idx), dtype=mx.bool_)


def fit(holes: Any, width: int, xp: Any, left: bool = False) -> Any:
    """A hole mask (numpy's or MLX's: `xp`) padded with positions that are no holes to `width`,
    on the right (cut there when wider), or on the left with `left` (rows right-aligned)."""
    have = holes.shape[1]
    if have >= width:
        return holes if left else holes[:, :width]
    pad = xp.zeros((holes.shape[0], width - have), dtype=xp.bool_)
    return xp.concatenate([pad, holes] if left else [holes, pad], axis=1)


class HoleyKV(BatchKVCache):
    """A BatchKVCache whose rows may have holes: positions kept in the buffer and masked out."""

    holes: mx.array  # (rows, at most _idx): True where a position was dropped (for the masks)
    host_holes: np.ndarray  # the same, on the host
    host_padding: np.ndarray  # (rows,): each row's left padding, as `left_padding` holds it

    def _holes(self, width: int) -> mx.array:
        """The hole mask cut or padded (no holes) to `width` positions."""
        return fit(self.holes, width, mx)

    def _host(self, width: int) -> np.ndarray:
        """The host's hole mask cut or padded (no holes) to `width` positions."""
        return fit(self.host_holes, width, np)

    def punch(self, drop: list[int]) -> None:
        ends = self._idx - np.asarray(drop, dtype=np.int64)
        self.host_holes = self._host(self._idx) | (np.arange(self._idx)[None, :] >= ends[:, None])
        self.holes = self._holes(self._idx) | (mx.arange(self._idx)[None, :] >= mx.array(ends.tolist())[:, None])
        self.offset = self.offset - mx.array(drop)

    def hole_count(self) -> int:
        return int(self._host(self._idx).sum())

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        return mask & ~self._holes(self._idx + N)[:, None, None, :]

    def trim(self, n: int) -> int:
        before = self._idx
        n = super().trim(n)  # every row's offset back by n...
        gone = self._host(before)[:, self._idx:].sum(axis=1)
        if gone.any():
            self.offset = self.offset + mx.array(gone.astype(np.int32))  # ... of which holes never counted
        self.host_holes, self.holes = self._host(self._idx), self._holes(self._idx)  # past the end: written again
        return n

    def filter(self, batch_indices: Any) -> None:
        """mlx-lm's filter, its padding read on the host: the rows `batch_indices` stay, and the
        padding they all have is cut off the front."""
        keep = [int(i) for i in batch_indices]
        index = mx.array(keep, dtype=mx.int32)
        holes, padding = self._host(self._idx)[keep], self.host_padding[keep]
        device_holes = self._holes(self._idx)[index]
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[index], self.values[index]
        self.offset, self.left_padding = self.offset[index], self.left_padding[index]
        shift = int(padding.min()) if keep else 0
        if shift > 0:
            if self.keys is not None and self.values is not None:
                self.keys, self.values = self.keys[..., shift:, :], self.values[..., shift:, :]
            self._idx -= shift
            self.left_padding = self.left_padding - shift
        self.host_padding = padding - shift
        self.host_holes, self.holes = holes[:, shift:], device_holes[:, shift:]

    def extend(self, other: Any) -> None:
        if isinstance(other, HoleyKV):
            theirs, their_padding, theirs_device = other._host(other._idx), other.host_padding, other._holes(other._idx)
        else:
            theirs = np.zeros((other.offset.shape[0], other._idx), dtype=np.bool_)
            their_padding = np.asarray(other.left_padding.tolist(), dtype=np.int64)  # a new row's: once, as it joins
            theirs_device = mx.zeros(theirs.shape, dtype=mx.bool_)
        ours, ours_device, widest = self._host(self._idx), self._holes(self._idx), max(self._idx, other._idx)
        both_empty = self.keys is None and other.keys is None  # mlx-lm's extend moves nothing then
        shifts = (0, 0) if both_empty else (widest - self._idx, widest - other._idx)
        super().extend(other)  # both right-aligned to the longer one's end
        width = self._idx

        self.host_padding = np.concatenate([self.host_padding + shifts[0], their_padding + shifts[1]])
        self.host_holes = np.concatenate([fit(ours, width, np, left=True), fit(theirs, width, np, left=True)], axis=0)
        self.holes = mx.concatenate([fit(ours_device, width, mx, left=True), fit(theirs_device, width, mx, left=True)],
                                    axis=0)

    def _kept(self, idx: int) -> np.ndarray:
        """Row `idx`'s kept positions, in order."""
        start = int(self.host_padding[idx])
        return np.flatnonzero(~self._host(self._idx)[idx, start:]) + start

    def extract(self, idx: int) -> KVCache:
        """Row `idx`'s kept keys alone, as a plain cache (a finished or paused row's KV)."""
        kept = self._kept(idx)
        cache = KVCache()
        assert self.keys is not None and self.values is not None
        if kept.size and kept[-1] - kept[0] + 1 == kept.size:  # no holes in the row: a slice
            span = slice(int(kept[0]), int(kept[-1]) + 1)
            cache.keys = mx.contiguous(self.keys[idx:idx + 1, :, span])
            cache.values = mx.contiguous(self.values[idx:idx + 1, :, span])
        else:
            positions = mx.array(kept, dtype=mx.int32)
            cache.keys = mx.contiguous(mx.take(self.keys[idx:idx + 1], positions, axis=2))
            cache.values = mx.contiguous(mx.take(self.values[idx:idx + 1], positions, axis=2))
        cache.offset = cache.keys.shape[2]
        return cache

    def prepare(self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
        if right_padding is not None and max(right_padding) > 0:
            self.compact()  # the roll below moves whole rows: no holes in them first
            self.prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
            return
        if left_padding is not None:
            self.host_padding = self.host_padding + np.asarray(left_padding, dtype=np.int64)
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)

    def compact(self) -> None:
        """Gather each row's kept keys together, right-aligned as before; a plain BatchKVCache after."""
        width = self._idx
        rows: list[np.ndarray] = []
        pads: list[int] = []
        for r in range(self.host_holes.shape[0]):
            kept = self._kept(r)
            pads.append(width - kept.size)
            rows.append(np.concatenate([np.full(width - kept.size, kept[0] if kept.size else 0), kept]))
        index = mx.array(np.stack(rows) if rows else np.zeros((0, width)), dtype=mx.int32)[:, None, :, None]
        if self.keys is not None:
            self.keys = mx.take_along_axis(self.keys[..., :width, :], index, axis=2)
            self.values = mx.take_along_axis(self.values[..., :width, :], index, axis=2)
        self.left_padding = mx.array(pads)
        del self.holes, self.host_holes, self.host_padding
        self.__class__ = BatchKVCache  # type: ignore[assignment]
        shift = min(pads, default=0)
        if shift and self.keys is not None:  # padding every row has: cut, as filter does
            self.keys = self.keys[..., shift:, :]
            self.values = self.values[..., shift:, :]
            self._idx -= shift
            self.left_padding = self.left_padding - shift
