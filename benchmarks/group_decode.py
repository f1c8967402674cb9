"""An engine group against one engine (issue 30): what splitting a model over ranks on this
machine costs (or gains) a token.

Starts one engine and a group of `--ranks` engines (mx.distributed's ring backend on localhost,
or `--backend nccl`), both at `--batch` (default: mlxd's, auto) and otherwise mlxd's defaults
for a group (the one engine too: no warm-up, width probe or SSD tier), on the same model. Rounds alternate which goes first; each sends a lone greedy stream, then
`--streams` at once, and reads each engine's own decode timing (/admin/stats' last request)
for the lone one and the streams' wall time for the rest. Prints the medians, their ratio and
the milliseconds a group adds to a lone stream's token.

  python benchmarks/group_decode.py                                # the tiny random llama, 2 ranks
  python benchmarks/group_decode.py --model smollm2 --mode pipeline  # SmolLM2's 30 layers, 15 a rank
  python benchmarks/group_decode.py --ranks 1                      # the group machinery alone
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model dir, or `smollm2` (default: the tiny random llama, built here)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mode", choices=("tensor", "pipeline"), default="tensor")
    p.add_argument("--backend", choices=("ring", "nccl"), default="ring")
    p.add_argument("--rounds", type=int, default=5, help="the first warms up and is not counted")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--batch", default="auto", help="both engines' --batch (default: mlxd's)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from mlxd.engine.models.random_model import build_random_llama
    from mlxd.protocol.group import GroupSpec, free_port, rank_env, write_hostfile
    from tests.support import EngineProcess, engine_env, private_socket_dir, running_engine

    @contextlib.contextmanager
    def group(model: Path) -> Iterator[EngineProcess]:
        where = private_socket_dir()
        spec = GroupSpec(ranks=args.ranks, backend=args.backend, mode=args.mode)
        write_hostfile(where / "hosts.json", args.ranks)
        port = free_port()
        ranks = [EngineProcess(model, "m", "--batch", args.batch, *spec.flags(str(where / "ctl.sock")), socket_dir=where,
                               env=engine_env(**rank_env(spec, where / "hosts.json", port, r)))
                 for r in range(args.ranks)]
        try:
            yield ranks[0].wait_ready(120)
        finally:
            for rank in ranks:
                rank.stop()

    with tempfile.TemporaryDirectory(prefix="mxg-") as tmp:
        if args.model == "smollm2":
            from mlxd.engine.models.importer import import_default

            model = import_default(Path(tmp))
        else:
            model = Path(args.model) if args.model else build_random_llama(Path(tmp) / "tiny", context=4096)
        body: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": 0, "logit_bias": {"2": -100}}

        def lone(engine: EngineProcess, r: int) -> float:
            engine.client.post("/v1/chat/completions", json={
                **body, "messages": [{"role": "user", "content": f"Round {r}: tell me about the sea."}]})
            last = engine.client.get("/admin/stats").json()["last"]
            return float(last["completion_tokens"] - 1) / (last["timings_ms"]["decode"] / 1000)

        def together(engine: EngineProcess, r: int) -> float:
            started = time.perf_counter()
            with ThreadPoolExecutor(args.streams) as pool:
                answers = list(pool.map(lambda i: engine.client.post("/v1/chat/completions", json={
                    **body, "messages": [{"role": "user", "content": f"Round {r}, stream {i}."}]}).json(),
                    range(args.streams)))
            return sum(a["usage"]["completion_tokens"] for a in answers) / (time.perf_counter() - started)

        rates: dict[str, dict[str, list[float]]] = {k: {"lone": [], "together": []} for k in ("one", "group")}
        with running_engine(model, "m", "--batch", args.batch, "--warmup", "off", "--width-probe", "off",
                            "--ssd-cache-bytes", "0") as one, group(model) as grouped:
            engines = {"one": one, "group": grouped}
            for r in range(args.rounds):
                for name in (("one", "group") if r % 2 == 0 else ("group", "one")):
                    a, b = lone(engines[name], r), together(engines[name], r)
                    print(f"round {r} {name}: lone {a:.1f} tok/s, {args.streams} streams {b:.1f} tok/s", flush=True)
                    if r:
                        rates[name]["lone"].append(a)
                        rates[name]["together"].append(b)
        med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in rates.items()}
        print(json.dumps({
            "model": str(args.model or "tiny"), "ranks": args.ranks, "mode": args.mode, "backend": args.backend,
            "one": med["one"], "group": med["group"],
            "lone_group_over_one": round(med["group"]["lone"] / med["one"]["lone"], 3),
            "streams_group_over_one": round(med["group"]["together"] / med["one"]["together"], 3),
            "ms_added_a_token_lone": round(1000 / med["group"]["lone"] - 1000 / med["one"]["lone"], 2),
        }, indent=2))


if __name__ == "__main__":
    main()
