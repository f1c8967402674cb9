"""Images: mlxd against raw mlx-vlm and `mlx_vlm.server`, one random VLM, one run (issue 25).

Figures, each a ratio against a baseline measured in the same run:
  * a lone image request's time to first token and decode tokens/s, mlxd (a streamed chat
    completion through its supervisor, at its defaults) / raw `mlx_vlm.stream_generate` in a
    worker process (the same model, image and prompt; the worker gets the engine's environment);
  * 8 concurrent image requests (each its own image): aggregate completion tokens/s, mlxd /
    `python -m mlx_vlm.server` at its defaults;
  * a repeated image question (the same image and words again): its time to first token / the
    same request's cold one, on mlxd.

The model is a random-weight VLM from mlx-vlm's own classes (mlxd/engine/models/random_vlm.py),
`--family` and its sizes by `--size` (small: the test model; bench: a few hundred MB, so that the
model's work, not the HTTP round trip, is what is timed; its images up to 1024 tokens, as a
screenshot's are). Requests are greedy; each measured lone
request has an image of its own (no side's cache can serve it), made of random pixels. Both
sides' clocks start from the image's PNG bytes (raw's decodes it with Pillow, as mlx-vlm's
generate does with an image file; mlxd's gets it as base64 in its request). The repeated
question's path is warmed up once first (on a GPU its kernels compile on first use). With
--json, the mlxd supervisor's log goes beside it (.serve.log).

  python benchmarks/vision.py                                  # CPU, the bench size
  python benchmarks/vision.py --size small --rounds 3 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from batching import MlxLmServer, bench_supervisor, show_log, stream_chat
from common import logit_bias
from engine_decode import engine_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxd.engine.models.random_vlm import Dims, build_random_vlm  # noqa: E402

Row = dict[str, Any]
SIZES = {
    "small": Dims(),
    "bench": Dims(hidden=1024, layers=12, intermediate=2816, heads=16, kv_heads=4, vision_layers=4, vision_hidden=256,
                  image_tokens=1024),
    # A GPU's: about 1.3B parameters (bf16 with --dtype bfloat16), the language model of a small VLM.
    "gpu": Dims(hidden=2048, layers=24, intermediate=5632, heads=16, kv_heads=4, vision_layers=8, vision_hidden=512,
                image_tokens=1024),
}
QUESTION = "Describe this picture in detail."


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def image_png(seed: int, side: int) -> bytes:
    """A PNG of random pixels (b"" for side 0: no image)."""
    from PIL import Image

    if not side:
        return b""
    pixels = (np.random.RandomState(seed).rand(side, side, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def chat_body(png: bytes, max_tokens: int, model: str, bias: dict[str, float], seed: int = 0) -> Row:
    if not png:  # no image: words of its own instead, about as many tokens as a 1024-token image's prompt
        rng = np.random.RandomState(seed)
        words = " ".join(f"w{n}" for n in rng.randint(0, 97, 700))
        return {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
                "temperature": 0, "logit_bias": bias, "messages": [{"role": "user", "content": f"{words} {QUESTION}"}]}
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "temperature": 0, "logit_bias": bias, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": QUESTION}]}]}


# --- raw mlx-vlm, in a worker process ----------------------------------------------------------

_raw: Row = {}


def raw_init(job: Row) -> None:
    """The worker's model, processor and prompt, loaded once."""
    from mlx_vlm import load

    model, processor = load(job["model"])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    _raw.update(job, model=model, processor=processor, prompt=prompt)


def raw_one(seed: int) -> Row:
    """stream_generate on one image: time to first token and decode tokens/s."""
    from mlx_vlm import stream_generate
    from PIL import Image

    png = image_png(seed, _raw["side"])
    bias = {int(k): v for k, v in _raw["bias"].items()}
    t0 = time.perf_counter()  # from the image's file bytes, as mlxd's clock starts from its request's
    image = Image.open(io.BytesIO(png)).convert("RGB")
    first = last = None
    tokens = 0
    for _ in stream_generate(_raw["model"], _raw["processor"], _raw["prompt"], image=[image],
                             max_tokens=_raw["max_tokens"], temperature=0.0, logit_bias=bias):
        now = time.perf_counter()
        first, last = first or now, now
        tokens += 1
    assert first is not None and last is not None
    return {"seed": seed, "ttft_s": first - t0, "tokens": tokens,
            "decode_tps": (tokens - 1) / (last - first) if last > first else float("nan")}


@contextlib.contextmanager
def raw_worker(job: Row, env: dict[str, str]) -> Iterator[Any]:
    """A worker process with the engine's environment (OpenBLAS preloaded on Linux), its model loaded."""
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        pool = multiprocessing.get_context("spawn").Pool(1, initializer=raw_init, initargs=(job,))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield pool
    finally:
        pool.close()
        pool.join()


