"""Chaos as a repeatable check: engine SIGKILLs under concurrent streams (issue 9).

Starts a real supervisor with the tiny random model, keeps `--streams` streaming clients busy in
a loop, and SIGKILLs the model's engine `--kills` times, each `--dwell` seconds after it became
ready again; every `--spare-every`-th kill targets the spare engine process instead (the clients
pause so the pool is quiet and makes one, and the check is that it is reaped and replaced).
Every request's outcome is recorded, and when it ended relative to the kills. The report:

  * every request in flight at an engine kill ended within 5 s of it, as a 200 that completed,
    a 503 with Retry-After, an SSE error event, or a 502 engine_crashed with Retry-After (an
    engine that died before the answer began): nothing else;
  * hangs: requests that had not ended after `--hang-s` (0 expected);
  * the supervisor's RSS and open files before vs after the storm (each measured with the
    engine ready, the spare warm and no client connected): within 5%;
  * the model serves again after the storm without any admin action.

Crash-loop settings: 100 kills would keep mlxd's defaults (5 crashes in 60 s: failed for 15 s,
doubling to 5 minutes) cooling down for most of an hour. By default the storm runs with
crash_limit 5 in a 30 s window and cool-downs of 2 s doubling to 8 s, with a 0.25 s restart
back-off base: kills come every few seconds, so the limit trips every few kills and the
storm measures both sides (crash -> clean errors -> restart, and crash loop -> 503 with
Retry-After -> healing by itself) in minutes. `--mlxd-defaults` runs mlxd's own settings
instead (use fewer kills: every cool-down is waited out).

  python benchmarks/chaos.py                       # 100 kills, 8 streams
  python benchmarks/chaos.py --kills 12 --mlxd-defaults --json /tmp/chaos-defaults.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
NO_EOS = {"2": -100}  # the tiny random model's EOS, biased away: every request streams max_tokens
ALLOWED = ("complete", "sse_error", "503_retry_after", "502_retry_after")


@dataclass
class ChaosOptions:
    kills: int = 100
    streams: int = 8
    spare_every: int = 10  # every k-th kill targets the spare engine (0: never)
    dwell_s: float = 1.0  # an engine is killed this long after it became ready
    max_tokens: int = 48
    end_within_s: float = 5.0
    hang_s: float = 60.0
    heal_timeout_s: float = 180.0  # for the engine to be ready again (a cool-down, a start)


@dataclass
class Request:
    start: float
    end: float
    outcome: str  # complete | sse_error | 503_retry_after | 502_retry_after | other | hang
    status: int | None = None
    code: str | None = None


@dataclass
class Kill:
    at: float
    target: str  # engine | spare
    pid: int
    replaced_after_s: float | None = None  # a spare: until a new one was warm
    after_failed: bool = False  # an engine: the model was `failed` (cooling down) before it came back
    dead_pid_shown: bool = False  # a spare: /admin/engines showed its pid after it had died


@dataclass
class Storm:
    opts: ChaosOptions
    url: str
    model: str
    requests: list[Request] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    running: asyncio.Event = field(default_factory=asyncio.Event)  # clear: clients pause
    stopping: bool = False
    in_flight: int = 0
    log: Callable[[str], None] = print


# --- one client's requests -------------------------------------------------------------------


async def one_request(session: aiohttp.ClientSession, storm: Storm) -> Request:
    """A streaming completion, classified by how it ended."""
    body = {"model": storm.model, "prompt": "Once upon a time", "max_tokens": storm.opts.max_tokens,
            "stream": True, "logit_bias": NO_EOS}
    start = time.monotonic()
    storm.in_flight += 1
    try:
        async with asyncio.timeout(storm.opts.hang_s):
            return await _post(session, storm, body, start)
    except TimeoutError:
        return Request(start, time.monotonic(), "hang")
    except (aiohttp.ClientError, OSError) as exc:
        return Request(start, time.monotonic(), "other", code=type(exc).__name__)
    finally:
        storm.in_flight -= 1


async def _post(session: aiohttp.ClientSession, storm: Storm, body: dict[str, Any], start: float) -> Request:
    async with session.post(f"{storm.url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raw = await resp.read()
            code = error_code(raw)
            kind = f"{resp.status}_retry_after" if resp.status in (502, 503) and "Retry-After" in resp.headers else "other"
            if kind == "other" and code is None:
                code = raw[:120].decode(errors="replace")  # not an OpenAI error: what it was instead
            return Request(start, time.monotonic(), kind, resp.status, code)
        outcome, code = "other", "stream ended without [DONE]"
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue  # SSE comments while it waits, blank lines
            payload = line[6:].strip()
            if payload == b"[DONE]":
                outcome, code = "complete", None
            elif b'"error"' in payload:
                outcome, code = "sse_error", error_code(payload)
        return Request(start, time.monotonic(), outcome, 200, code)


def error_code(raw: bytes) -> str | None:
    """The `code` of an OpenAI error body or event, if it is one."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return None
    return err.get("code") if isinstance(err, dict) else None


