"""An engine group's two sides: rank 0's Leader, which sends each turn's inputs, and the other
ranks' follow loop, which replays them (wire.py says what a turn carries; docs/distributed.md).

A job's ticket in a group is a GroupTicket: its cancel flag is read once a turn, on rank 0, and
that reading goes to every rank with the turn, so all drop the job at the same step. What is
rank 0's alone (HTTP, templates, replies, the SSD tier) never reaches a follower; a grammar goes
as its text, which each rank compiles. What would make ranks differ and is not carried yet
(images, adapters, drafts from a model, the width probe) is refused or off; n-gram drafting
decisions, which follow rank 0's clock, go to the others as rank 0 makes them (Decide).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
from mlx.utils import tree_flatten

from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu.gateway import Flush
from mlxd.engine.gpu.job import Job, PrefillGroup
from mlxd.engine.gpu.options import GatewayOptions
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.group.pipeline import pipeline
from mlxd.engine.group.wire import (
    HANDSHAKE_FRAME,
    Beat,
    Decide,
    Held,
    Hello,
    Knock,
    Link,
    Proof,
    Query,
    Ready,
    Turn,
    Vouch,
    WireJob,
    encode,
    follower_proof,
    leader_proof,
    link_seal,
    tcp_address,
)
from mlxd.engine.models.loaded_model import ModelLoadError
from mlxd.engine.spec import agreement
from mlxd.protocol.events import Event
from mlxd.protocol.rank_agent import keep_alive, nonce

log = logging.getLogger("mlxd.engine")
JOIN_TIMEOUT_S = 300.0  # followers load the model too: as long as a load may take
HEARTBEAT_S = 10.0  # a follower not heard from this long ends the group (engine flag --group-heartbeat)
READY_S = 10.0  # over TCP, a peer that has not said Ready in this long is dropped
READY_FRAME = 64 * 1024  # ... as is one whose Ready is larger
TURN_TIMEOUT_S = 120.0  # a turn not finished by every rank this long ends it (--group-turn-timeout)


class GroupLost(RuntimeError):
    """A rank of the group went away: the group cannot go on (the engine ends)."""


class GroupTicket:
    """A job's ticket as the GPU thread of a group's rank sees it: events go to the caller's
    ticket (rank 0) or nowhere (a follower); `is_cancelled` is the turn's latched reading."""

    __slots__ = ("id", "inner", "latched")

    def __init__(self, inner: Any, job_id: int) -> None:
        self.inner = inner
        self.id = job_id
        self.latched = False

    @property
    def is_cancelled(self) -> bool:
        return self.latched

    def emit(self, event: Event) -> None:
        if self.inner is not None:
            self.inner.emit(event)


def splitter(group: Any, mode: str) -> Callable[[Any, dict[str, Any]], None]:
    """How to split a lazily loaded model over `group` before its weights are read, as mlx-lm's
    models do (tensor: `shard`; pipeline: `pipeline.py`), so that each rank reads only its part;
    a model that cannot be split so is a load error that says why."""
    def split(model: Any, config: dict[str, Any]) -> None:
        size = group.size()
        if mode == "pipeline":
            pipeline(model, group)
            return
        if not hasattr(model, "shard"):
            raise ModelLoadError(f"{config.get('model_type')} models cannot be split tensor-parallel by mlx-lm")
        heads = config.get("num_attention_heads", 0)
        kv_heads = config.get("num_key_value_heads", heads)
        if heads % size or kv_heads % size:
            raise ModelLoadError(f"the model's {heads} attention heads ({kv_heads} for keys and values) do not split "
                                 f"over {size} ranks")
        model.shard(group)

    return split


def kept_line(rank: int, model: Any) -> str:
    """What a rank holds once split, and the most it held while reading (about its part, not
    the whole model: the split came before the read)."""
    return (f"rank {rank} keeps {kept_bytes(model) / 1e6:.2f} MB of the model's weights "
            f"(at most {mx.get_peak_memory() / 1e6:.2f} MB while reading them)")


