"""Where a burst of image requests spends the GPU thread's time, without the HTTP around it.

On one random VLM (benchmarks/vision.py's sizes), in this process, as the engine's GPU thread
runs them (mlxd/engine/gpu/media.py, image_batch.py):
  * a lone image row's start: the vision tower and its prompt's prefill (media.complete);
  * `--rows` image rows started together: one at a time, and as one batch (image_batch.start_rows),
    the batch's vision tower and embeddings timed apart from its language model;
  * batched decode steps of those rows at their prompts' length (1069 tokens at 896x896 in the
    gpu size): through the text twin (mlx-lm's Qwen2 on the same weights, models/vision.py) and
    through mlx-vlm's own language model.
Each figure is the median of `--repeat` runs after one warm-up (kernels compile on first use).
Every figure is taken with the model's attention as the engine routes it (decode_attention.install
on CUDA, cpu_attention.install on the CPU) and, with --unrouted-too, first without.

  python benchmarks/image_prefill.py --size small --rows 4
  python benchmarks/image_prefill.py --size gpu --dtype bfloat16 --unrouted-too --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mlx_lm.models.cache import BatchKVCache  # noqa: E402
from vision import SIZES, image_png  # noqa: E402

from mlxd.engine.gpu import cpu_attention, decode_attention, image_batch, media  # noqa: E402
from mlxd.engine.models.image_memo import PromptMedia  # noqa: E402
from mlxd.engine.models.loaded_model import LoadedModel  # noqa: E402
from mlxd.engine.models.random_vlm import build_random_vlm  # noqa: E402
from mlxd.engine.models.vision import Image  # noqa: E402

QUESTION = "Describe this picture in detail."


class Job:
    def __init__(self, prompt: list[int], prompt_media: Any) -> None:
        self.prompt, self.media = prompt, prompt_media


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median milliseconds of `fn` (evaluated and synchronized), after one warm-up call."""
    fn()
    mx.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        mx.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def jobs_for(loaded: LoadedModel, n: int, side: int) -> list[Job]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    out = []
    for seed in range(n):
        prompt, prompt_media = loaded.media_prompt(messages, None, None,
                                                   PromptMedia.decoded([Image.of(image_png(seed, side))]))
        out.append(Job(prompt, prompt_media))
    return out


def fresh(jobs: list[Job]) -> list[Job]:
    """The jobs again with their per-request state (the rope delta) unset."""
    out = []
    for job in jobs:
        m = job.media
        out.append(Job(job.prompt, type(m)(m.arrays, m.spans, m.digests)))
    return out


def figures(loaded: LoadedModel, jobs: list[Job], step: int, repeat: int, steps: int) -> dict[str, float]:
    vlm = loaded.vlm
    assert vlm is not None
    out: dict[str, float] = {}

    def lone() -> None:
        (job,) = fresh(jobs[:1])
        kv, _ = media.complete(loaded, job, job.prompt, None, 0, step)
        mx.eval([c.state for c in kv])

    def one_by_one() -> None:
        for job in fresh(jobs):
            kv, _ = media.complete(loaded, job, job.prompt, None, 0, step)
            mx.eval([c.state for c in kv])

    def batched() -> list[Any]:
        rows = image_batch.start_rows(loaded, fresh(jobs), step)
        mx.eval([c.state for kv, _ in rows for c in kv])
        return rows

    def embeddings() -> None:
        group = fresh(jobs)
        tokens = mx.array([job.prompt[:-1] for job in group])  # one length at one image size
        pixels = mx.concatenate([media.device_array(job.media.arrays["pixel_values"]) for job in group])
        grids = mx.array([[int(v) for v in job.media.arrays["image_grid_thw"].reshape(-1)] for job in group])
        mx.eval(vlm.get_input_embeddings(tokens, pixels, image_grid_thw=grids,
                                         mask=mx.ones(tokens.shape, dtype=mx.int32)).inputs_embeds)

    out["lone_start_ms"] = timed(lone, repeat)
    out["one_by_one_ms"] = timed(one_by_one, repeat)
    out["batched_ms"] = timed(batched, repeat)
    out["batched_embeddings_ms"] = timed(embeddings, repeat)

    rows = batched()
    view = loaded.model
    for name, twin in (("twin", view._twin), ("mlx_vlm", None)):
        if name == "twin" and twin is None:
            continue
        saved, view._twin = view._twin, twin

        def decode() -> None:
            cache = [BatchKVCache.merge([kv[layer] for kv, _ in rows]) for layer in range(len(rows[0][0]))]
            token = mx.array([[job.prompt[-1]] for job in jobs])
            for _ in range(steps):
                token = mx.argmax(view(token, cache=cache)[:, -1:], axis=-1)
                mx.async_eval(token)
            mx.eval(token)

        out[f"decode_step_ms_{name}"] = timed(decode, repeat) / steps
        view._twin = saved
    return out


def route(loaded: LoadedModel) -> list[str]:
    if mx.cuda.is_available():
        return decode_attention.install(loaded.model)
    return cpu_attention.install(loaded.model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="bench", choices=sorted(SIZES))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--side", type=int, default=896)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--step", type=int, default=None, help="prefill step (default: 2048 on a GPU, 512 on the CPU)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--unrouted-too", action="store_true", help="first every figure with mlx's own attention")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    step = args.step or (2048 if mx.cuda.is_available() else 512)
    work = Path(tempfile.mkdtemp(prefix="mlxd-image-prefill-"))
    path = build_random_vlm(work / "model", "qwen2_vl", dims=SIZES[args.size], dtype=args.dtype)
    loaded = LoadedModel(path, "bench")
    mx.eval(loaded.vlm.parameters())  # type: ignore[union-attr]
    jobs = jobs_for(loaded, args.rows, args.side)
    result: dict[str, Any] = {"size": args.size, "dtype": args.dtype, "rows": args.rows, "prompt_tokens": len(jobs[0].prompt),
                              "step": step, "twin": loaded.model._twin is not None}
    if args.unrouted_too:
        result["unrouted"] = figures(loaded, jobs, step, args.repeat, args.decode_steps)
        print("unrouted", json.dumps(result["unrouted"]), flush=True)
    result["routed_modules"] = route(loaded)
    decode_attention.prefill_attention.aligned_chunk = step
    result["routed"] = figures(loaded, jobs, step, args.repeat, args.decode_steps)
    print("routed", result["routed_modules"], json.dumps(result["routed"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
