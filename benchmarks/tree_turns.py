"""Two trees of mlxd, the same benchmark, taking turns: before and after a change, in one run.

Runs `benchmarks/SCRIPT ARGS...` from the base tree and from this one alternately (which goes
first alternates too), each with PYTHONPATH at its own tree so every process it starts imports
that tree's mlxd, and prints each figure's median per tree and their ratio. SCRIPT must print
its summary as JSON on stdout, or write it to a file named by one of its options
(`--json-flag=--json`).

  git worktree add /tmp/base ee5c246
  python benchmarks/tree_turns.py --base /tmp/base --turns 3 \
      --keys decode_ratio.anthropic,decode_ratio.responses,added_ttft_ms_p50.anthropic api_overhead.py --rounds 20
  python benchmarks/tree_turns.py --base /tmp/base --turns 3 --json-flag=--json \
      --keys delivery_ratio,ttft_added_ms,conc_delivery_ratio proxy_overhead.py --runs 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def flatten(data: Any, prefix: str = "") -> dict[str, float]:
    """Every number in a JSON value, by its dotted path."""
    if isinstance(data, dict):
        out: dict[str, float] = {}
        for key, value in data.items():
            out |= flatten(value, f"{prefix}{key}.")
        return out
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return {prefix.rstrip("."): float(data)}
    return {}


def run_once(tree: Path, script: str, args: list[str], json_flag: str | None) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as tmp:
        extra = [json_flag, str(Path(tmp) / "out.json")] if json_flag else []
        done = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args, *extra], env=env,
                              cwd=tree, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{tree}: {script} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        text = (Path(tmp) / "out.json").read_text() if json_flag else done.stdout
    return flatten(json.loads(text[text.index("{"):]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the other tree (a git worktree of the commit before)")
    p.add_argument("--turns", type=int, default=3, help="runs per tree")
    p.add_argument("--keys", default="", help="comma-separated figures to show (default: all)")
    p.add_argument("--json-flag", help="the script's option for a JSON summary file (default: JSON on stdout)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    trees = {"before": a.base.resolve(), "after": HERE}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for turn in range(a.turns):
        order = ["before", "after"] if turn % 2 == 0 else ["after", "before"]
        for name in order:
            runs[name].append(run_once(trees[name], a.script, a.args, a.json_flag))
            print(f"turn {turn + 1}, {name}: done", file=sys.stderr, flush=True)
    keys = [k for k in a.keys.split(",") if k] or sorted(runs["after"][0])
    print(f"{'figure':40s} {'before':>12s} {'after':>12s} {'after/before':>12s}   (medians of {a.turns} runs each)")
    for key in keys:
        before = statistics.median(r[key] for r in runs["before"])
        after = statistics.median(r[key] for r in runs["after"])
        ratio = after / before if before else float("nan")
        print(f"{key:40s} {before:12.4f} {after:12.4f} {ratio:12.4f}")
        print(f"{'':40s} each: {[round(r[key], 4) for r in runs['before']]} | {[round(r[key], 4) for r in runs['after']]}")


if __name__ == "__main__":
    main()
