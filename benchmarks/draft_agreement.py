"""How often a draft model picks its target's token, measured three ways, to tell a pair that
disagrees from a fault in mlxd's draft path.

- **Teacher-forced**: the target writes N tokens greedily; both models then read prompt and
  text in one pass each, and at every position of the text the draft's argmax is compared with
  the target's. That is the chance a first draft is kept, whatever decodes it.
- **The target against itself**: the same one-pass argmax against the tokens it wrote one at a
  time (1.0 in float32; lower where bf16 or 4-bit sums round differently across shapes).
- **mlx-lm's own speculative decoding** (`speculative_generate_step`, 4 drafts a pass): the share
  of its tokens that came from the draft.

It also prints how close the target's top two logits are (near-ties are where rounding flips
picks). mlxd's figure for the same pair is `benchmarks/speculative.py --draft DRAFT`'s
`drafts kept`.

  python benchmarks/draft_agreement.py --model /tmp/models/l1b-x4 --draft /tmp/models/l1b --tokens 128
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxd.engine.spec.drafters import greedy_pick

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "Name the keeper and the town.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    target, tokenizer = load(args.model)
    draft, _ = load(args.draft)
    prompt = tokenizer.encode(PROMPT)
    text = [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=args.tokens,
                                             prompt_cache=make_prompt_cache(target))]
    seq = mx.array(prompt + text)[None]
    start = len(prompt) - 1  # the logits there pick the text's first token
    t_raw = target(seq)[0, start:start + len(text)]
    t_logits = t_raw.astype(mx.float32)
    d_logits = draft(seq)[0, start:start + len(text)].astype(mx.float32)
    t_greedy = greedy_pick(t_raw)  # as the target's own steps pick: in its dtype, after the logsumexp
    differ = [i for i, (a, b) in enumerate(zip(t_greedy.tolist(), text, strict=True)) if a != b]  # type: ignore[arg-type]
    t_pick, d_pick = mx.argmax(t_logits, axis=-1), mx.argmax(d_logits, axis=-1)
    top2 = mx.sort(t_logits, axis=-1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]).tolist()
    margin.sort()  # type: ignore[attr-defined]
    spec = list(speculative_generate_step(mx.array(prompt), target, draft, num_draft_tokens=4,
                                          max_tokens=args.tokens))
    print(json.dumps({
        "tokens": len(text),
        "teacher_forced_agreement": round(float((t_pick == d_pick).astype(mx.float32).mean().item()), 3),
        "target_one_pass_vs_its_own_steps": round(float((t_pick == mx.array(text)).astype(mx.float32).mean().item()), 3),
        # the same, picking as decoding does (greedy_pick): 1.0 unless one pass and single steps round differently
        "target_one_pass_picks_vs_its_own_steps": round(1 - len(differ) / len(text), 3),
        "first_position_that_differs": differ[0] if differ else None,
        "target_top2_margin_median": round(margin[len(margin) // 2], 4),  # type: ignore[index]
        "target_top2_margin_p10": round(margin[len(margin) // 10], 4),  # type: ignore[index]
        "mlx_lm_speculative_from_draft": round(sum(1 for _, _, d in spec if d) / max(1, len(spec)), 3),
        "mlx_lm_speculative_same_text": [int(t) for t, _, _ in spec] == text,
    }), flush=True)


if __name__ == "__main__":
    main()