# --- the servers ---------------------------------------------------------------------------------


class MlxVlmServer(MlxLmServer):
    """`python -m mlx_vlm.server --model PATH --port P`, at its defaults."""

    name = "mlx_vlm.server"
    health = "/health"

    def argv(self, model: Path, extra: list[str]) -> list[str]:
        return [sys.executable, "-m", "mlx_vlm.server", "--model", str(model), "--port", str(self.port),
                "--host", "127.0.0.1", *extra]


def encoded(seed: int, side: int, max_tokens: int, model: str, bias: dict[str, float]) -> bytes:
    """A request's body, its image made and the JSON encoded before any clock starts: the
    client's own work is not the server's."""
    return json.dumps(chat_body(image_png(seed, side), max_tokens, model, bias, seed)).encode()


async def lone(url: str, model: str, seeds: list[int], side: int, max_tokens: int, bias: dict[str, float]) -> list[Row]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        return [await stream_chat(session, url, encoded(s, side, max_tokens, model, bias)) for s in seeds]


async def together(url: str, model: str, seeds: list[int], side: int, max_tokens: int, bias: dict[str, float]) -> Row:
    bodies = [encoded(s, side, max_tokens, model, bias) for s in seeds]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(stream_chat(session, url, body) for body in bodies))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in rows)
    return {"streams": len(rows), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in rows)}


