"""How often the default model names Paris, by temperature (why import-default writes greedy).

Asks SmolLM2 "What is the capital of France?" `--samples` times at each `--temps` value with
mlxd's other sampling defaults (top_k 40, min_p 0.05) and the model card's top_p 0.9, through
mlx-lm's generate and make_sampler (what the engine samples with), and prints the first-token
probabilities and the count that mention Paris.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python benchmarks/default_sampling.py --model ~/.local/share/mlxd/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import mlx.core as mx
from mlx_lm import generate, load
from mlx_lm.sample_utils import make_sampler

QUESTION = "What is the capital of France?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--temps", default="0.2,0.1,0.05,0")
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()
    model, tok = load(str(args.model.expanduser()))
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    logits = model(mx.array(prompt)[None])[0, -1]
    logprobs = logits - mx.logsumexp(logits)
    top = mx.argsort(-logprobs)[:5].tolist()
    print("first token:", ", ".join(f"{tok.decode([i])!r} {mx.exp(logprobs[i]).item():.3f}" for i in top))
    for temp in (float(t) for t in args.temps.split(",")):
        sampler = make_sampler(temp=temp, top_p=0.9, min_p=0.05, top_k=40)
        outs = [generate(model, tok, prompt, max_tokens=args.max_tokens, sampler=sampler) for _ in range(args.samples)]
        starts = collections.Counter(o.split()[0] if o.split() else "" for o in outs)
        print(f"temperature {temp}: Paris in {sum('Paris' in o for o in outs)}/{len(outs)}; "
              f"first words {starts.most_common(3)}", flush=True)


if __name__ == "__main__":
    main()