def kept_bytes(model: Any) -> int:
    arrays: list[Any] = [a for _, a in tree_flatten(model.parameters())]  # type: ignore[str-unpack]
    return sum(int(a.nbytes) for a in arrays)


class Leader:
    """Rank 0: the control socket the followers connect to, and what it sends them."""

    def __init__(self, control: str, size: int, heartbeat_s: float = HEARTBEAT_S,
                 turn_timeout_s: float = TURN_TIMEOUT_S) -> None:
        self._size = size
        self._heartbeat_s = heartbeat_s  # a follower silent this long is stopped or gone
        self._turn_timeout_s = turn_timeout_s  # a turn some rank has not finished after this long: hung
        self._token = os.environ.get("MLXD_GROUP_TOKEN", "")  # over TCP, a follower must prove it holds it
        self._path: Path | None = None
        if (address := tcp_address(control)) is not None:
            if not self._token:
                raise ModelLoadError("an engine group over TCP needs its token ($MLXD_GROUP_TOKEN, which mlxd sets)")
            self._listener = socket.create_server(address, backlog=size)
        else:
            self._path = Path(control)
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
            self._listener.bind(control)
            os.chmod(control, 0o600)
            self._listener.listen(size)
        self._peers: list[Link] = []
        self._ranks: dict[Link, int] = {}
        self._answers: dict[Link, queue.SimpleQueue[Held]] = {}  # their Held, from the watch thread
        self._query = 0
        self._cache: PrefixCache | None = None
        self._sent: deque[tuple[int, float]] = deque()  # GPU thread appends, watch thread pops: turns not
        self._turns = 0  # known finished everywhere, with when they were sent
        self._lost: str | None = None  # why the group cannot go on (the watch thread saw it)
        self._next_id = 0  # loop thread: jobs adopted
        self._next_group = 0  # GPU thread: n > 1 requests sent
        self._open: dict[int, Sequence] = {}  # GPU thread: the jobs the followers hold
        self._group_ids: dict[int, tuple[PrefillGroup, int]] = {}
        self._closing = False
        self.on_lost: Callable[[], None] = lambda: None  # any thread: a follower went away (the engine ends)

    def adopt(self, job: Job) -> None:
        """Loop thread, as the job is submitted: its ticket becomes the group's."""
        self._next_id += 1
        job.ticket = GroupTicket(job.ticket, self._next_id)  # type: ignore[assignment]

    def join(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """GPU thread, after loading: wait for every follower's Ready (a load error names its rank)."""
        deadline = time.monotonic() + timeout_s
        while len(self._peers) < self._size - 1:
            self._listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                peer, _ = self._listener.accept()
            except TimeoutError:
                raise ModelLoadError(f"{self._size - 1 - len(self._peers)} of the group's ranks did not join in "
                                     f"{timeout_s:.0f} s") from None
            if self._path is None:  # TCP: anyone may connect; a rank proves it holds the token
                joined = self._ready_over_tcp(peer)
                if joined is None:
                    continue
                link, ready = joined
            else:
                link = Link(peer)
                peer.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    ready = link.recv(Ready)
                except (EOFError, OSError) as exc:
                    raise ModelLoadError(f"a rank of the group left before it loaded the model: {exc}") from exc
            if ready.error is not None:
                raise ModelLoadError(f"rank {ready.rank} could not load the model: {ready.error}")
            peer.settimeout(None)
            self._peers.append(link)
            self._ranks[link] = ready.rank
            self._answers[link] = queue.SimpleQueue()
        self._listener.close()
        if self._path is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()
        threading.Thread(target=self._watch, name="mlxd-group-watch", daemon=True).start()

    def _ready_over_tcp(self, peer: socket.socket) -> tuple[Link, Ready] | None:
        """A TCP peer's sealed link and Ready once each side proved it holds the group's token
        (wire.py), else None: it is dropped (a port scan, a stale rank of an earlier start,
        someone without the token)."""
        peer.settimeout(READY_S)
        deadline = time.monotonic() + READY_S  # the whole handshake: a trickling stranger cannot hold the join
        plain = Link(peer)
        try:
            keep_alive(peer)  # a rank whose host vanished goes quiet: its heartbeat says so
            knock = plain.recv(Knock, HANDSHAKE_FRAME, deadline)
            ours = nonce()
            plain.send(Vouch(leader_proof(self._token, knock.nonce, ours), ours))
            proof = plain.recv(Proof, HANDSHAKE_FRAME, deadline)
            if hmac.compare_digest(proof.mac, follower_proof(self._token, knock.nonce, ours, knock.rank)):
                link = Link(peer, link_seal(self._token, knock.nonce, ours, leader=True))
                ready = link.recv(Ready, READY_FRAME, deadline)
                if ready.rank == knock.rank:
                    return link, ready
            why = "without the group's token"
        except (EOFError, OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            why = f"that did not finish its handshake ({exc or type(exc).__name__})"
        log.warning("engine group: dropped a connection %s", why)
        peer.close()
        return None

    def hello(self, options: GatewayOptions, kv_layers: int, cache: PrefixCache | None = None) -> None:
        """GPU thread, once sized: every rank seeds its sampler alike and serves with these options
        (`kv_layers`: how many layers' KV rank 0's prompt cache holds an entry of). `cache`: rank
        0's prompt cache, whose SSD entries each turn allows only once every rank holds them."""
        seed = int.from_bytes(os.urandom(8), "little")
        mx.random.seed(seed)
        self._cache = cache
        if cache is not None:
            cache.allow([])
        self._send(Hello(seed, replace(options, probe_dir=None, ssd_root=None), kv_layers))  # its dirs are its own
        agreement.lead(self.decide)

    def decide(self, value: Any) -> None:
        """GPU thread, during a turn: a drafting decision, which the others take as theirs."""
        self._send(Decide(value))

    def turn(self, received: list[Any], stopping: bool) -> None:
        """GPU thread, before a turn: send what it starts from."""
        jobs, new = [], []
        flush = None
        for seq in received:
            if isinstance(seq, Sequence):
                jobs.append(self._wire(seq))
                new.append(seq)
                self._open[seq.job.ticket.id] = seq  # type: ignore[attr-defined]
            elif isinstance(seq, Flush):  # a drain's or a stop's: every rank writes its part to SSD
                flush = seq.timeout_s
        disk = self._held_everywhere(new)
        cancelled = []
        for job_id, seq in list(self._open.items()):
            ticket = seq.job.ticket
            if seq.is_finished:
                del self._open[job_id]
            elif not ticket.latched and ticket.inner.is_cancelled:  # type: ignore[attr-defined]
                ticket.latched = True  # type: ignore[attr-defined]
                cancelled.append(job_id)
        if self._group_ids:  # n > 1 requests still running keep their ids
            live = {id(s.job.group) for s in self._open.values() if s.job.group is not None}
            self._group_ids = {k: v for k, v in self._group_ids.items() if k in live}
        self._send(Turn(jobs, cancelled, stopping, disk=disk, flush=flush))
        if disk and self._cache is not None:
            self._cache.allow(disk)
        self._turns += 1
        self._sent.append((self._turns, time.monotonic()))

    def _held_everywhere(self, new: list[Sequence]) -> list[str]:
        """The SSD entries that would serve more of the new jobs' prompts than the cache now does,
        kept only if every rank holds its part of them whole (a rank that does not would
        prefill what the others reuse)."""
        cache = self._cache
        if cache is None or cache.ssd is None or not new:
            return []
        wanted: list[str] = []
        for seq in new:
            wanted += [name for name in cache.disk_candidates(seq.job.prompt) if name not in wanted]
        if not wanted:
            return []
        cache.ssd.pinned = cache.ssd.pinned | set(wanted)  # the writer must not evict them meanwhile
        wanted = [name for name in wanted if cache.holds(name)]
        if not wanted or not self._peers:
            return wanted
        self._query += 1
        self._send(Query(self._query, wanted))
        held = set(wanted)
        for peer in self._peers:
            deadline = time.monotonic() + self._turn_timeout_s
            while True:
                try:
                    answer = self._answers[peer].get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    return []  # the watch thread ends the group if that rank is hung
                if answer.id == self._query:
                    held &= set(answer.names)
                    break
        return [name for name in wanted if name in held]

    def _watch(self) -> None:
        """Read the followers' beats; end the group when one goes away (its socket's EOF), falls
        silent past the heartbeat (stopped, its host gone), or leaves a turn unfinished past the
        turn timeout (a rank hung on its GPU: the others then wait for it in a collective)."""
        peers = list(self._peers)
        if not peers:  # a group of one
            return
        heard = dict.fromkeys(peers, time.monotonic())
        done = dict.fromkeys(peers, 0)
        selector = selectors.DefaultSelector()  # not select(): a descriptor past 1023 would raise
        try:
            for peer in peers:
                selector.register(peer, selectors.EVENT_READ)
        except (OSError, ValueError) as exc:  # closed as soon as joined: we are ending
            return None if self._closing else self._end(f"cannot watch the ranks: {exc}")
        while not self._closing:
            try:
                readable = [key.fileobj for key, _ in selector.select(0.25)]
            except (OSError, ValueError) as exc:  # closed under us as we end; else we are blind: end
                return None if self._closing else self._end(f"cannot watch the ranks: {exc}")
            now = time.monotonic()
            for peer in readable:  # type: ignore[assignment]
                try:
                    message = peer.recv(Beat | Held)
                except (EOFError, OSError, msgspec.DecodeError):
                    return self._end(f"rank {self._ranks[peer]} went away")
                if isinstance(message, Held):
                    self._answers[peer].put(message)
                else:
                    done[peer] = message.turns
                heard[peer] = now
            quiet = min(peers, key=heard.__getitem__)
            if now - heard[quiet] > self._heartbeat_s:
                return self._end(f"rank {self._ranks[quiet]} sent no heartbeat for {self._heartbeat_s:g} s "
                                 "(stopped, or its machine is gone)")
            slowest = min(peers, key=done.__getitem__)
            while self._sent and self._sent[0][0] <= done[slowest]:
                self._sent.popleft()
            if self._sent and now - self._sent[0][1] > self._turn_timeout_s:
                return self._end(f"rank {self._ranks[slowest]} has not finished a turn in {self._turn_timeout_s:g} s "
                                 "(a rank is hung)")

    def _end(self, why: str) -> None:
        if not self._closing:
            self._lost = why
            log.error("engine group: %s; the group ends", why)
            self.on_lost()

    def close(self) -> None:
        """GPU thread, as it ends: the followers end too."""
        self._closing = True
        with contextlib.suppress(OSError, GroupLost):
            self._send(Turn([], [], True, stop=True))
        for peer in self._peers:
            peer.close()
        self._peers = []

    def _wire(self, seq: Sequence) -> WireJob:
        job = seq.job
        group = None
        if job.group is not None:
            if id(job.group) not in self._group_ids:
                self._next_group += 1
                self._group_ids[id(job.group)] = (job.group, self._next_group)
            gid = self._group_ids[id(job.group)][1]
            group = (gid, job.group.size, job.group.target)
        return WireJob(job.ticket.id, job.prompt, job.max_tokens, job.sampling, job.stops,  # type: ignore[attr-defined]
                       job.logprobs, group, job.priority, job.continues_text, job.resumed, job.grammar_text,
                       job.speculate)

    def _send(self, message: Any) -> None:
        if self._lost is not None:
            raise GroupLost(self._lost)
        data = encode(message)  # once, however many ranks
        for peer in self._peers:
            try:
                peer.send_encoded(data)
            except OSError as exc:
                raise GroupLost(f"a rank of the group went away: {exc}") from exc
