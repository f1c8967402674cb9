"""The Responses store's latency with many responses stored (issue 13).

Fills a fresh store with `--rows` responses (each turn about 2 KB of JSON, in chains of
`--chain` turns, as agents make them), then times, on top of that:
  * a write: one more turn, committed (WAL, synchronous=NORMAL), expiry and cap checks included;
  * a chain lookup: every turn of a `--chain`-turn conversation, from its last response back;
  * a single get.
p50 and p99 over `--samples` of each, in milliseconds.

  python benchmarks/response_store.py --rows 100000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pct(values: list[float], q: float) -> float:
    return round(statistics.quantiles(values, n=100)[int(q) - 1] * 1000, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--chain", type=int, default=10)
    p.add_argument("--samples", type=int, default=2000)
    a = p.parse_args()

    from mlxd.supervisor.response_store import ResponseStore

    text = "word " * 150
    message = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    with tempfile.TemporaryDirectory() as tmp:
        store = ResponseStore(Path(tmp) / "r.sqlite3", cap_bytes=10**12)
        started = time.perf_counter()
        store._db.execute("BEGIN")  # the fill in one transaction; the timed writes each commit
        for i in range(a.rows):
            prev = f"resp_{i - 1}" if i % a.chain else None
            store._db.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (f"resp_{i}", prev, "m", time.time(), time.time(), time.time() + 1e9, 2100,
                 json.dumps([message]).encode(), json.dumps([answer]).encode(), b'{"id": "x"}'),
            )
        store._db.execute("COMMIT")
        fill_s = time.perf_counter() - started
        store = ResponseStore(Path(tmp) / "r.sqlite3", cap_bytes=10**12)
        writes, chains, gets = [], [], []
        for i in range(a.samples):
            started = time.perf_counter()
            store.put(f"new_{i}", f"resp_{i * a.chain + a.chain - 1}", "m", [message], [answer], {"id": f"new_{i}"})
            writes.append(time.perf_counter() - started)
            last = f"resp_{(i * 7919 % (a.rows // a.chain)) * a.chain + a.chain - 1}"
            started = time.perf_counter()
            turns = store.chain(last)
            chains.append(time.perf_counter() - started)
            assert len(turns) == a.chain
            started = time.perf_counter()
            assert store.get(f"resp_{i * 104729 % a.rows}") is not None
            gets.append(time.perf_counter() - started)
        out = {
            "rows": a.rows, "chain": a.chain, "samples": a.samples, "fill_s": round(fill_s, 1),
            "file_mb": round((Path(tmp) / "r.sqlite3").stat().st_size / 1e6, 1),
            "write_ms": {"p50": pct(writes, 50), "p99": pct(writes, 99)},
            "chain_lookup_ms": {"p50": pct(chains, 50), "p99": pct(chains, 99)},
            "get_ms": {"p50": pct(gets, 50), "p99": pct(gets, 99)},
        }
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