def med(rows: list[Row], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def run(args: argparse.Namespace, save: Any = lambda out: None) -> Row:
    work = Path(tempfile.mkdtemp(prefix="mlxd-vision-"))
    model = build_random_vlm(work / "model", args.family, dims=SIZES[args.size], dtype=args.dtype)
    env = engine_env()
    side = args.side
    warm = [1000, 1001]
    seeds = list(range(args.rounds))
    out: Row = {"mlxd_pool": args.mlxd_pool, "family": args.family, "size": args.size, "dims": SIZES[args.size].__dict__, "side": side,
                "max_tokens": args.max_tokens, "rounds": args.rounds}

    # EOS and every token that is not plain ASCII biased away, on every side: each reply is as long
    # as asked, and each token is text the moment it comes (a random model's stray UTF-8 bytes
    # would otherwise wait in a server's detokenizer, and its first token look late).
    bias = logit_bias(model, ascii_only=True)
    log("raw mlx-vlm (stream_generate in a worker) and mlxd, a lone image request each in turn")
    (work / "mlxd").mkdir()
    sup, config = bench_supervisor(model, work / "mlxd", pool_lines="".join(
        f"{line.strip()}\n" for line in args.mlxd_pool.split(";") if line.strip()))
    job = {"model": str(model), "side": side, "max_tokens": args.max_tokens, "bias": bias}
    out["raw"], out["mlxd"] = [], []
    try:
        with raw_worker(job, env) if seeds else contextlib.nullcontext() as raw:
            sup.wait_health()
            for seed in warm:
                if raw is not None:
                    raw.apply(raw_one, (seed,))
                asyncio.run(lone(sup.url, "bench", [seed], side, args.max_tokens, bias))
            for i, seed in enumerate(seeds):  # alternated, each side first in turn: the machine drifts
                first_raw = i % 2 == 0
                if first_raw:
                    out["raw"].append(raw.apply(raw_one, (seed,)))
                out["mlxd"] += asyncio.run(lone(sup.url, "bench", [seed], side, args.max_tokens, bias))
                if not first_raw:
                    out["raw"].append(raw.apply(raw_one, (seed,)))
        log("mlxd: a repeated image question, then 8 requests at once")
        asyncio.run(lone(sup.url, "bench", [499, 499], side, args.max_tokens, bias))  # its path warmed up (JIT)
        cold, again = asyncio.run(lone(sup.url, "bench", [500, 500], side, args.max_tokens, bias))
        out["repeat"] = {"cold_ttft_s": cold["ttft_s"], "warm_ttft_s": again["ttft_s"]}
        asyncio.run(together(sup.url, "bench", [2000 + i for i in range(args.streams)], side, args.max_tokens, bias))
        out["mlxd_together"] = asyncio.run(together(sup.url, "bench", [3000 + i for i in range(args.streams)], side,
                                                    args.max_tokens, bias))
        if args.text_too:  # the same at once without images: what batching text rows of that length gives
            out["mlxd_text_together"] = asyncio.run(together(sup.url, "bench", [4000 + i for i in range(args.streams)],
                                                             0, args.max_tokens, bias))
    except Exception:
        text = (work / "mlxd" / "serve.log").read_text(errors="replace")
        at = max(text.rfind("the GPU thread failed"), text.rfind("Exception in thread") if "GPU thread failed" not in text else -1)
        log(text[at:][:12000] if at >= 0 else text[-3000:])
        raise
    finally:
        sup.stop()
        if args.json:  # the engine's own account of each request (queue, prefill, decode)
            args.json.with_suffix(".serve.log").write_text((work / "mlxd" / "serve.log").read_text(errors="replace"))
    out["mlxd_config"] = config
    save(out)
    if args.no_server:
        return finish(out)

    log("mlx_vlm.server: 8 at once")
    server = MlxVlmServer(model, [], env, work / "mlx_vlm_server.log")
    try:
        try:
            server.wait_health()
        except RuntimeError as exc:  # it could not run here: the figures so far stand
            show_log(work / "mlx_vlm_server.log")
            out["server_error"] = str(exc)
            return finish(out)
        asyncio.run(together(server.url, str(model), [2000 + i for i in range(args.streams)], side, args.max_tokens,
                             bias))
        out["server_together"] = asyncio.run(together(server.url, str(model), [3000 + i for i in range(args.streams)],
                                                      side, args.max_tokens, bias))
    finally:
        server.stop()
    return finish(out)


def finish(out: Row) -> Row:
    """The ratios of the parts that ran."""
    ratios = {"repeat_warm_over_cold": out["repeat"]["warm_ttft_s"] / out["repeat"]["cold_ttft_s"]}
    if out["raw"]:
        ratios["lone_ttft_raw_over_mlxd"] = med(out["raw"], "ttft_s") / med(out["mlxd"], "ttft_s")
        ratios["lone_decode_mlxd_over_raw"] = med(out["mlxd"], "decode_tps") / med(out["raw"], "decode_tps")
    if "server_together" in out:
        ratios["together_mlxd_over_server"] = out["mlxd_together"]["tok_s"] / out["server_together"]["tok_s"]
    out["ratios"] = ratios
    return out


def report(r: Row) -> str:
    q = r["ratios"]
    lines = [f"{r['family']} {r['size']} ({r['side']}x{r['side']} images, {r['max_tokens']} tokens, {r['rounds']} lone rounds)"]
    if r["raw"]:
        lines += [
            f"lone TTFT: raw {med(r['raw'], 'ttft_s') * 1000:.0f} ms, mlxd {med(r['mlxd'], 'ttft_s') * 1000:.0f} ms "
            f"-> mlxd at {q['lone_ttft_raw_over_mlxd']:.2f}x raw's speed (aim >= 0.97)",
            f"lone decode: raw {med(r['raw'], 'decode_tps'):.1f} tok/s, mlxd {med(r['mlxd'], 'decode_tps'):.1f} tok/s "
            f"-> {q['lone_decode_mlxd_over_raw']:.2f}x (aim >= 0.97)"]
    together = f"{r['mlxd_together']['streams']} at once: mlxd {r['mlxd_together']['tok_s']:.1f} tok/s"
    if "server_together" in r:
        together += (f", mlx_vlm.server {r['server_together']['tok_s']:.1f} tok/s -> "
                     f"{q['together_mlxd_over_server']:.2f}x (aim >= 2)")
    elif "server_error" in r:
        together += f"; mlx_vlm.server could not run here ({r['server_error']})"
    else:
        together += "; mlx_vlm.server left out (--no-server)"
    if "mlxd_text_together" in r:
        together += f" (text only, no image: {r['mlxd_text_together']['tok_s']:.1f} tok/s)"
    lines += [together,
              f"repeated image: cold {r['repeat']['cold_ttft_s'] * 1000:.0f} ms, again "
              f"{r['repeat']['warm_ttft_s'] * 1000:.0f} ms -> {q['repeat_warm_over_cold']:.3f} (aim <= 0.10)"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen2_vl", choices=["qwen2_vl", "gemma3"])
    p.add_argument("--size", default="bench", choices=sorted(SIZES))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--side", type=int, default=896, help="image width and height in pixels (896: 1024 tokens in "
                                                         "the bench size, a screenshot's order)")
    p.add_argument("--rounds", type=int, default=5, help="lone requests measured (each its own image; 0: none, "
                                                         "and no raw mlx-vlm)")
    p.add_argument("--streams", type=int, default=8, help="requests at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--text-too", action="store_true", help="also the same number of text requests at once on "
                                                           "mlxd, a prompt of about the same length, no image")
    p.add_argument("--mlxd-pool", default="", help="lines for mlxd's [pool] table, ';'-separated (a tuned "
                                                      "run, named: 'cuda_graphs = true'); none: its defaults")
    p.add_argument("--no-server", action="store_true", help="leave out mlx_vlm.server (its 8 at once)")
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args()
    result = run(args, lambda out: args.json.write_text(json.dumps(out, indent=2)) if args.json else None)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