async def client(session: aiohttp.ClientSession, storm: Storm) -> None:
    """Requests one after another until the storm ends, pausing when told (spare kills)."""
    while not storm.stopping:
        await storm.running.wait()
        if storm.stopping:
            return
        req = await one_request(session, storm)
        storm.requests.append(req)
        if req.outcome == "503_retry_after":
            await asyncio.sleep(2.0)  # a polite client waits (Retry-After, up to 2 s here)
        elif req.outcome != "complete":
            await asyncio.sleep(0.1)


# --- the killer ------------------------------------------------------------------------------


async def admin_engines(url: str) -> dict[str, Any]:
    """GET /admin/engines on a connection of its own (none is left open to count as a file)."""
    async with (aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
                session.get(f"{url}/admin/engines", timeout=aiohttp.ClientTimeout(total=30)) as resp):
        return dict(await resp.json())


async def wait_for(check: Callable[[dict[str, Any]], bool], url: str, timeout_s: float) -> dict[str, Any] | None:
    """Poll /admin/engines until `check` holds; the answer that held, None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = await admin_engines(url)
        if check(info):
            return info
        await asyncio.sleep(0.1)
    return None


def model_row(info: dict[str, Any], model: str) -> dict[str, Any]:
    return next((e for e in info["data"] if e["model"] == model), {})


async def kill_engine(storm: Storm) -> Kill:
    """SIGKILL the model's engine once it has served `dwell_s`."""
    failed = False

    def ready(info: dict[str, Any]) -> bool:
        nonlocal failed
        row = model_row(info, storm.model)
        failed |= row.get("state") == "failed"
        return row.get("state") == "ready" and row.get("pid") is not None and (row.get("uptime_s") or 0) >= storm.opts.dwell_s

    info = await wait_for(ready, storm.url, storm.opts.heal_timeout_s)
    if info is None:
        raise RuntimeError(f"the engine was not ready again within {storm.opts.heal_timeout_s:.0f} s")
    pid = model_row(info, storm.model)["pid"]
    kill = Kill(time.monotonic(), "engine", pid, after_failed=failed)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    # Until the supervisor has seen it die, it still shows this engine as ready.
    if await wait_for(lambda i: model_row(i, storm.model).get("pid") != pid, storm.url, 30) is None:
        raise RuntimeError(f"the supervisor still shows engine pid {pid} 30 s after its SIGKILL")
    return kill


async def kill_spare(storm: Storm) -> Kill:
    """Pause the clients (a spare is made once the pool is quiet), SIGKILL the warm spare, and
    check that it is reaped (its pid never shown once dead) and replaced by a new warm one."""
    storm.running.clear()
    try:
        while storm.in_flight:
            await asyncio.sleep(0.05)
        info = await wait_for(lambda i: i["spare"]["warm"], storm.url, 90)
        if info is None:
            raise RuntimeError("no warm spare engine within 90 s of quiet")
        pid = info["spare"]["pid"]
        kill = Kill(time.monotonic(), "spare", pid)
        os.kill(pid, signal.SIGKILL)
        while is_running(pid):
            await asyncio.sleep(0.01)

        def replaced(i: dict[str, Any]) -> bool:
            kill.dead_pid_shown |= i["spare"]["pid"] == pid
            return bool(i["spare"]["warm"]) and i["spare"]["pid"] != pid

        if await wait_for(replaced, storm.url, 120) is not None:
            kill.replaced_after_s = round(time.monotonic() - kill.at, 2)
        return kill
    finally:
        storm.running.set()


