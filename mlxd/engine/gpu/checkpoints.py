"""Generation checkpoints: a running row's KV on SSD as it grows.

An engine that dies mid-reply loses the KV in its memory; the supervisor then continues the
reply on a new engine (docs/resume.md), whose prompt is the old prompt plus the tokens already
delivered. Without a checkpoint that is a prefill of all of them. With one, the SSD tier holds
a prefix of that prompt (the tier is scanned at start, so the new engine finds it), and the
continuation prefills only the tokens after it.

A row is checkpointed when `interval` tokens of its history have KV that is not on SSD (or on
its way there): its prompt right after its first token, when at least `interval` of it came
from no cache, then every `interval` tokens it generates. (Checkpoints a sixteenth of the
prompt apart, at least 128 tokens, took a resume on the 2-core CPU from the restart plus 18% of
the prompt's cold prefill to 7%, but decode with them on from 1.01 of off to 0.87: not the
default; docs/benchmarks.md, issue 29, 2026-12-07.) The first checkpoint is a whole file, unless
the prompt cache served the row's prompt from a file on SSD (an agent's next turn): then a delta
file on that one, holding only the KV after what it served. Each next one is a delta file
holding only the KV after the one before, which it names as its base (a chain: each token is
written once, the prompt not again at every checkpoint), until CHAIN deltas stand on the whole
file, when a whole file is written again. The tier restores a delta
by joining its chain. The GPU thread queues a copy of what the file holds behind the step under
way (a batch row's KV cut from the batch as views: `rows_kv`) and goes on; at its next step
(when that copy is surely made) it hands the copy's host buffers to the SSD tier's writer
thread, which writes the file while decoding goes on (prefix_cache.py `checkpoint`,
`send_checkpoints`). On CUDA, where MLX reading a GPU array on the host moves its buffer (3-6%
of decode at 8 streams), a kernel on a stream of its own copies the blocks into page-locked host
memory instead and the writer waits for them there (cache/pinned.py); where that memory is not
to be had, or is full, the blocks are read a few a step (READ_A_TURN). A checkpoint the writer
is too far behind for is skipped, never waited for.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd.engine.cache import kv_layout, pinned
from mlxd.engine.cache.kv_layout import view
from mlxd.engine.cache.live_rows import LiveRows
from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu import media
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.models.loaded_model import LoadedModel

log = logging.getLogger("mlxd.engine")
KEEP_CUT = 8  # rows cut off (cancelled) whose checkpoints stay named for the next engine
CHAIN = 32  # deltas on one whole file, at most: then a whole file again (restoring reads each)


class Checkpoints:
    """When a row is due a checkpoint, and taking it (GPU thread)."""

    def __init__(self, interval: int, cache: PrefixCache, loaded: LoadedModel) -> None:
        self.interval = interval if cache.ssd is not None else 0  # no SSD tier: nowhere to keep them
        self._cache = cache
        self._loaded = loaded
        # each running row's checkpoints (newest first), shown beside the tier for the next engine
        self._live: dict[int, tuple[Sequence, list[str]]] = {}
        self._cut: deque[list[str]] = deque(maxlen=KEEP_CUT)  # ... and the last rows cut off (oldest first)
        self._shown = LiveRows(cache.ssd.dir) if self.interval and cache.ssd is not None else None
        if self.interval and kv_layout.GROUP and cache.copier is None and (size := pinned.default_bytes(cache.cap_bytes)):
            cache.copier = pinned.Copier.start(size)  # CUDA: copies to the host by a kernel (pinned.py)

    def due(self, seq: Sequence) -> bool:
        """`interval` tokens of its history have KV that is not on SSD (and it is generating)."""
        return (self.interval > 0 and bool(seq.generated) and not seq.is_finished
                and len(seq.job.prompt) + len(seq.generated) - seq.saved >= self.interval)

    def take(self, seq: Sequence, kv: list[Any], tokens: list[int]) -> None:
        """Checkpoint `kv`, which holds a prefix of `tokens` (the row's history) and is the row's
        own (serial lane) or a copy of it (batch lane). Skipped or not, the row is not due again
        for another `interval` tokens."""
        offset = getattr(kv[0], "offset", None) if kv else None
        if not isinstance(offset, int) or offset <= 0:
            return
        if offset > len(tokens):  # drafts past the history (the serial lane's speculator)
            kv, offset = view(kv, len(tokens)), len(tokens)
        prompt = len(seq.job.prompt)
        if seq.base is None and seq.saved < prompt < offset:
            # its first: the prompt alone, the same file for every row with this prompt (the
            # choices of one request, say), which each row's deltas then share as their base
            kv, offset = view(kv, prompt), prompt
        base = seq.base
        ssd = self._cache.ssd
        if base is not None and (base.write_failed or (base.on_ssd and ssd is not None and base.name not in ssd)
                                 or base.links >= CHAIN):
            base = None  # its file failed or is gone, or the chain is long: a whole file again
        # the first may stand on the prompt cache's file its prompt came from
        cached = seq.cached if seq.base is None else 0
        try:
            taken = media.checkpoint(self._cache, self._loaded, seq.job, kv, tokens, base, cached)
        except Exception:  # a checkpoint must never cost the reply
            log.exception("generation checkpoint failed; generation goes on")
            taken = None
        if taken is not None:  # the next: what follows it
            seq.base = taken
        seq.saved = offset
        if taken is not None and self._shown is not None:
            # this one, the one before (if this one's write is cut, the tier still has it) and its base
            before = self._live.get(id(seq), (seq, []))[1][:1]
            base = [taken.base[0]] if taken.base is not None else []
            self._live[id(seq)] = (seq, list(dict.fromkeys([taken.name, *before, *base])))
            self._show()

    def prune(self) -> None:
        """Forget the rows that ended (Runner.turn, after the lanes' steps), but for the last
        KEEP_CUT cut off (cancelled): a client that went away, or the supervisor, whose death
        cancels every row before the stop does, may come back for them."""
        ended = [key for key, (seq, _) in self._live.items() if seq.is_finished]
        for key in ended:
            seq, names = self._live.pop(key)
            if seq.finish_reason == "cancelled":
                self._cut.append(names)
        if ended:
            self._show()

    def _show(self) -> None:
        log.debug("checkpoints: running rows %s, cut %d", [names[:1] for _, names in self._live.values()], len(self._cut))
        if self._shown is not None:  # the running rows first, then the cut ones, the last cut first
            self._shown.show([*(names for _, names in self._live.values()), *reversed(self._cut)])

    def serial(self, seq: Sequence, kv: list[Any]) -> None:
        """The serial lane's running row, after its tokens of this step."""
        self._cache.send_checkpoints()
        if self.due(seq):
            self.take(seq, kv, seq.history)

    def batch(self, gen: BatchGenerator, rows: dict[int, Sequence]) -> None:
        """The batch lane's rows that are due, after a step: their KV copied out of the batch."""
        self._cache.send_checkpoints()
        due = [uid for uid, seq in rows.items() if self.due(seq)]
        if not due:
            return
        for uid, (kv, tokens) in rows_kv(gen, due).items():
            if kv is not None and tokens is not None:  # the tokens its KV holds (as _remove stores them)
                self.take(rows[uid], kv, list(tokens))


def rows_kv(gen: BatchGenerator, uids: list[int]) -> dict[int, tuple[Any, Any]]:
    """Each row's KV and the tokens it holds: views into the generating batch's cache where its
    layers are all plain BatchKVCache (nothing copied here: a checkpoint's staging copies only
    what it writes, a delta's few tokens); else mlx-lm's `extract_cache`, which copies each
    row's whole KV, and reads each layer's padding on the host."""
    batch = getattr(gen, "_generation_batch", None)
    caches = getattr(batch, "prompt_cache", None)
    if batch is None or not caches or any(type(c) is not BatchKVCache or c.keys is None for c in caches) \
            or len({c._idx for c in caches}) != 1:
        return dict(gen.extract_cache(uids))
    index = {uid: i for i, uid in enumerate(batch.uids)}
    pads = caches[0].left_padding.tolist()  # every layer's is the same (made and cut together)
    out: dict[int, tuple[Any, Any]] = {}
    for uid in uids:
        if (i := index.get(uid)) is None:
            out.update(gen.extract_cache([uid]))
            continue
        kv = []
        for c in caches:
            row = KVCache()
            row.keys = c.keys[i:i + 1, :, pads[i]:c._idx]
            row.values = c.values[i:i + 1, :, pads[i]:c._idx]
            row.offset = c._idx - pads[i]
            kv.append(row)
        out[uid] = (kv, batch.tokens[i])
    return out
