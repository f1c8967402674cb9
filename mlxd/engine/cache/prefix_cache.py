"""The prompt cache: many prefixes' KV in RAM, and behind it the SSD tier.

Agents resend their whole transcript every turn, and clients share system prompts: the
longest cached prefix of a new prompt saves its prefill. Entries hold an mlx-lm KV cache and
the tokens it covers. A lookup compares the prompt with every entry, in RAM and on SSD, and
takes the one sharing the longest prefix; a trimmable cache (mlx-lm's `KVCache`,
`QuantizedKVCache`) serves any prefix of itself, so one entry for a whole conversation also
serves the next turn that re-sends its reply tokenized differently (it shares at least the
prompt up to that reply). A lane gets a view of an entry (arrays sliced to the shared
length), never the entry's own objects, so entries never change.

Why not mlx-lm's `LRUPromptCache`: it has no hook when it evicts (an evicted entry here is
written to SSD first), it deep-copies an entry on every fetch, and its token-level trie holds
a dict per token of every prefix (100k-token agent transcripts). Entries here are few (the byte
cap bounds them) and a numpy comparison of a prompt with each takes microseconds.

GPU thread only, except `snapshot` (one read of each counter).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models.cache import KVCache

from mlxd.engine.cache import kv_layout, pinned, ssd_tier
from mlxd.engine.cache.kv_layout import (
    SLACK_SHARE,
    Staged,
    after,
    cache_nbytes,
    compact,
    host_tensors,
    is_trimmable,
    slack,
    stage,
    tensors_of,
    view,
)
from mlxd.engine.cache.ssd_tier import DiskEntry, SsdTier, WriteJob, Writer, is_prefix
from mlxd.protocol.stats import CacheHits, PromptCacheStats, RamTierStats

log = logging.getLogger("mlxd.engine")
# On the GPU thread, at most this many bytes of checkpoint copies read a turn (None: all): on
# CUDA a read is a copy over PCIe that holds the thread (about 4 ms for 64 MB on an H100), and
# so much hides behind the step in flight. Blocks (kv_layout.BLOCK_BYTES) are read whole.
READ_A_TURN: int | None = 64 * 1024 * 1024 if kv_layout.GROUP else None
Tokens = list[int] | np.ndarray  # a prompt, or its key (gpu/media.cache_key: images and adapters by digest)


@dataclass(slots=True, eq=False)
class Entry:
    tokens: np.ndarray  # int64: the tokens the KV covers
    kv: list[Any]
    nbytes: int
    name: str  # its file name on SSD
    used: int  # the cache's clock at its last use
    on_ssd: bool = False
    writing: bool = False  # a write is queued or running
    unwritable: bool = False  # the SSD format cannot hold this cache kind
    write_failed: bool = False  # its last write failed (disk full?): write-behind leaves it, a drain retries
    trimmable: bool = True  # serves a prefix of itself (fixed when stored)
    base: tuple[str, int] | None = None  # a delta checkpoint's base and start: `kv` holds only what follows
    links: int = 0  # a delta checkpoint's: the deltas between it and the whole file its chain starts at, itself included
    staged: Staged | None = None  # a checkpoint's copy, queued on the GPU; `kv` is then empty (kv_layout.py)
    read: list[memoryview] = field(default_factory=list)  # its blocks read to the host so far (READ_A_TURN)


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What writing the RAM entries to SSD did (a drain, a stop)."""

    entries: int = 0
    bytes: int = 0
    ms: float = 0.0
    complete: bool = True  # False: not all written within the timeout, or some failed
    errors: int = 0


@dataclass(slots=True)
class CacheStats:
    ram_hits: int = 0
    ssd_hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    ram_evicted: int = 0
    evicted_unwritten: int = 0  # evicted from RAM without reaching SSD (no tier, or its queue was full)
    checkpoints: int = 0  # running rows' KV handed to the writer (`checkpoint`)
    checkpoints_skipped: int = 0  # ... not: the writes queued held too much
    checkpoint_s: float = 0.0  # the GPU thread's time taking them (the copy and its evaluation)
    restored_early: int = 0  # SSD entries restored at start, before anyone asked (live_rows.py)


