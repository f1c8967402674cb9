"""A lone row held to a JSON schema, drafting on against off, where drafts are rare (issue 27).

On the H100 a lone schema-held stream decoded 12% slower with n-gram drafts on while it
drafted 2 tokens in 256 (docs/benchmarks.md): the cost of drafting machinery that finds
nothing. This reproduces that shape without a GPU: one engine (`--draft ngram`), a model whose
sampled text repeats little (the tiny random llama, built here, or `--model`), seeded sampling
at `--temperature` under the speculative benchmark's order schema, and the same request with
`"speculation": false` beside it. Rounds alternate which goes first; each reads the engine's
own decode timing from /admin/stats. Prints each request, then the medians and their ratio.

  python benchmarks/spec_held_row.py --rounds 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a model dir (default: the tiny random llama, built here)")
    p.add_argument("--rounds", type=int, default=8, help="pairs; the first warms up and is not counted")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=1.0)
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be at least 2")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from speculative import ORDER_SCHEMA

    from mlxd.engine.models.random_model import build_random_llama
    from tests.support import engine_client, running_engine

    with tempfile.TemporaryDirectory(prefix="mxh-") as tmp:
        model = args.model or build_random_llama(Path(tmp) / "tiny", context=4096)
        rates: dict[bool, list[float]] = {True: [], False: []}
        drafted = [0, 0]
        with running_engine(model, "m", "--draft", "ngram") as engine:
            for r in range(args.rounds):
                for spec in ((True, False) if r % 2 else (False, True)):
                    body = {"messages": [{"role": "user", "content": f"Round {r}: list some orders as JSON."}],
                            "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": 5 + r,
                            "speculation": spec, "response_format": {
                                "type": "json_schema", "json_schema": {"name": "orders", "schema": ORDER_SCHEMA}}}
                    with engine_client(engine) as c:
                        answer = c.post("/v1/chat/completions", json=body).json()
                        last = c.get("/admin/stats").json()["last"]
                    tps = last["completion_tokens"] / (last["timings_ms"]["decode"] / 1000)
                    counts = answer["usage"].get("speculation") or {}
                    if r:
                        rates[spec].append(tps)
                        drafted[0] += counts.get("proposed", 0)
                        drafted[1] += counts.get("accepted", 0)
                    print(f"round {r} drafts {'on' if spec else 'off'}: {tps:.1f} tok/s, {last['completion_tokens']} "
                          f"tokens, drafts {counts or '-'}{'' if r else ' (warm-up)'}", file=sys.stderr)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(json.dumps({"model": str(args.model or "tiny random llama"), "rounds": args.rounds - 1,
                      "tps_on": round(on, 1), "tps_off": round(off, 1), "on_over_off": round(on / off, 3),
                      "proposed": drafted[0], "accepted": drafted[1]}, indent=2))


if __name__ == "__main__":
    main()
