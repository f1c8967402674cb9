"""A lone long prompt in one process: the engine's serial lane against raw `stream_generate`.

long_prompt.py compares the engine (a process of its own, over its socket) with raw mlx-lm; this
takes the process, the HTTP side and the other threads away to find where a gap comes from. One
process loads the model with the engine's loader, then alternates, on the same fresh prompts:

  * raw: mlx-lm's `stream_generate` (prefill chunks of 2048, then a token at a time);
  * lane: mlxd's SerialLane driven step by step (engine/gpu/serial_lane.py: its chunks, then
    generate_step from the prompt's last token), as the engine's GPU thread drives it;

each with MLX's attention as mlx-lm calls it (`plain`) and through mlxd's routing
(`routed`: decode_attention.install, prefill_attention.route), and with MLX's buffer cache
capped as the engine caps it (`--cache-limit-gib`). For each: time to first token, each step's
time up to it (raw: the time between its model calls), and decode tokens/s after it.

`--gateway "ENGINE FLAGS"` adds a variant `gw`: the engine's whole GPU side in this process
(gateway.py: the load through mlxd's loader, the sizing, the width probe and warm-up its flags
ask for, MLX's cache cap, the frozen GC, the GPU thread and its inbox), a job submitted from an
asyncio loop as a request handler submits it; only the HTTP side and the process are left out.
Its TTFT is the engine's own (queue + prefill, as long_prompt.py reads it), its decode from the
Done event's decode time. With `--gateway`, MLX's settings are the engine's (mlx_env.apply).

  python benchmarks/serial_ab.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 5
  python benchmarks/serial_ab.py ... --variants raw-plain,gw --gateway "--batch auto"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if "--gateway" in sys.argv:  # the engine's MLX settings, before mlx is imported (as its __main__)
    from mlxd.engine import mlx_env

    mlx_env.apply()

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors  # noqa: E402

from mlxd.engine.cache.prefix_cache import PrefixCache  # noqa: E402
from mlxd.engine.gpu import decode_attention, prefill_attention  # noqa: E402
from mlxd.engine.gpu.job import Job, SamplingParams  # noqa: E402
from mlxd.engine.gpu.sequence import Sequence  # noqa: E402
from mlxd.engine.gpu.serial_lane import SerialLane  # noqa: E402
from mlxd.engine.gpu.stats import Stats  # noqa: E402
from mlxd.engine.gpu.ticket import Ticket  # noqa: E402
from mlxd.engine.models.loaded_model import LoadedModel  # noqa: E402

STEP = 2048


class Routing:
    """Switch the model's attention between mlx-lm's own and mlxd's routing."""

    def __init__(self, model: Any) -> None:
        from mlx_lm.models import base

        decode_attention.install(model)
        # The modules routed now, by this install or by a gateway's loader before it (the
        # modules are shared: without this, raw-plain ran routed after --gateway).
        names = sorted({type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__})
        self.modules = [sys.modules[n] for n in names if n in sys.modules and getattr(
            getattr(sys.modules[n], "scaled_dot_product_attention", None), "__name__", "") == "decode_sdpa"]
        self.routed = [m.scaled_dot_product_attention for m in self.modules]
        self.plain = base.scaled_dot_product_attention
        prefill_attention.aligned_chunk = STEP

    def use(self, routed: bool) -> None:
        for module, fn in zip(self.modules, self.routed, strict=True):
            module.scaled_dot_product_attention = fn if routed else self.plain


