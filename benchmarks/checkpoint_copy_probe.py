"""What a generation checkpoint costs a batch's decode, mechanism by mechanism, in one process.

mlx-lm's BatchGenerator decodes `--rows` rows over a `--prompt`-token KV (random, so no
prefill is timed), the model set up as the engine sets it up (flattened quantized rows, the
fused decode attention on CUDA). Each row is checkpointed the way the batch lane does it
(gpu/checkpoints.py): its KV out of the batch with mlx-lm's `extract_cache`, the prompt's at
its first token, a delta at `--every` tokens, through the engine's own PrefixCache and SSD tier
(a temp dir). Modes, alternated over `--rounds`:

  * off: no checkpoint;
  * tensors: each array staged on its own, read to the host on the GPU thread, the rows' KV
    out of mlx-lm's extract_cache (a copy of each row's whole KV): the code before 2026-12-07's
    eleventh session;
  * grouped: like arrays staged in one block (kv_layout.GROUP, no size limit), else as tensors;
  * paced (mlxd's way on CUDA): each row's KV cut from the batch as views (checkpoints.rows_kv),
    blocks of up to kv_layout.BLOCK_BYTES, read on the GPU thread, at most `--read-a-turn` bytes
    a turn (prefix_cache.READ_A_TURN), so each read hides behind the step in flight;
  * gpu: paced's staged copy made and dropped, never read on the host;
  * pinned (CUDA only): the engine's way on CUDA: paced's staged copy, each block copied into
    page-locked host memory by a kernel on a stream of its own (mlxd/engine/cache/pinned.py), the
    SSD tier's writer waiting for the copies there: MLX never reads the blocks on the host.

(On 2026-12-07, twelfth session, `moved` and `movedrop` ways also ran: each block moved to host
memory by a one-element read queued on MLX's CPU stream, the writer thread then taking the bytes
with no copy; 0.960-0.966 of off with the writes, 0.92-0.94 without them. They were taken out
with the code they measured, commit 6990371: docs/benchmarks.md.)

(On 2026-12-07 a `writer` way also ran: one block a file read in the writer thread, 0.959 of
off against grouped's 0.961; it was taken out: the read holds the GIL, so the GPU thread waits
all the same.)

Reports per mode and round: tokens/s, the median step, the slowest step, time in steps over
twice the median, and the median step of the last quarter (after the writes: does the first
checkpoint leave later steps slower?).

  python3 benchmarks/checkpoint_copy_probe.py --model /tmp/models/l8q --rows 8 --prompt 4574 --steps 640
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("off", "tensors", "grouped", "paced", "gpu", "pinned")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=4574)
    p.add_argument("--steps", type=int, default=640)
    p.add_argument("--every", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default="off,grouped,paced,gpu")
    p.add_argument("--read-a-turn", type=int, default=64 << 20, help="paced: bytes read to the host a turn (mlxd's on CUDA)")
    p.add_argument("--pinned-gib", type=float, default=8.0, help="pinned: the page-locked host memory (a checkpoint it has no room for goes the paced way)")
    a = p.parse_args()
    modes = a.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes: {sorted(unknown)}")

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engine.cache import kv_layout, prefix_cache
    from mlxd.engine.cache.kv_layout import view
    from mlxd.engine.cache.prefix_cache import PrefixCache
    from mlxd.engine.cache.ssd_tier import SsdTier
    from mlxd.engine.gpu import decode_attention
    from mlxd.engine.gpu.checkpoints import rows_kv
    from mlxd.engine.gpu.flat_rows import flatten_quantized_rows, wins_here

    copier = None
    if "pinned" in modes:
        from mlxd.engine.cache import pinned

        copier = pinned.Copier()
        copier.arena = pinned.Arena.pinned(int(a.pinned_gib * (1 << 30)))
        copier.warm()  # its compile, as the engine does at start

    model, _ = load(a.model)
    if wins_here():
        flatten_quantized_rows(model)
    if decode_attention.enabled():
        decode_attention.install(model)
    args = model.args
    kv_heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    vocab = args.vocab_size
    rng = np.random.default_rng(0)
    print(f"{a.model}: {a.rows} rows over {a.prompt} tokens, {a.steps} steps, checkpoints at the first token and "
          f"every {a.every}; {len(model.layers)} layers, {kv_heads} KV heads of {head_dim}", flush=True)

    def row_cache() -> list[Any]:
        cache = make_prompt_cache(model)
        for c in cache:
            k = mx.random.normal((1, kv_heads, a.prompt - 1, head_dim)).astype(mx.bfloat16)
            c.update_and_fetch(k, mx.random.normal(k.shape).astype(mx.bfloat16))
        mx.eval([c.state for c in cache])
        return cache

    def one(mode: str, steps: int) -> dict[str, float]:
        kv_layout.GROUP = mode != "tensors"
        kv_layout.BLOCK_BYTES = 1 << 40 if mode == "grouped" else block_bytes
        prefix_cache.READ_A_TURN = a.read_a_turn if mode in ("paced", "pinned") else None
        with tempfile.TemporaryDirectory(prefix="ckprobe-") as tmp:
            pc = PrefixCache(64 << 30, SsdTier(Path(tmp), 1 << 40))
            pc.copier = copier if mode == "pinned" else None
            gen = BatchGenerator(model, completion_batch_size=a.rows, prefill_batch_size=a.rows)
            histories = [rng.integers(2, vocab - 1, a.prompt + steps + 2).tolist() for _ in range(a.rows)]
            uids = gen.insert([[h[a.prompt - 1]] for h in histories], max_tokens=[steps + 10] * a.rows,
                              caches=[row_cache() for _ in range(a.rows)])
            row = dict(zip(uids, range(a.rows), strict=True))
            made = [0] * a.rows
            base: list[Any] = [None] * a.rows
            held: list[Any] = []
            times: list[float] = []
            t0 = time.perf_counter()
            while min(made) < steps:
                t = time.perf_counter()
                _, responses = gen.next()
                if mode != "off":
                    pc.send_checkpoints()
                held.clear()
                due = []
                for r in responses:
                    i = row[r.uid]
                    made[i] += 1
                    if mode != "off" and (made[i] == 1 or made[i] % a.every == 0):
                        due.append(r.uid)
                cut = rows_kv(gen, due) if mode in ("paced", "gpu", "pinned") else gen.extract_cache(due)
                for uid, (kv, _) in cut.items():
                    i = row[uid]
                    tokens = histories[i][: a.prompt + made[i]]
                    if mode == "gpu":
                        staged = kv_layout.stage(kv)
                        mx.async_eval(staged.arrays)
                        held.append(staged)
                    elif base[i] is None:
                        base[i] = pc.checkpoint(view(kv, a.prompt), tokens)
                    else:
                        base[i] = pc.checkpoint(kv, tokens, base[i]) or base[i]
                times.append(time.perf_counter() - t)
            wall = time.perf_counter() - t0
            gen.close()
            if pc.ssd is not None:
                pc.flush(300)
            stats = pc.stats
            written = pc.ssd.stats.written_bytes if pc.ssd is not None else 0
            pc.close()
        del gen
        mx.clear_cache()
        med = statistics.median(times)
        tail = times[-len(times) // 4:]
        return {"tok_s": a.rows * steps / wall, "median_ms": med * 1000, "max_ms": max(times) * 1000,
                "slow_ms": sum(x for x in times if x > 2 * med) * 1000, "tail_ms": statistics.median(tail) * 1000,
                "checkpoints": stats.checkpoints, "skipped": stats.checkpoints_skipped,
                "gpu_thread_ms": stats.checkpoint_s * 1000, "written_mb": written / 1e6}

    block_bytes = kv_layout.BLOCK_BYTES
    one("off", 40)  # kernels, and the first shapes
    one("paced", 40)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for mode in modes if r % 2 == 0 else list(reversed(modes)):
            out = one(mode, a.steps)
            results[mode].append(out)
            print(f"round {r} {mode:8s} " + " ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    off = statistics.median(x["tok_s"] for x in results["off"]) if results.get("off") else None
    for mode, outs in results.items():
        rate = statistics.median(x["tok_s"] for x in outs)
        print(f"{mode:8s} median {rate:.1f} tok/s" + (f", {rate / off:.3f} of off" if off else ""), flush=True)


if __name__ == "__main__":
    main()
