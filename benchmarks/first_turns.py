"""What a fresh engine's first long prompts and first continuations over them cost, against the
same requests later in its life (issue 29).

One engine (mlxd's defaults as the supervisor starts engines, unless `--flags` says otherwise)
takes, `--rounds` times over: a cold prompt of `--prompt-words` words, then the same prompt with
`--tail-words` more (a cached prefix and a short chunk over it, the shape a resumed reply's first
turn has). Every round has the same shapes, so what the first round pays above the others is
what a fresh engine pays for its first time (kernels loaded or compiled, graphs built), which
the warm-up is there to take before `ready`. Prints the engine's warm-up line and its own
timings (/admin/stats `last`) for each request.

  python3 benchmarks/first_turns.py --model /tmp/models/l8q [--trace]

With `--trace` the engine writes its step trace (MLXD_TRACE_STEPS) and each request's first turns
are printed with their parts (`chunk_ms`, `token_ms`, ...: docs/engine.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


TURNS_SHOWN = 6  # a request's first turns: its chunks, its first token, its first decode steps
TRACE_KEYS = ("t", "admitted", "peak_mb")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-words", type=int, default=1500)
    p.add_argument("--tail-words", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--flags", default="--batch auto", help="the engine's flags (the supervisor's default width)")
    p.add_argument("--bias", default='{"2": -100}', help="logit_bias (JSON): keep a random model's EOS away")
    p.add_argument("--gap", type=float, default=0.5, help="seconds between requests (the GPU idles that long)")
    p.add_argument("--trace", action="store_true",
                   help="run the engine with MLXD_TRACE_STEPS and print each request's first turns (their parts)")
    a = p.parse_args()
    from tests.support import EngineProcess

    bias = json.loads(a.bias)
    started = time.perf_counter()
    trace = Path(tempfile.mkdtemp()) / "steps.jsonl" if a.trace else None
    env = {**os.environ, "MLXD_TRACE_STEPS": str(trace)} if trace is not None else None
    engine = EngineProcess(Path(a.model), "m", *a.flags.split(), env=env).wait_ready(900)
    seen = 0
    print(f"engine ready in {time.perf_counter() - started:.1f} s; "
          + "; ".join(line[-300:] for line in engine.log().splitlines() if "warm-up:" in line or "batch " in line),
          flush=True)
    rows: dict[str, list[float]] = {"cold": [], "continued": []}
    try:
        for r in range(a.rounds):
            text = f"R{r} Story: tell me about a river. " + "Say more. " * a.prompt_words
            for kind, prompt in (("cold", text), ("continued", text + " And then? " * (a.tail_words // 2))):
                time.sleep(a.gap)
                t = time.perf_counter()
                resp = engine.client.post("/v1/completions", timeout=600, json={
                    "prompt": prompt, "max_tokens": 8, "temperature": 0, "logit_bias": bias})
                wall = (time.perf_counter() - t) * 1000
                resp.raise_for_status()
                last = engine.stats()["last"]
                usage = resp.json()["usage"]
                prefill = last["timings_ms"]["prefill"]
                rows[kind].append(prefill)
                if trace is not None:
                    lines = trace.read_text().splitlines() if trace.exists() else []
                    turns, seen = [json.loads(line) for line in lines[seen:]], len(lines)
                    for turn in turns[:TURNS_SHOWN]:
                        print("    turn " + " ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in turn.items() if k in TRACE_KEYS or k.endswith("_ms")))
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                print(f"round {r} {kind:9}: prompt {usage['prompt_tokens']} tokens ({cached} cached); prefill "
                      f"{prefill:.1f} ms; wall {wall:.1f} ms; " + " ".join(
                          f"{k} {v:.1f}" for k, v in last["timings_ms"].items()), flush=True)
    finally:
        engine.stop()
    for kind, ms in rows.items():
        if len(ms) > 1:
            later = statistics.median(ms[1:])
            print(f"{kind}: first {ms[0]:.1f} ms, later rounds' median {later:.1f} ms, the first pays {ms[0] - later:+.1f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
