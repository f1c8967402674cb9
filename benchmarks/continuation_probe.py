"""Where a resumed reply's time goes in the engine that takes it over (issue 29), engine by engine.

Engine A (mlxd's defaults as the supervisor starts engines, an SSD tier in a temp dir) streams `--streams` greedy completions of
long prompts of the same length (`--prompt-words`), with the resume marks on, and is SIGKILLed
once every stream has `--cut-at` tokens: its checkpoints are on SSD, as after a crash. Engine
B, fresh, on the same SSD tier, then takes each reply's continuation (`resume.tokens`: the
first `--cut-at` tokens), one after the other, then two cold prompts of the same length
(`--restore queue`: engine B does not restore the checkpoints as it starts). For
each, the engine's own timings (/admin/stats `last`), and the client's wall time. The
continuations have the same shapes: if the first is slower than the next, a fresh engine's
first time pays (kernels, graphs), not the continuation's work.

  python3 benchmarks/continuation_probe.py --model /tmp/models/l8q --prompt-words 1500 --cut-at 560
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def prompt(i: int, words: int, nonce: str) -> str:
    return f"{nonce} Story {i}: tell me about a river. " + "Say more. " * words


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--prompt-words", type=int, default=1500)
    p.add_argument("--cut-at", type=int, default=560)
    p.add_argument("--more", type=int, default=16, help="tokens each continuation generates")
    p.add_argument("--restore", choices=("early", "queue"), default="early",
                   help="early: engine B restores the running replies' checkpoints as it starts (mlxd's way); "
                        "queue: the names of them are taken away first, so each continuation restores its own")
    p.add_argument("--b-flags", default="", help="engine B's extra flags, e.g. '--generation-checkpoint 0'")
    p.add_argument("--trace", action="store_true",
                   help="engine B's step trace (MLXD_TRACE_STEPS): each request's first turns printed at the end")
    p.add_argument("--bias", default='{"2": -100}', help="logit_bias (JSON): keep a random model's EOS away")
    a = p.parse_args()
    from mlxd.protocol.process import MARK, MARKS_HEADER
    from tests.support import EngineProcess

    bias = json.loads(a.bias)
    with tempfile.TemporaryDirectory(prefix="contprobe-") as tmp:
        flags = ("--ssd-cache-dir", f"{tmp}/kv", "--batch", "auto")  # the supervisor's default (the engine's own is 1)
        first = EngineProcess(Path(a.model), "m", *flags, env={**os.environ, "MLXD_LOG_LEVEL": "DEBUG"}).wait_ready(600)
        ids: list[list[int]] = [[] for _ in range(a.streams)]
        enough = threading.Barrier(a.streams + 1)

        def run(i: int) -> None:
            body = {"prompt": prompt(i, a.prompt_words, "A"), "max_tokens": a.cut_at * 2, "temperature": 0,
                    "stream": True, "logit_bias": bias}
            told = False
            try:
                with first.client.stream("POST", "/v1/completions", json=body, headers={MARKS_HEADER: "1"},
                                         timeout=600) as resp:
                    for line in resp.iter_lines():
                        if line.startswith(MARK.decode()):  # `: ids INDEX TOTAL ID,ID[ end]`
                            carried = line.split(" ")[4]
                            ids[i].extend(int(x) for x in carried.split(",") if x)
                            if len(ids[i]) >= a.cut_at and not told:
                                told = True
                                enough.wait()
            except Exception:
                pass
            if not told:
                enough.abort()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(a.streams)]
        for t in threads:
            t.start()
        enough.wait()
        pc = first.stats().get("prompt_cache") or {}
        os.kill(first.proc.pid, signal.SIGKILL)
        print("engine A's log:\n  " + "\n  ".join(
            line[-400:] for line in first.log().splitlines()
            if any(w in line for w in ("checkpoints:", "paus", "batch auto", "lane", "prefill", "warm-up:")))[-6000:], flush=True)
        print(f"engine A at the kill: checkpoints {pc.get('checkpoints')}, skipped {pc.get('checkpoints_skipped')}, "
              f"writes pending {pc.get('writes_pending')}", flush=True)
        for t in threads:
            t.join()
        first.stop()
        live = [f.read_text() for f in sorted(Path(tmp, "kv").rglob("live-*.json"))]
        print(f"engine A killed with {[len(x) for x in ids]} tokens a stream; its running rows' checkpoints: {live}",
              flush=True)
        if a.restore == "queue":
            for f in Path(tmp, "kv").rglob("live-*.json"):
                f.unlink()
        started = time.perf_counter()
        steps = Path(tmp, "b_steps.jsonl")
        env = {**os.environ, "MLXD_TRACE_STEPS": str(steps)} if a.trace else None
        second = EngineProcess(Path(a.model), "m", *flags, *a.b_flags.split(), env=env).wait_ready(600)
        print(f"engine B ready in {time.perf_counter() - started:.1f} s; its log: "
              + "; ".join(line for line in second.log().splitlines() if any(w in line for w in ("restored", "warm-up:")))[-900:],
              flush=True)

        def send(label: str, body: dict[str, Any]) -> None:
            deadline = time.monotonic() + 30  # the last reply's write-behind done: it would hold the GPU thread
            while (second.stats().get("prompt_cache") or {}).get("writes_pending") and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            t = time.perf_counter()
            resp = second.client.post("/v1/completions", json={"temperature": 0, "logit_bias": bias, **body}, timeout=600)
            wall = (time.perf_counter() - t) * 1000
            resp.raise_for_status()
            stats = second.stats()
            last = stats["last"]
            cache = stats.get("prompt_cache") or {}
            timings = " ".join(f"{k} {v:.1f}" for k, v in last["timings_ms"].items())
            ssd = cache.get("ssd") or {}
            print(f"{label}: wall {wall:.1f} ms; {timings}; usage {resp.json()['usage']}; cache hits {cache.get('hits')}, "
                  f"restored early {cache.get('restored_early')}, SSD restores so far {ssd.get('restored_bytes', 0) / 1e6:.0f} MB "
                  f"in {ssd.get('restore_ms')} ms", flush=True)

        for i in range(a.streams):
            send(f"continuation {i}", {"prompt": prompt(i, a.prompt_words, "A"), "max_tokens": a.cut_at + a.more,
                                       "resume": {"tokens": ids[i][: a.cut_at]}})
        for i in range(2):
            send(f"cold prompt {i}", {"prompt": prompt(i, a.prompt_words, f"B{i}"), "max_tokens": a.more})
        second.stop()
        if a.trace and steps.exists():  # each request's first turns: its prefill, its first decode step
            lines = steps.read_text().splitlines()
            first = [i for i, line in enumerate(lines) if json.loads(line).get("admitted")]
            print("engine B's turns that admitted a request, and the two after each:\n  " + "\n  ".join(
                lines[j] for i in first for j in range(i, min(i + 3, len(lines)))), flush=True)


if __name__ == "__main__":
    main()
