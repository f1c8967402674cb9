"""Probe (CUDA only): mlxd's fused decode attention against MLX's masked attention.

In a batched decode step mlx-lm's BatchKVCache left-pads rows and passes an array mask, and
MLX's CUDA backend then runs attention unfused. mlxd's kernel
(mlxd/engine/gpu/decode_attention.py) takes each row's first valid key instead. This probe
checks it against `mx.fast.scaled_dot_product_attention` with the mask and times both (and its
masked variant, for a batch with holes, against MLX's attention with that mask), one
layer's attention per case (many calls in one graph, as a model's layers run them), at each
warp count the kernel can use; with `--model` it also decodes the same staggered rows through the
whole model with and without the kernel and compares the logits and the greedy tokens.

  python3 benchmarks/masked_decode_attention.py [--model /tmp/models/l1b]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.gpu import decode_attention as da


def case(B: int, H: int, Hk: int, D: int, L: int, calls: int) -> str:
    alloc = ((L + 255) // 256) * 256 + 256  # the cache's buffer is longer than what is filled, as in mlx-lm
    q = mx.random.normal((B, 1, H, D)).astype(mx.bfloat16).transpose(0, 2, 1, 3)  # strided, as a model makes it
    k = mx.random.normal((B, Hk, alloc, D)).astype(mx.bfloat16)[:, :, :L, :]
    v = mx.random.normal((B, Hk, alloc, D)).astype(mx.bfloat16)[:, :, :L, :]
    starts = mx.array([(r * 37) % max(1, L // 2) for r in range(B)], dtype=mx.int32)
    scale = D ** -0.5
    want = da.reference(q, k, v, starts, scale).astype(mx.float32)
    err = mx.max(mx.abs(da.fused(q, k, v, starts, scale).astype(mx.float32) - want)).item()

    def per_call(fn) -> float:  # type: ignore[no-untyped-def]
        """us per call, `calls` calls in one graph (as a model's layers run them)."""
        best = float("inf")
        for _ in range(5):
            outs = [fn() for _ in range(calls)]
            t = time.perf_counter()
            mx.eval(outs)
            best = min(best, (time.perf_counter() - t) / calls * 1e6)
        return best

    cells = [f"masked sdpa {per_call(lambda: da.reference(q, k, v, starts, scale)):.1f}"]
    for w in (4, 8, 16, 32):
        cells.append(f"{w} warps {per_call(lambda w=w: da.fused(q, k, v, starts, scale, w)):.1f}")
    # the masked variant, for a batch with holes (refused drafts): against MLX's attention with that mask
    keep = da.holey_mask(starts, L)
    want_holey = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=keep).astype(mx.float32)
    err_holey = mx.max(mx.abs(da.fused(q, k, v, starts, scale, keep=keep).astype(mx.float32) - want_holey)).item()
    cells.append(f"holey: masked sdpa {per_call(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=keep)):.1f}")
    cells.append(f"masked kernel {per_call(lambda: da.fused(q, k, v, starts, scale, keep=keep)):.1f}")
    return (f"B={B} H={H} Hk={Hk} D={D} L={L}: max |diff| {err:.4f} (at {da.warps_for(L)} warps), "
            f"with holes {err_holey:.4f}; us per call: " + ", ".join(cells))


def whole_model(path: str, rows: int, steps: int) -> str:
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache

    model, _ = load(path)
    vocab = model.args.vocab_size
    lengths = [150 + (r * 37) % 64 for r in range(rows)]
    longest = max(lengths)
    pads = [longest - n for n in lengths]
    prompts = mx.array([[0] * p + [(i * 31 + r * 7) % (vocab - 5) + 2 for i in range(n)]
                        for r, (p, n) in enumerate(zip(pads, lengths, strict=True))])

    def decode() -> tuple[list[mx.array], list[list[int]]]:
        cache = [BatchKVCache(pads) for _ in model.layers]
        logits = model(prompts, cache=cache)[:, -1:, :]
        tok = mx.argmax(logits, axis=-1)
        seen, toks = [], []
        for _ in range(steps):
            logits = model(tok, cache=cache)[:, -1, :].astype(mx.float32)
            tok = mx.argmax(logits, axis=-1)[:, None]
            mx.eval(logits, tok)
            seen.append(logits)
            toks.append(tok[:, 0].tolist())
        return seen, toks

    plain_logits, plain_toks = decode()
    changed = da.install(model)
    fused_logits, fused_toks = decode()
    first = mx.max(mx.abs(plain_logits[0] - fused_logits[0])).item()
    same = sum(a == b for a, b in zip(plain_toks, fused_toks, strict=True))
    return (f"{path}: {rows} rows, modules {changed}: first decode step's logits max |diff| {first:.4f}; "
            f"greedy steps with every row's token equal: {same} of {steps}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=64, help="calls timed in one graph")
    p.add_argument("--model", help="also decode this model's rows with and without the kernel")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    a = p.parse_args()
    if not da.enabled():
        sys.exit(f"this probe needs MLX's CUDA backend (and {da.ENV} not 0)")
    for B, H, Hk, D, L in [(8, 32, 8, 64, 300), (16, 32, 8, 64, 300), (8, 32, 8, 128, 300),
                           (16, 32, 8, 128, 300), (16, 32, 8, 128, 1200), (16, 32, 8, 128, 4000)]:
        print(case(B, H, Hk, D, L, a.calls), flush=True)
    if a.model:
        print(whole_model(a.model, a.rows, a.steps), flush=True)


if __name__ == "__main__":
    main()