def is_running(pid: int) -> bool:
    """Whether the process lives (a zombie has died)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def killer(storm: Storm) -> None:
    for i in range(1, storm.opts.kills + 1):
        spare_turn = storm.opts.spare_every > 0 and i % storm.opts.spare_every == 0
        kill = await (kill_spare(storm) if spare_turn else kill_engine(storm))
        storm.kills.append(kill)
        storm.log(f"kill {i}/{storm.opts.kills}: {kill.target} pid {kill.pid}, "
                  f"{len(storm.requests)} requests so far")


# --- before, during, after ---------------------------------------------------------------------


async def settle(storm: Storm, spares: bool) -> None:
    """Wait for the state the footprint is measured in: the engine ready, the spare warm (if
    the pool makes one), no client connected."""
    def settled(info: dict[str, Any]) -> bool:
        return model_row(info, storm.model).get("state") == "ready" and (info["spare"]["warm"] or not spares)

    if await wait_for(settled, storm.url, storm.opts.heal_timeout_s) is None:
        raise RuntimeError("the pool did not settle (engine ready, spare warm)")
    await asyncio.sleep(1.0)  # closed connections are gone from the supervisor's side too


def footprint(pid: int) -> dict[str, int]:
    proc = psutil.Process(pid)
    return {"rss_bytes": proc.memory_info().rss, "open_files": proc.num_fds()}


async def heal(storm: Storm) -> float | None:
    """Seconds from the last kill until a request completed, asking as a polite client does."""
    last_kill = storm.kills[-1].at if storm.kills else time.monotonic()
    deadline = time.monotonic() + storm.opts.heal_timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            req = await one_request(session, storm)
            if req.outcome == "complete":
                return round(req.end - last_kill, 2)
            await asyncio.sleep(1.0)
    return None


async def warm_up(storm: Storm) -> None:
    """The request path used a few times over (first-use allocations are not a leak)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(3):
            await asyncio.gather(*(one_request(session, storm) for _ in range(storm.opts.streams)))