def entry_name(tokens: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(tokens.astype("<u4").tobytes()) + ".safetensors"


RECENT_CHECKPOINTS = 64  # checkpoints remembered by name: a row checkpointing the same tokens shares one
STAND_ON_LINKS = 16  # a first checkpoint stands on an entry of fewer deltas (gpu/checkpoints.py: CHAIN)

class PrefixCache:
    """The RAM tier (byte-capped LRU) over an optional SSD tier and its writer."""

    def __init__(
        self,
        cap_bytes: int,
        ssd: SsdTier | None = None,
        idle: threading.Event | None = None,
        make_cache: Callable[[], list[Any]] | None = None,
        weigh: Callable[[list[Any]], int] = cache_nbytes,
        prefill_cost: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.cap_bytes = cap_bytes
        self._weigh = weigh  # an entry's bytes as the cap counts them (a pipeline's rank: rank 0's)
        self._prefill_cost = prefill_cost  # seconds a prompt token, as measured (None: not yet)
        self.ssd = ssd
        self.stats = CacheStats()
        self._make = make_cache
        self._entries: dict[str, Entry] = {}
        self._clock = 0
        self._ram_bytes = 0
        self._writer = Writer(ssd, idle or threading.Event()) if ssd is not None else None
        # An engine group's ranks see only the SSD entries every rank holds (None: all of them),
        # in the order rank 0 allowed them; each rank's tier keeps them (group/ranks.py).
        self.only_disk: dict[str, None] | None = None
        self._copying: list[Entry] = []  # checkpoints whose copies are queued on the GPU (send_checkpoints)
        self._checkpointed: dict[str, Entry] = {}  # the last checkpoints taken, by name (oldest first)
        self.copier: pinned.Copier | None = None  # CUDA: checkpoints' copies to the host (gpu/checkpoints.py)

    # --- lookups -------------------------------------------------------------------------------

    def fetch(self, prompt: Tokens, min_share: float = 0.0) -> tuple[list[Any] | None, int]:
        """A cache holding the longest cached prefix of `prompt`, and its length; (None, 0) on a
        miss. At least one prompt token is left to run (its logits give the first new token).
        A prefix covering less than `min_share` of the prompt is not used."""
        best, best_n = self._best(prompt)
        if best is None or best_n <= 0 or best_n < min_share * len(prompt):
            self.stats.misses += 1
            return None, 0
        if isinstance(best, DiskEntry):
            entry = self._restore(best)
            if entry is None or (best_n < len(entry.tokens) and not entry.trimmable):
                self.stats.misses += 1
                return None, 0
            self.stats.ssd_hits += 1
        else:
            entry = best
            self.stats.ram_hits += 1
            if self.ssd is not None and entry.on_ssd:
                self.ssd.touch(entry.name)  # its file stays the recently used one too
        self._clock += 1
        entry.used = self._clock
        self.stats.tokens_reused += best_n
        return view(entry.kv, best_n), best_n

    def longest(self, prompt: Tokens) -> int:
        """How many of `prompt`'s tokens a fetch would serve now (RAM or SSD), counting nothing."""
        return self._best(prompt)[1]

    def disk_candidates(self, prompt: Tokens, most: int = 4) -> list[str]:
        """The SSD entries not yet allowed that would serve more of `prompt` than the cache now
        does, the longest first, `most` of them (an engine group's rank 0 asks the others which
        they hold: a rank whose last write was cut, by a crash mid-reply, say, still holds the
        generation checkpoint before it)."""
        _, now = self._best(prompt)
        if self.ssd is None or self.only_disk is None:
            return []
        query = np.asarray(prompt, dtype=np.int64)
        found: list[tuple[int, str]] = []
        for d in self.ssd.entries():
            if d.name in self._entries or d.name in self.only_disk:
                continue
            n = self._usable(d.tokens, query, len(prompt) - 1, d.trimmable)
            if n > now:
                found.append((n, d.name))
        found.sort(reverse=True)
        return [name for _, name in found[:most]]

    def holds(self, name: str) -> bool:
        """Whether the SSD tier holds `name` whole (its file written and indexed)."""
        return self.ssd is not None and name in self.ssd

    def allow(self, names: list[str], keep: int = 64) -> None:
        """Let lookups see these SSD entries (the `keep` last allowed), and keep them on SSD."""
        allowed = self.only_disk if self.only_disk is not None else {}
        for name in names:
            allowed.pop(name, None)
            allowed[name] = None
        while len(allowed) > keep:
            del allowed[next(iter(allowed))]
        self.only_disk = allowed
        if self.ssd is not None:
            self.ssd.pinned = frozenset(allowed)

    def _best(self, prompt: Tokens) -> tuple[Entry | DiskEntry | None, int]:
        """The entry, in RAM or on SSD, sharing the longest usable prefix with `prompt`, and its length."""
        query = np.asarray(prompt, dtype=np.int64)
        limit = len(prompt) - 1
        best: Entry | DiskEntry | None = None
        best_n = 0
        for e in self._entries.values():
            n = self._usable(e.tokens, query, limit, e.trimmable)
            if n > best_n:
                best, best_n = e, n
        if self.ssd is not None:
            in_ram = best_n
            for d in self.ssd.entries():
                if d.name in self._entries or (self.only_disk is not None and d.name not in self.only_disk):
                    continue
                n = self._usable(d.tokens, query, limit, d.trimmable)
                if n > best_n and self._pays(d, n - in_ram):
                    best, best_n = d, n
        return best, best_n

    def _pays(self, d: DiskEntry, gain: int) -> bool:
        """Whether restoring `d` (its file, and a delta's bases) costs less than prefilling
        the `gain` tokens it would save, at what restores and prefills have cost so far: a
        transcript on SSD restored whole to serve only the system prompt it shares is a loss
        where prefill is fast (a CUDA GPU). Not known yet: it pays. Not in an engine group (its
        ranks must agree on what a lookup uses)."""
        s = self.ssd.stats if self.ssd is not None else None
        per_token = self._prefill_cost()
        if s is None or per_token is None or s.restored_bytes <= 0 or self.only_disk is not None:
            return True
        size = self.ssd.chain_size(d) if self.ssd is not None else d.size
        return size * s.restore_s / s.restored_bytes < gain * per_token

    @staticmethod
    def _usable(tokens: np.ndarray, query: np.ndarray, limit: int, trimmable: bool) -> int:
        n = min(ssd_tier.common_prefix(tokens, query), limit)
        if n < len(tokens) and not trimmable:
            return 0  # a cache that cannot be cut serves only prompts that contain all of it
        return n

    def _restore(self, d: DiskEntry) -> Entry | None:
        assert self.ssd is not None
        kv = self.ssd.restore(d)
        if kv is None:
            return None
        offset = getattr(kv[0], "offset", None)
        if offset is not None and offset != len(d.tokens):
            log.warning("SSD prompt cache: %s holds %s tokens of KV, its header says %d; not used",
                        d.name, offset, len(d.tokens))
            self.ssd.remove_to_quarantine(d.name, "offset does not match its tokens")
            return None
        entry = Entry(d.tokens, kv, self._weigh(kv), d.name, self._clock, on_ssd=True, trimmable=d.trimmable)
        if entry.nbytes <= self.cap_bytes:  # one larger than RAM serves this request only
            self._put(entry)
        return entry

    def restore_early(self, d: DiskEntry, need: int) -> int:
        """Restore an SSD entry into RAM before it is asked for, if RAM has `need` bytes free
        for it: its bytes (0: not restored)."""
        if d.name in self._entries or self._ram_bytes + need > self.cap_bytes or (entry := self._restore(d)) is None:
            return 0
        self.stats.restored_early += 1
        return entry.nbytes

    # --- stores --------------------------------------------------------------------------------

    def store(self, kv: list[Any], tokens: Tokens) -> None:
        """Keep `kv`, which holds KV for a prefix of `tokens` (its offset says how much). The
        caller gives `kv` up. Entries that are prefixes of it (and can be cut) are dropped."""
        if self.cap_bytes <= 0 or not kv:
            return
        offset = getattr(kv[0], "offset", None)
        if not isinstance(offset, int) or offset <= 0 or offset > len(tokens):
            return
        covered = np.asarray(tokens[:offset], dtype=np.int64)
        name = entry_name(covered)
        self._clock += 1
        if (old := self._entries.get(name)) is not None:
            old.used = self._clock
            return
        kept = view(kv, offset) if is_trimmable(kv) else kv
        if slack(kv, offset) > SLACK_SHARE:
            compact(kept)  # a view would keep the lane's whole buffer alive, uncounted
        mx.async_eval([c.state for c in kept])  # and a batch row's copy frees the batch buffer (non-arrays ignored)
        entry = Entry(covered, kept, self._weigh(kept), name, self._clock, trimmable=is_trimmable(kept))
        if entry.nbytes > self.cap_bytes:  # too big for RAM: to SSD only, if the writer has room
            if not self._spill_evicted(entry):
                self.stats.evicted_unwritten += 1
            return
        if entry.trimmable:
            for other in [e for e in self._entries.values() if is_prefix(e.tokens, covered)]:
                self._drop(other)
        self._put(entry)

    def checkpoint(self, kv: list[Any], tokens: Tokens, base: Entry | None = None, cached: int = 0) -> Entry | None:
        """Write a copy of a running row's `kv` (a prefix of `tokens`, its offset says how much) to
        SSD now, busy or not, and not to RAM: a generation checkpoint (gpu/checkpoints.py). The
        row keeps `kv`. With `base` (the row's checkpoint before), only the KV after its tokens
        is written, in a delta file that names it. Without, where the row's first `cached` tokens
        came from the prompt cache and an entry on SSD holds them or most of them (`_stand_on`),
        the file is a delta on that entry: an agent's next turn writes its new tokens, not its
        whole history again. The file makes earlier ones that are prefixes of it redundant (the tier drops
        them, a delta's chain of bases aside). Its Entry (`on_ssd` once written), or None when
        not taken: no SSD tier, or the copies queued already hold half the RAM cap (they live
        until written)."""
        if self._writer is None or not kv:
            return None
        offset = getattr(kv[0], "offset", None)
        if not isinstance(offset, int) or offset <= 0 or offset > len(tokens):
            return None
        covered = np.asarray(tokens[:offset], dtype=np.int64)
        name = entry_name(covered)
        if (taken := self._checkpointed.get(name)) is not None and not taken.write_failed and not (
                taken.on_ssd and (self.ssd is None or name not in self.ssd)):
            return taken  # another row's, of the same tokens (a shared prompt), on its way or written
        if self.ssd is not None and (d := self.ssd.get(name)) is not None:
            return Entry(covered, [], 0, name, self._clock, on_ssd=True, base=(d.base, d.start) if d.base else None,
                         links=self.ssd.links(d))
        start = len(base.tokens) if base is not None else 0
        if base is None and 0 < cached < offset and (stand := self._stand_on(covered, cached)) is not None:
            base, start = stand
        delta = base is not None and 0 < start < offset and all(type(c) is KVCache for c in kv)
        kept = after(kv, start, offset) if delta else view(kv, offset)
        nbytes = self._weigh(kept)
        if self._writer.pending_bytes + sum(e.nbytes for e in self._copying) + nbytes > self.cap_bytes // 2:
            self.stats.checkpoints_skipped += 1
            return None
        started = time.perf_counter()
        # its own buffers (the row goes on writing into its cache), as the file has them, queued
        # behind the step under way; on CUDA copied on to page-locked memory by the GPU if it can
        staged = pinned.queue(stage(kept), self.copier)
        entry = Entry(covered, [], nbytes, name, self._clock, trimmable=is_trimmable(kept),
                      base=(base.name, start) if delta and base is not None else None, staged=staged,
                      links=base.links + 1 if delta and base is not None else 0)
        self._copying.append(entry)
        self._checkpointed[name] = entry
        while len(self._checkpointed) > RECENT_CHECKPOINTS:
            del self._checkpointed[next(iter(self._checkpointed))]
        self.stats.checkpoint_s += time.perf_counter() - started
        self.stats.checkpoints += 1
        return entry

    def _stand_on(self, tokens: np.ndarray, n: int) -> tuple[Entry, int] | None:
        """An entry on SSD, or on its way there, to stand a row's first checkpoint on, and where
        the checkpoint's delta starts: the row's first `n` tokens came from the prompt cache, so
        an entry holding a prefix of them serves as a base (a checkpoint of the reply before, say,
        whose RAM entry served), or one holding all of them and at most twice that, cut at `n`
        (a restore reads its whole file). The one serving most, then the shortest, then the one
        of the shortest chain; at least half of `n`."""
        if self.ssd is None or n <= 0:
            return None
        found: list[tuple[int, int, Entry | DiskEntry]] = []
        seen: set[str] = set()
        for e in [*self._checkpointed.values(), *self._entries.values()]:
            if e.name not in seen and (e.on_ssd or e.writing) and not (e.write_failed or e.unwritable):
                seen.add(e.name)
                d = self.ssd.get(e.name) if e.on_ssd else None
                if not e.on_ssd or d is not None:
                    found.append((len(e.tokens), self.ssd.links(d) if d is not None else e.links, e))
        found += [(len(d.tokens), self.ssd.links(d), d) for d in self.ssd.entries() if d.name not in seen]
        fits = [(min(length, n), length, links, e) for length, links, e in found
                if n // 2 <= min(length, n) and length <= 2 * n and links < STAND_ON_LINKS and e.trimmable
                and np.array_equal(e.tokens[:min(length, n)], tokens[:min(length, n)])]
        if not fits:
            return None
        start, _, links, best = min(fits, key=lambda f: (-f[0], f[1], f[2]))
        if isinstance(best, Entry):
            return best, start
        return Entry(best.tokens, [], 0, best.name, self._clock, on_ssd=True, links=links,
                     base=(best.base, best.start) if best.base else None), start

    def send_checkpoints(self, everything: bool = False) -> None:
        """Hand the writer the checkpoints taken before now: their copies, queued then, are made by
        the time a later step's tokens were read (the GPU runs its queue in order), so taking their
        host buffers waits for nothing. The lanes call it each step, the idle loop and a drain too
        (`everything`: the drain's, READ_A_TURN or not)."""
        copied, self._copying = self._copying, []
        started = time.perf_counter()
        budget = READ_A_TURN if not everything else None
        for n, entry in enumerate(copied):
            if budget is not None and entry.staged is not None and entry.staged.host is None:  # read over turns
                blocks = entry.staged.blocks
                while len(entry.read) < len(blocks) and budget > 0:
                    budget -= blocks[len(entry.read)].nbytes
                    entry.read.append(memoryview(blocks[len(entry.read)]).cast("B"))  # type: ignore[arg-type]
                if len(entry.read) < len(blocks):
                    self._copying = copied[n:]  # the rest: next turn
                    break
            self._spill(entry, urgent=True)
        self.stats.checkpoint_s += time.perf_counter() - started

    def _put(self, entry: Entry) -> None:
        self._entries[entry.name] = entry
        self._ram_bytes += entry.nbytes
        while self._ram_bytes > self.cap_bytes and len(self._entries) > 1:
            victim = min((e for e in self._entries.values() if e is not entry), key=lambda e: e.used)
            self.stats.ram_evicted += 1
            if not victim.on_ssd and not victim.writing and not self._spill_evicted(victim):
                self.stats.evicted_unwritten += 1
            self._drop(victim)

    def _spill_evicted(self, entry: Entry) -> bool:
        """Write an entry leaving RAM now, busy or not, unless the writes already queued hold
        half the cap (their arrays live until written): False then, and it is dropped."""
        if self._writer is None or entry.unwritable or self._writer.pending_bytes > self.cap_bytes // 2:
            return False
        self._spill(entry, urgent=True)
        return True

    def _drop(self, entry: Entry) -> None:
        if self._entries.pop(entry.name, None) is not None:
            self._ram_bytes -= entry.nbytes

    # --- the SSD tier --------------------------------------------------------------------------

    def write_behind(self) -> str:
        """While the GPU loop is idle: hand the writer the newest RAM entry not yet on SSD, one
        at a time. `queued`; `busy` (the writer has one: ask again soon); `none` (nothing to write)."""
        if self._writer is None:
            return "none"
        self.send_checkpoints(everything=True)
        todo = [e for e in self._entries.values() if not (e.on_ssd or e.writing or e.unwritable or e.write_failed)]
        if not todo:
            return "none"
        if self._writer.pending:
            return "busy"
        self._spill(max(todo, key=lambda e: e.used), urgent=False)
        return "queued"

    def flush(self, timeout_s: float) -> FlushReport:
        """Write every RAM entry not yet on SSD, now, and wait for it (a drain)."""
        if self._writer is None:
            return FlushReport()
        assert self.ssd is not None
        started = time.perf_counter()
        before = self.ssd.stats.written_bytes, self.ssd.stats.writes, self.ssd.stats.write_errors
        self.send_checkpoints(everything=True)
        for e in [e for e in self._entries.values() if not (e.on_ssd or e.writing or e.unwritable)]:
            self._spill(e, urgent=True)
        finished = self._writer.flush(timeout_s)
        errors = self.ssd.stats.write_errors - before[2]
        return FlushReport(
            self.ssd.stats.writes - before[1], self.ssd.stats.written_bytes - before[0],
            round((time.perf_counter() - started) * 1000, 3), finished and not errors, errors,
        )

    def _spill(self, entry: Entry, urgent: bool) -> None:
        if self._writer is None or entry.unwritable:
            return
        host = entry.staged.host if entry.staged is not None else None  # pinned.py: the writer waits
        try:
            if entry.staged is not None:  # a checkpoint's copy, made by now: its bytes, queuing nothing
                (meta, tensors, owner), entry.staged = host_tensors(entry.staged, entry.read or None), None
                entry.read = []
            else:
                compact(entry.kv)  # the entry keeps the copy it writes: no second one in memory
                meta, tensors, owner = tensors_of(entry.kv)
        except Exception as exc:  # a cache kind the format cannot hold: it stays in RAM only
            log.warning("SSD prompt cache: cannot write this cache (%s)", exc)
            entry.unwritable = True
            return
        entry.writing = True

        def done(ok: bool) -> None:  # the writer thread; a bool store each (on_ssd first: no double spill)
            entry.on_ssd = ok
            entry.write_failed = not ok
            entry.writing = False

        self._writer.submit(WriteJob(entry.name, entry.tokens, meta, tensors, urgent, owner, done, entry.nbytes,
                                     entry.trimmable, entry.base, None if host is None else lambda: pinned.wait(host),
                                     None if host is None else lambda: pinned.release(host)))

    @property
    def writes_pending(self) -> int:
        """Writes handed to the writer and not done, and checkpoints not yet handed to it."""
        return (self._writer.pending if self._writer is not None else 0) + len(self._copying)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.stop()

    # --- visibility ----------------------------------------------------------------------------

    def snapshot(self) -> PromptCacheStats:
        """For /admin/stats (the loop thread: each value is one read)."""
        s = self.stats
        return PromptCacheStats(
            RamTierStats(len(self._entries), self._ram_bytes, self.cap_bytes),
            self.ssd.snapshot() if self.ssd is not None else None,
            CacheHits(s.ram_hits, s.ssd_hits), s.misses, s.tokens_reused, s.ram_evicted, s.evicted_unwritten,
            self.writes_pending, s.checkpoints, s.checkpoints_skipped, round(s.checkpoint_s * 1000, 3),
            s.restored_early,
        )

