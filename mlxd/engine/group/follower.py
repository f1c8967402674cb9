"""The other ranks of an engine group: each loads its part, reports to rank 0, then replays
rank 0's turns (wire.py) until rank 0 stops or goes, beating all along (docs/distributed.md)."""

from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec

from mlxd.engine.cache.kv_layout import cache_nbytes
from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.gpu.job import Job, PrefillGroup
from mlxd.engine.gpu.sequence import Sequence
from mlxd.engine.gpu.stats import Stats
from mlxd.engine.group.ranks import HEARTBEAT_S, JOIN_TIMEOUT_S, GroupTicket
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
    follower_proof,
    leader_proof,
    link_seal,
    tcp_address,
)
from mlxd.engine.models.loaded_model import LoadedModel
from mlxd.engine.spec import agreement
from mlxd.protocol.exit_codes import ExitCode
from mlxd.protocol.rank_agent import keep_alive, nonce

log = logging.getLogger("mlxd.engine")
WRITER_POLL_S = 0.05  # idle with the SSD writer at an entry: look at the socket this often


def follow(loaded_or_error: LoadedModel | str, rank: int, control: str, connect_s: float = JOIN_TIMEOUT_S,
           heartbeat_s: float = HEARTBEAT_S, ssd: tuple[Path | None, int | None] = (None, None)) -> int:
    """A follower's life: report its load to rank 0, then replay rank 0's turns until it stops
    (0) or goes away (1), beating all along. `loaded_or_error`: its shard, or why it could not
    load it."""
    try:
        sock = _link(_connect(control, connect_s), rank, tcp_address(control) is not None)
    except (EOFError, OSError, msgspec.MsgspecError) as exc:
        log.error("rank %d: rank 0's control socket: %s", rank, exc)
        return 1
    if isinstance(loaded_or_error, str):
        sock.send(Ready(rank, loaded_or_error))
        return 1
    loaded = loaded_or_error
    sock.send(Ready(rank))
    finished = [0]  # turns replayed, as the beats report it
    beating, sending = threading.Event(), threading.Lock()
    threading.Thread(target=_beat, args=(sock, sending, min(1.0, heartbeat_s / 4), finished, beating),
                     name="mlxd-group-beat", daemon=True).start()
    try:
        return _replay(sock, sending, loaded, rank, finished, ssd)
    finally:
        beating.set()


def _beat(sock: Link, sending: threading.Lock, every_s: float, finished: list[int],
          stop: threading.Event) -> None:
    """A follower's heartbeat (its own thread: a long turn does not silence it; a stopped or
    vanished process does)."""
    while not stop.wait(every_s):
        try:
            with sending:
                sock.send(Beat(finished[0]))
        except OSError:
            return


def _replay(sock: Link, sending: threading.Lock, loaded: LoadedModel, rank: int, finished: list[int],
            ssd: tuple[Path | None, int | None]) -> int:
    from mlxd.engine.gpu.loader import patch_model, ssd_tier
    from mlxd.engine.gpu.runner import Runner

    try:
        hello = sock.recv(Hello | Turn)
    except EOFError:
        return 1
    if not isinstance(hello, Hello):  # rank 0 failed before it served: its closing Turn
        return 1
    mx.random.seed(hello.seed)
    agreement.follow(lambda: _decision(sock, rank))  # drafting decisions: rank 0's, in its order
    opts = hello.options
    patch_model(loaded, opts)
    assert opts.kv_budget_tokens is not None
    idle = threading.Event()
    tier = ssd_tier(loaded, replace(opts, ssd_root=ssd[0], ssd_cache_bytes=ssd[1])) if ssd[0] is not None else None
    cache = PrefixCache(opts.prompt_cache_bytes, tier, idle, weigh=weighed_as(hello.kv_layers))
    cache.allow([])  # SSD entries only as rank 0 allows them
    runner = Runner(loaded, Stats(), opts, opts.kv_budget_tokens, cache)
    open_jobs: dict[int, Sequence] = {}
    groups: dict[int, PrefillGroup] = {}
    log.info("rank %d follows rank 0's turns", rank)
    while True:
        if not runner.has_work:  # idle: hand the SSD writer what rank 0's would get now
            idle.set()
            if cache.write_behind() != "none" and not select.select([sock], [], [], WRITER_POLL_S)[0]:
                continue
        try:
            turn = sock.recv(Turn | Query)
        except (EOFError, OSError):
            log.error("rank %d: rank 0 went away", rank)
            return 1
        except msgspec.ValidationError as exc:  # a decision rank 0 made that this rank did not ask for: apart
            log.error("rank %d is out of step with rank 0 (%s): it ends, and the group with it", rank, exc)
            return 1
        if isinstance(turn, Query):
            held = [name for name in turn.names if cache.holds(name)]
            if tier is not None:
                tier.pinned = tier.pinned | set(held)  # kept until rank 0 says which all ranks hold
            with sending:
                sock.send(Held(turn.id, held))
            continue
        idle.clear()
        if turn.flush is not None:
            cache.flush(turn.flush)
        if turn.stop:
            cache.close()
            return 0
        if turn.disk:
            cache.allow(turn.disk)
        for w in turn.jobs:
            group = None
            if w.group is not None:
                group = groups.setdefault(w.group[0], PrefillGroup(size=w.group[1], target=w.group[2]))
            job = Job(w.prompt, w.max_tokens, w.sampling, w.stops, GroupTicket(None, w.id),  # type: ignore[arg-type]
                      grammar=held_by(loaded, w), logprobs=w.logprobs, group=group, priority=w.priority,
                      continues_text=w.continues_text, resumed=w.resumed, speculate=w.speculate)
            open_jobs[w.id] = seq = Sequence(job, loaded.tokenizer, loaded.eos_token_ids)
            runner.enqueue(seq)
        for job_id in turn.cancelled:
            if (gone := open_jobs.get(job_id)) is not None:
                gone.job.ticket.latched = True  # type: ignore[attr-defined]
        try:
            runner.turn(turn.stopping)
        except (EOFError, OSError) as exc:  # waiting for rank 0's decision, it went
            log.error("rank %d: rank 0 went away: %s", rank, exc)
            return 1
        finished[0] += 1
        open_jobs = {k: s for k, s in open_jobs.items() if not s.is_finished}
        live = {id(s.job.group) for s in open_jobs.values() if s.job.group is not None}
        groups = {k: g for k, g in groups.items() if id(g) in live}


