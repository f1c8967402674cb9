#!/usr/bin/env bash
# The GPU figures issues 27 and 29 still lack, in device calls under the 10-minute limit.
# Stage as for h200_round.sh: ../shared/tools/device-mlx prepare, then a tokenizer for the
# random models (SmolLM2's, 49,152 tokens) in .device/tok:
#
#   .venv/bin/python -c 'from pathlib import Path; from mlxd.engine.models.importer import import_default; \
#     print(import_default(Path("/tmp/smol")))'        # then copy its tokenizer*.json and special_tokens_map.json
#   mkdir -p .device/tok && cp /tmp/smol/SmolLM2-135M-Instruct/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} .device/tok/
#
# Run 1: carry [".device/a"], `bash .device/a/stash.sh`. Run 2, right after, carry [".device/b", ".device/tok"]:
#   bash .device/b/install.sh >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/gpu_pending.sh ck8
# Later calls on the same warm machine need only the export.
#
# `ck8` (issue 29, about 6 min): decode with generation checkpoints on (the default, 512) against
#   off, 8 streams of 640 tokens on ~4,500-token prompts, one supervisor at a time, no cut.
# `cut` (issue 29, about 4 min): one stream cut at token 560, resume with and without a checkpoint.
# `json` (issue 27, about 2 min): the lone and 8-stream schema-held JSON workload, n-gram drafts on
#   against off (the lone stream lost 12% on an H100 with 2 drafts in 256 tokens).
# `numerics` (issue 27, about 4 min): does the 8B's one-pass verification pick what its own steps
#   pick (why greedy texts differ with drafts on and off on the GPU)?
# Each step has its own time limit; results go to $OUT (or ./gpu-out), one text file a step.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out" /tmp/models
tok=${TOKDIR:-.device/tok}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "   exit $? after $((SECONDS - t0)) s ($(wc -l < "$out/$name.txt") lines)"
  tail -n 25 "$out/$name.txt"
}
[ -d /tmp/models/l8b ] || python3 benchmarks/random_llama.py 8b-4bit /tmp/models/l8b --tokenizer "$tok" > /dev/null
case ${1:-ck8} in
ck8)
  step ck8 ${LIMIT:-540} python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8b --no-eos \
    --streams 8 --max-tokens 640 --samples 2 --cuts 0 --prompt-words 1500 ;;
cut)
  step cut ${LIMIT:-540} python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8b --no-eos \
    --streams 1 --max-tokens 640 --samples 2 --cut-at 560 --prompt-words 1500 ;;
json)
  step json ${LIMIT:-300} python3 benchmarks/speculative.py --model /tmp/models/l8b --widths 1,8 --rounds 2 \
    --max-tokens 256 --workloads json ;;
numerics)
  step numerics ${LIMIT:-300} python3 benchmarks/draft_agreement.py --model /tmp/models/l8b --draft /tmp/models/l8b \
    --tokens 256 ;;
*)
  echo "usage: $0 ck8|cut|json|numerics" >&2
  exit 2 ;;
esac
