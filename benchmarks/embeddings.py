"""Embeddings through mlxd against the same model run directly, in one run (issue 28).

The figure: texts per second for a batch of BATCH short texts (one request of 64 by default),
mlxd's `/v1/embeddings` through the supervisor and the engine, against the model run directly
in this process: mlx-embeddings' model class loaded from the same dir, the same tokenizer, one
padded forward of the batch, its vectors read back (target: mlxd at least 0.90 of direct).
mlxd is called as a new user calls it, with the `openai` SDK at its defaults (base64 vectors).
Direct and mlxd take turns, each first in turn; the medians of --rounds rounds are reported,
after warm-up rounds. A second figure: the same texts sent as 8 concurrent requests of 8,
which the engine gathers into shared forwards.

No embedding model's weights can be downloaded here, so the model is a random BERT of
all-MiniLM-L6-v2's shape (384 wide, 6 layers, 12 heads; cost does not depend on the weights),
pooled by its CLS token.

  python benchmarks/embeddings.py
  python benchmarks/embeddings.py --model DIR --rounds 30 --batch 64
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "an", "engine", "serves", "one", "model", "well", "and", "caches", "prompts", "streams", "tokens", "stops", "at", "sequences", "parses", "tools"]


def texts(n: int, round_: int) -> list[str]:
    """`n` short texts (8-16 words), different each round."""
    out = []
    for i in range(n):
        k = 8 + (i * 7 + round_) % 9
        out.append(" ".join(WORDS[(i * 3 + j + round_) % len(WORDS)] for j in range(k)) + f" {round_}.{i}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="an embedding model dir (default: a random MiniLM-shaped BERT)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()

    import mlx.core as mx
    import numpy as np

    from mlxd.engine.embed.model import EmbeddingModel
    from mlxd.engine.models.random_embedder import build_random_bert
    from tests.support import SupervisorProcess

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_random_bert(Path(tmp) / "minilm", hidden_size=384, num_layers=6,
                                                    num_heads=12, intermediate_size=1536, context=512)
        here = EmbeddingModel(model_dir, "direct")  # mlx-embeddings' class, the dir's tokenizer

        def direct(batch: list[str]) -> np.ndarray:
            rows = here.tokens.encode(batch)
            width = max(len(r) for r in rows)
            ids = np.zeros((len(rows), width), dtype=np.int32)
            mask = np.zeros((len(rows), width), dtype=np.int32)
            for i, r in enumerate(rows):
                ids[i, : len(r)], mask[i, : len(r)] = r, 1
            out = here.model(mx.array(ids), attention_mask=mx.array(mask))
            return np.array(out.last_hidden_state[:, 0])  # CLS, as the dir's pooling says

        config = f'[models.emb]\npath = "{model_dir}"\n'
        sup = SupervisorProcess(config, Path(tmp) / "data").wait_up()
        client = sup.openai()

        def mlxd(batch: list[str]) -> int:
            return len(client.embeddings.create(model="emb", input=batch).data)

        def mlxd_concurrent(batch: list[str]) -> int:
            parts = [batch[i:i + 8] for i in range(0, len(batch), 8)]
            with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
                return sum(pool.map(mlxd, parts))

        kinds = {"direct": direct, "mlxd": mlxd, "mlxd 8x8": mlxd_concurrent}
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        try:
            for r in range(args.warmup + args.rounds):
                batch = texts(args.batch, r)
                order = list(kinds)[r % 3:] + list(kinds)[: r % 3]
                for kind in order:
                    started = time.perf_counter()
                    kinds[kind](batch)
                    if r >= args.warmup:
                        rates[kind].append(args.batch / (time.perf_counter() - started))
            tokens = sum(len(t) for t in here.tokens.encode(texts(args.batch, 0)))
        finally:
            sup.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"model: {args.model or 'random BERT, all-MiniLM-L6-v2 shape'}; batch {args.batch} texts "
          f"({tokens} tokens in round 0), {args.rounds} rounds")
    print("| path | texts/s (median) | range | / direct |")
    print("| --- | --- | --- | --- |")
    for kind, values in rates.items():
        print(f"| {kind} | {med[kind]:.1f} | {min(values):.1f}-{max(values):.1f} | {med[kind] / med['direct']:.3f} |")


if __name__ == "__main__":
    main()