def _decision(sock: Link, rank: int) -> Any:
    """Rank 0's next drafting decision. Anything else (rank 0 gone, or a frame this rank did not
    expect: the two are out of step) ends this rank at once: the lanes would take the error for
    one request's and go on apart from rank 0. Its end ends the group, which starts again."""
    try:
        return sock.recv(Decide).value
    except (EOFError, OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        log.error("rank %d: no decision from rank 0 where one was due (%s): this rank ends", rank, exc)
        logging.shutdown()
        os._exit(ExitCode.GPU_THREAD_DIED)


def weighed_as(kv_layers: int) -> Callable[[list[Any]], int]:
    """A prompt-cache entry's bytes as rank 0 counts them: every rank must evict the same entries
    at the same turn, or one would reuse a prefix another prefills. A pipeline's ranks hold
    different numbers of layers (3 over 2: 2 on rank 0, 1 on rank 1); their layers are alike, so
    an entry's bytes scale exactly with the count."""
    if not kv_layers:
        return cache_nbytes
    return lambda kv: cache_nbytes(kv) * kv_layers // len(kv) if kv else 0


def held_by(loaded: LoadedModel, w: WireJob) -> Any:
    """The job's grammar matcher, compiled here as rank 0 compiled its own, standing where rank
    0's stood: past a continued reply's delivered tokens (the prompt's last `resumed`)."""
    if w.grammar is None:
        return None
    matcher = loaded.grammars.matcher(w.grammar, "response_format")
    if w.resumed:
        matcher.consume_tokens(w.prompt[-w.resumed:])
    return matcher


def _link(sock: socket.socket, rank: int, tcp: bool) -> Link:
    """The control connection: over TCP, after each side proved it holds the group's token
    (wire.py), sealed; EOFError if rank 0 does not prove it."""
    if not tcp:
        return Link(sock)
    token = os.environ.get("MLXD_GROUP_TOKEN", "")
    knock = nonce()
    plain = Link(sock)
    try:
        plain.send(Knock(rank, knock))
        vouch = plain.recv(Vouch, HANDSHAKE_FRAME)  # rank 0 answers once it has loaded its own part
        if not hmac.compare_digest(vouch.mac, leader_proof(token, knock, vouch.nonce)):
            raise EOFError("it does not hold the group's token")
        plain.send(Proof(follower_proof(token, knock, vouch.nonce, rank)))
    except BaseException:
        sock.close()
        raise
    return Link(sock, link_seal(token, knock, vouch.nonce, leader=False))


def _connect(control: str, timeout_s: float) -> socket.socket:
    """Rank 0's control socket (a path, or tcp://IP:PORT), as soon as it listens."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (address := tcp_address(control)) is not None:
                sock = socket.create_connection(address, timeout=5)
                sock.settimeout(None)
                keep_alive(sock)  # rank 0's host vanished: the connection ends, and so does this rank
                return sock
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(control)
            except OSError:
                sock.close()
                raise
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
