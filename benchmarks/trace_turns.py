"""Read an engine's step trace (MLXD_TRACE_STEPS, gpu/trace.py): where each phase's time went.

A benchmark that runs phases with idle gaps between them (speculative.py's off and on phases,
batching.py's rounds) leaves a trace whose turns fall into runs; a gap longer than `--gap-ms`
starts a new one. For each run this prints its turns and time, then the batch lane's turns by
kind, with their count, median length and the median of the batch lane's generator step
(`next_ms`; the rest of a turn is mlxd's own work around it, ended rows' removal included):

- plain: rows decoding, no draft checked, none ended;
- pass: a verification pass checked drafts (`passes`);
- idle read: the rows' tokens were read for drafts and none were checked;
- ended: rows ended in the turn (`ended`), no pass;
- after ended: a plain turn right after one that ended rows while others went on (MLX is lazy:
  mlx-lm's gather of the remaining rows' KV runs in this turn's step);
- after pass: a plain turn right after a pass (whose wait for the rows' tokens broke the
  pipelining of one step ahead);
- prefill: rows still without their first token.

    python benchmarks/trace_turns.py steps.jsonl [--gap-ms 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def runs_of(turns: list[dict[str, Any]], gap_ms: float) -> list[list[dict[str, Any]]]:
    runs: list[list[dict[str, Any]]] = [[]]
    for turn in turns:
        last = runs[-1][-1] if runs[-1] else None
        if last is not None and turn["t"] - (last["t"] + last["ms"]) > gap_ms:
            runs.append([])
        runs[-1].append(turn)
    return [r for r in runs if r]


def kind(turn: dict[str, Any], before: dict[str, Any] | None) -> str:
    if turn.get("prefilling"):
        return "prefill"
    if turn.get("passes"):
        return "pass"
    if turn.get("idle_reads"):
        return "idle read"
    if turn.get("ended"):
        return "ended"
    if before is not None and before.get("ended") and before.get("batch"):
        return "after ended"
    if before is not None and before.get("passes"):
        return "after pass"
    return "plain" if "next_ms" in turn else "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--gap-ms", type=float, default=500.0, help="an idle gap this long starts a new run")
    args = p.parse_args()
    turns = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    for i, run in enumerate(runs_of(turns, args.gap_ms)):
        span = run[-1]["t"] + run[-1]["ms"] - run[0]["t"]
        busy = sum(t["ms"] for t in run)
        print(f"run {i}: {len(run)} turns over {span:.0f} ms ({busy:.0f} ms in turns), most rows "
              f"{max(t.get('batch', 0) for t in run)}, passes {sum(t.get('passes', 0) for t in run)}, "
              f"ended {sum(t.get('ended', 0) for t in run)}, lingered {sum(t.get('lingered', 0) for t in run)}")
        if highest := sorted((t for t in run if "peak_mb" in t), key=lambda t: -t["peak_mb"])[:3]:
            print("  the turns with MLX's highest peak: " + "; ".join(
                f"{t['peak_mb'] / 1000:.2f} GB at {t['t']:.0f} ms ({t['ms']:.0f} ms, admitted {t.get('admitted', 0)}, "
                f"prefilling {t.get('prefilling', 0)}, batch {t.get('batch', 0)}, ended {t.get('ended', 0)})"
                for t in highest))
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for before, t in zip([None, *run], run, strict=False):
            by_kind.setdefault(kind(t, before), []).append(t)
        for name in ("plain", "pass", "after pass", "idle read", "ended", "after ended", "prefill", "other"):
            if not (sel := by_kind.get(name)):
                continue

            def med(key: str, sel: list[dict[str, Any]] = sel) -> float:
                return statistics.median(t.get(key, 0.0) for t in sel)

            print(f"  {name:11s} {len(sel):4d} turns, {sum(t['ms'] for t in sel):7.0f} ms: median {med('ms'):6.2f} ms "
                  f"(next {med('next_ms'):6.2f})")
            if name in ("pass", "after pass", "ended", "after ended"):  # few: each one's ms (and rows)
                print("    " + ", ".join(f"{t['ms']:.1f}/{t.get('batch', 0)}" for t in sel[:40]))


if __name__ == "__main__":
    main()
