"""Where a held row's decode time goes: the grammar mask measured in one process, no HTTP.

  * matcher: llguidance's consume_tokens + compute_bitmask per step (host), replayed over the
    tokens of a held generation;
  * mask ops: the mask built from that bitmask and applied to a logits row, evaluated; and
    the same from a bitmask already on the device (DeviceWords);
  * serial: mlx-lm's generate_step with mlxd's sampling, free against held to a JSON schema
    (alternating, medians), held also without read_early's queueing (`grammar.EARLY_READ`);
  * batch: mlx-lm's BatchGenerator as the batch lane builds it, `--rows` rows, none held
    against half held, the held rows masked in the lane's one-op step (batch_bias.py), again
    without read_early's queueing, and row by row by mlx-lm's own path.

The schema is structured.py's (a string of at least 4000 characters), so a held reply is not
complete within the tokens decoded and both decode the same count.

  python benchmarks/grammar_step.py /tmp/models/l1b
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from structured import FORMAT  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rows", type=int, default=8)
    a = p.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator, generate_step

    from mlxd.engine.chat import grammar
    from mlxd.engine.chat.grammar import Grammars, apply_words, response_format_grammar
    from mlxd.engine.gpu import decode_attention
    from mlxd.engine.gpu.batch_bias import batch_bias
    from mlxd.engine.gpu.job import SamplingParams
    from mlxd.engine.gpu.sampling import make_sampling

    model, tok = load(a.model)
    eos = sorted(tok.eos_token_ids)
    grammars = Grammars(tok._tokenizer, eos)
    text = response_format_grammar(FORMAT)
    assert text is not None
    params = SamplingParams(temperature=0.0, logit_bias={t: -100.0 for t in eos})
    prompt = tok.encode("Write a long story about a lighthouse keeper, as JSON with a title and the story.")
    out: dict[str, Any] = {"model": Path(a.model).name, "vocab": model.args.vocab_size}

    def serial(held: bool) -> tuple[float, list[int]]:
        sampler, procs = make_sampling(params, [], grammars.matcher(text, "x") if held else None, eos)
        tokens: list[int] = []
        started = 0.0
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=a.tokens, sampler=sampler,
                                      logits_processors=procs):
            tokens.append(int(token))
            if len(tokens) == 2:
                started = time.perf_counter()
        return (len(tokens) - 2) / (time.perf_counter() - started), tokens

    serial(False)
    _, held_tokens = serial(True)  # warm-up, and the tokens the matcher replays

    m = grammars.matcher(text, "x")
    bitmask_s, words = [], []
    for t in held_tokens:
        started = time.perf_counter()
        w = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        m.consume_tokens([t])
        bitmask_s.append(time.perf_counter() - started)
        words.append(w)
    out["matcher_ms"] = round(statistics.median(bitmask_s) * 1000, 4)

    vocab = model.args.vocab_size
    logits = mx.random.normal((1, vocab))
    mx.eval(logits)
    ops_s = []
    for w in words[:50]:
        started = time.perf_counter()
        mx.eval(apply_words(logits, mx.array(np.resize(w, -(-vocab // 32)))[None]))
        ops_s.append(time.perf_counter() - started)
    out["mask_ops_ms"] = round(statistics.median(ops_s) * 1000, 4)
    on_device = mx.array(np.resize(words[-1], -(-vocab // 32)))[None]
    mx.eval(on_device)
    ops_s = []
    for _ in range(50):
        started = time.perf_counter()
        mx.eval(apply_words(logits, on_device))
        ops_s.append(time.perf_counter() - started)
    out["mask_ops_on_device_ms"] = round(statistics.median(ops_s) * 1000, 4)

    runs: dict[str, list[float]] = {"free": [], "held": [], "held_late_read": []}
    for _ in range(a.runs):
        runs["free"].append(serial(False)[0])
        runs["held"].append(serial(True)[0])
        grammar.EARLY_READ = False
        runs["held_late_read"].append(serial(True)[0])
        grammar.EARLY_READ = True
    med = {k: statistics.median(v) for k, v in runs.items()}
    out["serial_tps"] = {k: round(v, 1) for k, v in med.items()}
    out["serial_ratio"] = round(med["held"] / med["free"], 3)
    out["serial_ratio_late_read"] = round(med["held_late_read"] / med["free"], 3)

    if decode_attention.enabled():
        decode_attention.install(model)

    def batch(held_rows: int, one_op: bool = True) -> float:
        gen = BatchGenerator(model, completion_batch_size=a.rows, prefill_batch_size=a.rows)
        if one_op:
            batch_bias(gen)
        samplers, procs = [], []
        for i in range(a.rows):
            s, pr = make_sampling(params, [], grammars.matcher(text, "x") if i < held_rows else None, eos)
            samplers.append(s)
            procs.append(pr)
        gen.insert([[*prompt, i + 10] for i in range(a.rows)], max_tokens=[a.tokens] * a.rows,
                   samplers=samplers, logits_processors=procs)
        total, started, live = 0, None, a.rows
        while live:
            _, responses = gen.next()
            if not responses:
                continue
            if started is None:  # timed from the first decoded tokens
                started = time.perf_counter()
                continue
            total += len(responses)
            live -= sum(r.finish_reason is not None for r in responses)
        assert started is not None
        return total / (time.perf_counter() - started)

    batch(a.rows // 2)
    brun: dict[str, list[float]] = {"free": [], "half_held": [], "half_held_late_read": [], "half_held_row_by_row": []}
    for _ in range(a.runs):
        brun["free"].append(batch(0))
        brun["half_held"].append(batch(a.rows // 2))
        grammar.EARLY_READ = False
        brun["half_held_late_read"].append(batch(a.rows // 2))
        grammar.EARLY_READ = True
        brun["half_held_row_by_row"].append(batch(a.rows // 2, one_op=False))
    bmed = {k: statistics.median(v) for k, v in brun.items()}
    out["batch_tps"] = {k: round(v, 1) for k, v in bmed.items()}
    out["batch_ratio"] = round(bmed["half_held"] / bmed["free"], 3)
    out["batch_ratio_late_read"] = round(bmed["half_held_late_read"] / bmed["free"], 3)
    out["batch_ratio_row_by_row"] = round(bmed["half_held_row_by_row"] / bmed["free"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