def raw_run(loaded: LoadedModel, ids: list[int], max_tokens: int, bias: dict[int, float]) -> dict[str, Any]:
    calls: list[float] = []
    cls = type(loaded.model)
    original = cls.__call__

    def stamped(self: Any, *a: Any, **k: Any) -> Any:
        calls.append(time.perf_counter())
        return original(self, *a, **k)

    cls.__call__ = stamped  # type: ignore[method-assign]
    stamps: list[float] = []
    try:
        t0 = time.perf_counter()
        processors = make_logits_processors(logit_bias=bias)
        for _ in stream_generate(loaded.model, loaded.tokenizer, ids, max_tokens=max_tokens,
                                 logits_processors=processors, prefill_step_size=STEP):
            stamps.append(time.perf_counter())
    finally:
        cls.__call__ = original  # type: ignore[method-assign]
    mx.clear_cache()
    before = [c for c in calls if c <= stamps[0]]
    steps = [(b - a) * 1000 for a, b in zip([t0, *before], [*before, stamps[0]], strict=True)][1:]
    return {"ttft_ms": (stamps[0] - t0) * 1000, "steps_ms": steps,
            "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


def lane_run(loaded: LoadedModel, loop: asyncio.AbstractEventLoop, ids: list[int], max_tokens: int,
             bias: dict[int, float]) -> dict[str, Any]:
    lane = SerialLane(loaded, Stats(), STEP, PrefixCache(0))
    job = Job(list(ids), max_tokens, SamplingParams(temperature=0.0, logit_bias=bias), [], Ticket(loop))
    seq = Sequence(job, loaded.tokenizer, set())
    t0 = time.perf_counter()
    lane.admit(seq)
    steps: list[float] = []
    first: float | None = None
    last = t0
    done = False
    while not done:
        done = bool(lane.step())
        now = time.perf_counter()
        if first is None:
            steps.append((now - last) * 1000)
            if seq.generated:
                first = now
        last = now
    mx.clear_cache()
    assert first is not None and len(seq.generated) == max_tokens, (len(seq.generated), seq.finish_reason)
    return {"ttft_ms": (first - t0) * 1000, "steps_ms": steps,
            "decode_tps": (len(seq.generated) - 1) / (last - first)}


class InProcessGateway:
    """The engine's GPU side (Gateway) in this process, driven from an asyncio loop."""

    def __init__(self, model: Path, flags: str) -> None:
        from mlxd.engine.gpu.gateway import Gateway
        from mlxd.engine.server import gateway_options
        from mlxd.engine.settings import parse_args as engine_args

        os.environ.setdefault("MLXD_DATA_DIR", tempfile.mkdtemp(prefix="serial-ab-"))
        settings = engine_args(["--model", str(model), "--model-id", "bench", "--socket", "/tmp/serial-ab.sock",
                                "--prompt-cache-bytes", "0", *shlex.split(flags)])
        self.gateway = Gateway(lambda: LoadedModel(settings.model, settings.model_id, settings.max_context),
                               Stats(), gateway_options(settings))
        self.loop = asyncio.new_event_loop()
        self.gateway.start()
        t0 = time.perf_counter()
        while self.gateway.loaded is None:
            if self.gateway.load_error or not self.gateway._thread.is_alive():
                raise RuntimeError(f"gateway did not load: {self.gateway.load_error}")
            time.sleep(0.05)
        sizing = self.gateway.sizing
        print(f"gateway ready in {time.perf_counter() - t0:.1f} s ({flags or 'defaults'}): "
              f"{sizing.why if sizing else '-'}", flush=True)

    def run(self, ids: list[int], max_tokens: int, bias: dict[int, float]) -> dict[str, Any]:
        return self.loop.run_until_complete(self._run(ids, max_tokens, bias))

    def close(self) -> None:
        """Stop the GPU thread and wait for it (left running, it aborted the process at exit)."""
        self.loop.call_soon(self.gateway.stop)
        self.loop.run_until_complete(asyncio.sleep(0))
        self.gateway._thread.join(60)
        self.loop.close()

    async def _run(self, ids: list[int], max_tokens: int, bias: dict[int, float]) -> dict[str, Any]:
        from mlxd.protocol.events import Done, Failed, Token

        t0 = time.perf_counter()
        job = Job(list(ids), max_tokens, SamplingParams(temperature=0.0, logit_bias=bias), [], Ticket(self.loop))
        self.gateway.submit(job)
        first: float | None = None
        async for batch in job.ticket.events():
            for event in batch:
                if isinstance(event, Token) and first is None:
                    first = time.perf_counter()
                elif isinstance(event, Failed):
                    raise RuntimeError(event.message)
                elif isinstance(event, Done):
                    assert event.completion_tokens == max_tokens, event
                    return {"ttft_ms": event.queue_ms + event.prefill_ms, "steps_ms": [],
                            "seen_ms": ((first or time.perf_counter()) - t0) * 1000,
                            "decode_tps": (event.completion_tokens - 1) / (event.decode_ms / 1000)}
        raise RuntimeError("no Done event")


def main() -> None:
    args = parse_args()
    if not args.thread:
        run(args)
        return
    # as the engine runs it: load and generate on a thread of their own (MLX's streams and its
    # CUDA caches are per thread), the main thread waiting
    worker = threading.Thread(target=run, args=(args,), name="mlxd-gpu")
    worker.start()
    worker.join()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--lengths", default="8000,24000")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--variants", default="raw-plain,lane-plain,raw-routed,lane-routed")
    p.add_argument("--cache-limit-gib", type=float, default=0, help="mx.set_cache_limit, as the engine does (0: MLX's)")
    p.add_argument("--thread", action="store_true", help="load and run on a thread of its own, as the engine does")
    p.add_argument("--gateway", default=None, metavar="ENGINE_FLAGS",
                   help="add the variant gw: the engine's Gateway in this process with these engine flags")
    args = p.parse_args()
    if args.gateway is not None and "gw" not in args.variants.split(","):
        args.variants += ",gw"
    return args