async def run_chaos(url: str, supervisor_pid: int, model: str, opts: ChaosOptions,
                    spares: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The storm against a running supervisor; the report (see `summarize`)."""
    storm = Storm(opts, url, model, log=log)
    await warm_up(storm)
    await settle(storm, spares)
    before = footprint(supervisor_pid)
    started = time.monotonic()
    storm.running.set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        clients = [asyncio.create_task(client(session, storm)) for _ in range(opts.streams)]
        try:
            await killer(storm)
        finally:
            storm.stopping = True
            storm.running.set()
            await asyncio.gather(*clients)
    storm_s = time.monotonic() - started
    healed_s = await heal(storm)
    await settle(storm, spares)
    after = footprint(supervisor_pid)
    return summarize(storm, before, after, healed_s, storm_s)


def summarize(storm: Storm, before: dict[str, int], after: dict[str, int], healed_s: float | None,
              storm_s: float) -> dict[str, Any]:
    """Counts, the worst end after a kill, hangs, the footprint change and the verdicts."""
    reqs, opts = storm.requests, storm.opts
    engine_kills = [k for k in storm.kills if k.target == "engine"]
    late = [r.end - k.at for k in engine_kills for r in reqs if r.start < k.at < r.end or (r.outcome == "hang" and r.start < k.at)]
    spare_kills = [k for k in storm.kills if k.target == "spare"]
    growth = {key: (after[key] - before[key]) / before[key] for key in before}
    report = {
        "options": asdict(opts),
        "storm_s": round(storm_s, 1),
        "kills": {"engine": len(engine_kills), "spare": len(spare_kills)},
        "cool_downs_waited_out": sum(k.after_failed for k in engine_kills),  # crash loops healed by themselves
        "requests": len(reqs),
        "outcomes": dict(Counter(r.outcome for r in reqs)),
        "codes": dict(Counter(f"{r.outcome}:{r.status}:{r.code}" for r in reqs if r.outcome != "complete")),
        "in_flight_at_a_kill": len(late),
        "max_end_after_kill_s": round(max(late), 3) if late else None,
        "hangs": sum(r.outcome == "hang" for r in reqs),
        "longest_request_s": round(max((r.end - r.start for r in reqs), default=0.0), 2),
        "spare_replaced_after_s": [k.replaced_after_s for k in spare_kills],
        "dead_spare_pid_shown": sum(k.dead_pid_shown for k in spare_kills),
        "supervisor_before": before, "supervisor_after": after,
        "rss_growth_pct": round(100 * growth["rss_bytes"], 2),
        "open_files_growth_pct": round(100 * growth["open_files"], 2),
        "healed_after_last_kill_s": healed_s,
    }
    report["checks"] = {
        "every_request_ended_within_5s_of_a_kill": bool(late) and max(late) <= opts.end_within_s,
        "only_clean_outcomes": all(r.outcome in ALLOWED for r in reqs),
        "no_hangs": report["hangs"] == 0,
        "rss_within_5pct": abs(growth["rss_bytes"]) <= 0.05,
        "open_files_within_5pct": abs(growth["open_files"]) <= 0.05,
        "spares_replaced": all(k.replaced_after_s is not None and not k.dead_pid_shown for k in spare_kills),
        "serves_again_without_admin": healed_s is not None,
    }
    return report


# --- the command -------------------------------------------------------------------------------


def pool_config(args: argparse.Namespace) -> str:
    if args.mlxd_defaults:
        return ""
    return (f"[pool]\ncrash_limit = {args.crash_limit}\ncrash_window_s = {args.crash_window}\n"
            f"cooldown_s = {args.cooldown}\ncooldown_max_s = {args.cooldown_max}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--spare-every", type=int, default=10, help="every k-th kill targets the spare (0: never)")
    p.add_argument("--dwell", type=float, default=1.0, help="kill an engine this long after it became ready")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--crash-limit", type=int, default=5)
    p.add_argument("--crash-window", type=float, default=30.0)
    p.add_argument("--cooldown", type=float, default=2.0)
    p.add_argument("--cooldown-max", type=float, default=8.0)
    p.add_argument("--backoff", type=float, default=0.25, help="restart back-off base, s (MLXD_ENGINE_BACKOFF_S)")
    p.add_argument("--mlxd-defaults", action="store_true", help="mlxd's own crash-loop settings and back-off")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import log_on_failure, print_report
    from proxy_overhead import Supervisor, private_dir

    from mlxd.engine.models.random_model import build_random_llama

    opts = ChaosOptions(args.kills, args.streams, args.spare_every, args.dwell, args.max_tokens)
    os.environ["MLXD_SPARE_ENGINE"] = "1"
    if not args.mlxd_defaults:
        os.environ["MLXD_ENGINE_BACKOFF_S"] = str(args.backoff)
    with tempfile.TemporaryDirectory(prefix="mxc-", dir="/tmp") as tmp:
        work = private_dir(Path(tmp))
        model = build_random_llama(work / "tiny", context=4096)
        config = work / "mlxd.toml"
        config.write_text(f'{pool_config(args)}\n[models.tiny]\npath = "{model}"\n')
        sup = Supervisor(config, private_dir(work / "data"), private_dir(work / "rt"), work / "serve.log")
        with log_on_failure(work / "serve.log"):
            try:
                sup.wait_health()
                report = asyncio.run(run_chaos(sup.url, sup.proc.pid, "tiny", opts))
                report["config"] = config.read_text()
            finally:
                sup.stop()
    print_report(report, args.json)


if __name__ == "__main__":
    main()
