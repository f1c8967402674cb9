"""Fuzz a real supervisor from its own OpenAPI document: thousands of generated requests.

The fuzzer of tests/integration/test_fuzz.py (schemathesis on mlxd/supervisor/http/openapi.py's
document, valid and invalid requests for every route, some aimed at the real model, short
leases) runs against `mlxd serve` with one engine on a tiny random-weight model (context 128,
so generations stay short). The figure: requests sent, and how many answers were 500 or more,
undocumented, off-schema, or not OpenAI error JSON. Each such answer is printed with a curl
command that repeats it; the exit code is 1 when there is any.

  python benchmarks/fuzz.py [--examples 5000] [--seed 0] [--concurrency 1] [--model DIR]

With `--concurrency N`, N requests are in flight at once, so that unloads, drains and leases
land while requests run. A request that times out, or waits out the model queue, stops the run
(every later request would wait out its timeout too).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration.test_fuzz import Fuzzer, Tally, fuzz_config  # noqa: E402  (after the sys.path line)
from tests.support import SupervisorProcess  # noqa: E402


def status_table(tally: Tally) -> str:
    """Status counts per route, then the totals."""
    columns = sorted({s for counts in tally.statuses.values() for s in counts}, key=lambda s: (not s.isdigit(), s))
    rows = [(route, counts) for route, counts in sorted(tally.statuses.items())]
    rows.append(("total", sum((c for _, c in rows), Counter())))
    width = max(len(route) for route, _ in rows)
    lines = [f"{'route':<{width}}  {'sent':>5}  " + "  ".join(f"{c:>5}" for c in columns)]
    for route, counts in rows:
        cells = "  ".join(f"{counts.get(c, 0) or '':>5}" for c in columns)
        lines.append(f"{route:<{width}}  {sum(counts.values()):>5}  {cells}")
    return "\n".join(lines)


def findings_report(tally: Tally, limit: int = 20) -> str:
    """The distinct problems found, each with one command that repeats it."""
    seen: dict[tuple[str, str], int] = Counter()
    lines = []
    for f in tally.findings:
        key = (f.route, f.problem.splitlines()[0][:120] if f.problem else "")
        seen[key] += 1
        if seen[key] == 1 and len(lines) < limit:
            lines.append(f"- {f.route} -> {f.status}: {f.problem[:600]}\n    {f.repro[:2000]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=5000, help="generated requests to send")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--model", type=Path, help="an MLX model dir (default: a tiny random llama)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxd-fuzz-") as work:
        model = args.model
        if model is None:
            from mlxd.engine.models.random_model import build_random_llama

            model = build_random_llama(Path(work) / "tiny", context=4096)
        sup = SupervisorProcess(fuzz_config(model), Path(work) / "data", env={"HF_HUB_OFFLINE": "1"}).wait_up()
        fuzzer = Fuzzer(sup.url)
        started = time.monotonic()
        try:
            tally = fuzzer.run(args.examples, args.seed, args.concurrency)
        finally:
            fuzzer.close()
            sup.stop()
        took = time.monotonic() - started
    print(f"{tally.num_sent} requests in {took:.0f} s ({tally.num_sent / took:.0f}/s), seed {args.seed}, "
          f"concurrency {args.concurrency}{'; STALLED, stopped early' if tally.stalled else ''}\n")
    print(status_table(tally))
    print(f"\nanswers >= 500 (or none at all): {tally.num_server_errors()}; findings in all: {len(tally.findings)}")
    if tally.findings:
        print(findings_report(tally))
    return 1 if tally.findings else 0


if __name__ == "__main__":
    sys.exit(main())
