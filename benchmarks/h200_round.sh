#!/usr/bin/env bash
# One round of issue 10's GPU figures in one device call (under the 10-minute limit), after
# ../shared/tools/device-mlx prepare and the stash run (see docs/benchmarks.md):
#
#   bash .device/b/install.sh >/dev/null && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/h200_round.sh
#
# Each step has its own time limit; results go to $OUT (or ./h200-out) as one text file a step.
set -u
out=${OUT:-h200-out}
mkdir -p "$out" /tmp/models
tok=${TOKDIR:-.device/tok}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "   exit $? ($(wc -l < "$out/$name.txt") lines)"
  tail -n 12 "$out/$name.txt"
}
[ -d /tmp/models/l1b ] || python3 benchmarks/random_llama.py 1b-bf16 /tmp/models/l1b --tokenizer "$tok" > /dev/null
step masked_attention 60 python3 benchmarks/masked_decode_attention.py
step batching_1b 150 python3 benchmarks/batching.py --model /tmp/models/l1b --widths 1,8,16 --rounds 3 --batch 16 \
  --only server,mlxd --logs "$out/logs_1b"
step fair_prefill 120 python3 benchmarks/fair_prefill.py --model /tmp/models/l1b --streams 8 --batch 16 \
  --long-tokens 8000 --compare-step 8192
[ -d /tmp/models/l8q ] || python3 benchmarks/random_llama.py 8b-4bit /tmp/models/l8q --tokenizer "$tok" > /dev/null
step batching_8b4 200 python3 benchmarks/batching.py --model /tmp/models/l8q --widths 1,8,16 --rounds 2 --batch 16 \
  --only server,mlxd