def run(args: argparse.Namespace) -> None:
    gateway = InProcessGateway(args.model, args.gateway) if args.gateway is not None else None
    loaded = LoadedModel(args.model, "bench")
    routing = Routing(loaded.model)
    if args.cache_limit_gib:
        mx.set_cache_limit(int(args.cache_limit_gib * 1024**3))
    loop = asyncio.new_event_loop()
    loop.close()  # the tickets drop their events: this reads the Sequences
    bias = {t: -100.0 for t in sorted(loaded.eos_token_ids)}
    rng = random.Random(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = args.variants.split(",")
    mlx_env = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    print(f"{args.model.name}: attention routed through mlxd in {[m.__name__ for m in routing.modules]}; "
          f"cache limit {args.cache_limit_gib or 'MLX default'} GiB; on thread {threading.current_thread().name}; "
          f"MLX environment {mlx_env or 'none'}", flush=True)
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for i in range(-1, args.runs):
        for n in lengths:
            ids = [rng.randrange(100, loaded.vocab_size - 100) for _ in range(n)]
            for v in variants:
                if v == "gw":
                    assert gateway is not None, "the variant gw needs --gateway"
                    routing.use(True)  # the modules are shared: the engine's routing, as its loader set it
                    r = gateway.run(ids, args.max_tokens, bias)
                else:
                    kind, how = v.split("-")
                    routing.use(how == "routed")
                    r = (raw_run if kind == "raw" else lane_run)(  # type: ignore[operator]
                        loaded, *(() if kind == "raw" else (loop,)), ids, args.max_tokens, bias)
                if i >= 0:
                    rows.setdefault((n, v), []).append(r)
                print(f"  {n} run {i} {v:12s} ttft {r['ttft_ms']:7.1f} ms decode {r['decode_tps']:6.1f} tok/s "
                      f"steps {[round(x, 1) for x in r['steps_ms']]}"
                      + (f" (first token seen on the loop at {r['seen_ms']:.1f} ms)" if "seen_ms" in r else ""), flush=True)
    if gateway is not None:
        gateway.close()
    med = statistics.median
    print("\n| prompt tokens | variant | TTFT ms (median) | decode tok/s (median) | TTFT / raw-plain | decode / raw-plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in lengths:
        base = rows.get((n, "raw-plain"))
        for v in variants:
            rs = rows.get((n, v))
            if not rs:
                continue
            ttft, dec = med(r["ttft_ms"] for r in rs), med(r["decode_tps"] for r in rs)
            rel = (f"{ttft / med(r['ttft_ms'] for r in base):.3f} | {dec / med(r['decode_tps'] for r in base):.3f}"
                   if base else "- | -")
            print(f"| {n} | {v} | {ttft:.1f} | {dec:.1f} | {rel} |")


if __name__ == "__main__":
    main()
