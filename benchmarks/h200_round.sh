#!/usr/bin/env bash
# Issue 10's GPU figures in device calls under the 10-minute limit, after
# ../shared/tools/device-mlx prepare and the stash run (see docs/benchmarks.md):
#
#   bash .device/b/install.sh >/dev/null && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/h200_round.sh 1b
#   export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/h200_round.sh 8b      # next call, same warm machine
#
# `1b`: the fused decode attention's check and timings, where a batched step goes, and
# batching.py at 1, 8 and 16 streams on the 1B-shaped bf16 model (with a step trace of mlxd's
# engine), and its lone stream against raw stream_generate. `8b`: the same on the 8B-shaped
# 4-bit model, and a py-spy profile of the engine's GPU thread at 8 streams. `streams`: only
# batching.py at 8 and 16 streams on both models, each warmed up with full-length replies
# (without a 1-stream phase first, mlx_lm.server met its first shapes in its measured rounds). `close`: the
# lone 1B stream and the 1B batching run, twice over. `lone`: the lone 1B stream pinned to
# two CPU sets, then unpinned. `close8b`: the 8B batching run
# at 1, 8 and 16 streams. CLOSE_SHORT=1 makes `close` a 1B batching run and a 41-run lone stream. `cache`: issue 11's
# prompt_cache.py on the 8B-shaped model with a 16k-token prefix. `structured`: issue 12's
# structured.py on the 1B-shaped model; `grammar`: grammar_step.py, then structured.py. `prefill`: fair_prefill. `load`: issue 14's
# load_progress.py (mlxd's chunked load against mlx_lm.load, and an engine's load phases) on both.
# `ck8`, `cut`, `json`, `numerics`: what issues 27 and 29 still lack on a GPU (docs/benchmarks.md:
# "Still to measure on a GPU"). `group1`: issue 30's group of one rank against a plain engine.
# `cutck`: that cut with a checkpoint only (no decode turns). `probe29`: checkpoint_copy_probe.py and
# continuation_probe.py (LIMIT, STEPS, ROUNDS, MODES). `pinned29`: pinned_copy.py's check, then the copy
# probe with its `pinned` way (mlxd's on CUDA: a kernel on a side stream copying each block into
# page-locked host memory; `paced` is the way it falls back to).
# `cont29`: continuation_probe.py restoring in the queue and early (STREAMS); with NOCK=1 early with engine B's checkpoints off too, and restore_copy_probe.py. `tail29`: tail_prefill_probe.py. `first29`: first_turns.py. `dq29`: chunk_sweep.py's quantized and dequantized ways (FIRST=1: first_turns.py after). `dense29`: first_turns.py with dense prefill on, then off (GAP=1: then on with no pause between requests; CUT=1: cutck after). `join29`: first_turns.py with the first pass joined, then split (MLXD_JOIN_FIRST_PASS=0). `sweep29`: chunk_sweep.py, then first_turns.py. `restore29`: restore_copy_probe.py, what reading KV restored from SSD costs a continuation's first step.
# `storm8`: resume.py's storm at 8 streams on the 8B model (KILLS, JITTER). `oom`: ck8's out-of-memory again, short, with nvidia-smi's memory every 500 ms (smi.csv).
# `prefillmem`: benchmarks/prefill_memory.py, what the out-of-memory's fix costs a batched prefill.
# `close30` (group1 and ck8) and `close27` (cut, the self-draft and n-gram prose at 8 streams): what
# the open issues still lack, each in one call. `spec27`: the self-draft and n-gram prose at 8
# streams alone, 4 rounds each, with speculative.py's settling between phases (2026-12-06). `spec27why`:
# n-gram prose and edit at 8 streams with the engine's step trace, summed by trace_turns.py.
# `shrink`: shrink_step.py (what a row leaving costs the batch), then spec27why's runs (WARM=1:
# a short run first, for a fresh machine's kernel compiles; ROUNDS, WORKLOADS, LIMIT). The random models need a tokenizer in .device/tok (SmolLM2's:
# copy tokenizer.json, tokenizer_config.json and special_tokens_map.json from the model
# `mlxd import-default` makes) carried with .device/b.
# The device image lacks some of mlxd's dependencies: stage them with the wheels, e.g.
#   ../shared/tools/device-mlx prepare setproctitle==1.3.8 xxhash==4.1.0 llguidance==1.6.1 \
#     prometheus_client==0.26.0 uvloop==0.22.1
# (then copy the tokenizer into .device/tok: prepare empties .device/). install.sh installs
# nothing once /tmp/site/mlx exists: on a machine staged before, `python3 -m pip install
# --no-index --no-deps --target /tmp/site .device/b/NAME*.whl` adds one.
# Each step has its own time limit; results go to $OUT (or ./h200-out) as one text file a step.
set -u
out=${OUT:-h200-out}
mkdir -p "$out" /tmp/models
tok=${TOKDIR:-.device/tok}
pyspy=${PYSPY:-.device/prof/py-spy}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "   exit $? after $((SECONDS - t0)) s ($(wc -l < "$out/$name.txt") lines)"
  tail -n 12 "$out/$name.txt"
}
turns() {  # turns NAME SECONDS [VAR=VALUE ...] [first_turns.py flags]: a fresh engine's first turns, traced
  local name=$1 limit=$2
  shift 2
  local envs=()
  while [ $# -gt 0 ] && [[ $1 == *=* ]]; do envs+=("$1"); shift; done
  step "$name" "$limit" env "${envs[@]}" python3 benchmarks/first_turns.py --model /tmp/models/l8q --trace \
    --rounds "${ROUNDS:-3}" --flags "${FLAGS:---batch auto}" "$@"
}
model() {  # model SHAPE DIR [random_llama.py flags]
  [ -d "$2" ] || python3 benchmarks/random_llama.py "$1" "$2" --tokenizer "$tok" "${@:3}" > /dev/null
}
case ${1:-1b} in
pinned29)  # the engine's copy into page-locked host memory (cache/pinned.py): its check, then the copy probe's ways at 8 streams
  model 8b-4bit /tmp/models/l8q
  step pinned_check 90 python3 benchmarks/pinned_copy.py
  step ckcopy "${LIMIT:-260}" python3 benchmarks/checkpoint_copy_probe.py --model /tmp/models/l8q --rows 8 --prompt 4574 \
    --steps 520 --rounds "${ROUNDS:-2}" --modes "${MODES:-off,pinned,paced,gpu}"
  ;;
close29)  # the copy probe's ways at 8 streams; with CUT=1 the cut with a checkpoint too (2 samples: it needs
  # about 400 s, so `cutck` in a call of its own is the surer way; 240 s printed nothing on 2026-12-07)
  model 8b-4bit /tmp/models/l8q
  step ckcopy 200 python3 benchmarks/checkpoint_copy_probe.py --model /tmp/models/l8q --rows 8 --prompt 4574 \
    --steps 520 --rounds "${ROUNDS:-2}" --modes "${MODES:-off,paced,grouped}"
  [ "${CUT:-0}" = 0 ] || step cutck 240 python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8q --no-eos \
    --streams 1 --max-tokens 640 --samples "${SAMPLES:-2}" --turns 0 --sides with --cut-at 560 --prompt-words 1500
  ;;
probe29)  # issue 29's two short GPU aims, each taken apart: what a checkpoint costs a batch, by mechanism; a fresh engine's continuation
  model 8b-4bit /tmp/models/l8q
  step ckcopy "${LIMIT:-330}" python3 benchmarks/checkpoint_copy_probe.py --model /tmp/models/l8q --rows 8 --prompt 4574 \
    --steps "${STEPS:-520}" --rounds "${ROUNDS:-2}" --modes "${MODES:-off,grouped,paced,gpu}"
  step contprobe 200 python3 benchmarks/continuation_probe.py --model /tmp/models/l8q --prompt-words 1500 --cut-at 560
  step ckcopy128 150 python3 benchmarks/checkpoint_copy_probe.py --model /tmp/models/l8q --rows 8 --prompt 4574 \
    --steps 520 --every 128 --rounds 2 --modes "${MODES128:-off,paced}"
  ;;
1b)
  model 1b-bf16 /tmp/models/l1b
  step masked_attention 90 python3 benchmarks/masked_decode_attention.py --model /tmp/models/l1b
  step decode_step_1b 120 bash -c 'for r in 8 16; do python3 benchmarks/decode_step.py /tmp/models/l1b --rows $r; done'
  export MLXD_TRACE_STEPS="$out/trace_1b.jsonl"
  step batching_1b 200 python3 benchmarks/batching.py --model /tmp/models/l1b --widths 1,8,16 --rounds 3 --batch 16 \
    --only server,mlxd --warmup-tokens 128 --logs "$out/logs_1b"
  unset MLXD_TRACE_STEPS
  step lone_1b 100 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 9 --max-tokens 256 --cold-starts 0
  ;;
8b)
  model 8b-4bit /tmp/models/l8q
  step decode_step_8b4 120 bash -c 'for r in 8 16; do python3 benchmarks/decode_step.py /tmp/models/l8q --rows $r; done'
  export MLXD_TRACE_STEPS="$out/trace_8b4.jsonl"
  step batching_8b4 200 python3 benchmarks/batching.py --model /tmp/models/l8q --widths 1,8,16 --rounds 2 --batch 16 \
    --only server,mlxd --warmup-tokens 128
  unset MLXD_TRACE_STEPS
  [ -x "$pyspy" ] && step profile_8b4 70 python3 benchmarks/profile_step.py /tmp/models/l8q --streams 8 --py-spy "$pyspy"
  ;;
streams)
  model 1b-bf16 /tmp/models/l1b
  export MLXD_TRACE_STEPS="$out/trace_1b.jsonl"
  step batching_1b 200 python3 benchmarks/batching.py --model /tmp/models/l1b --widths 8,16 --rounds 2 --batch 16 \
    --only server,mlxd --warmup-tokens 128
  export MLXD_TRACE_STEPS="$out/trace_8b4.jsonl"
  model 8b-4bit /tmp/models/l8q
  step batching_8b4 240 python3 benchmarks/batching.py --model /tmp/models/l8q --widths 8,16 --rounds 2 --batch 16 \
    --only server,mlxd --warmup-tokens 128
  unset MLXD_TRACE_STEPS
  ;;
close)
  # issue 10's two closing figures, each measured twice: the lone 1B stream against raw
  # stream_generate, and batching.py's 1B run at 1, 8 and 16 streams.
  model 1b-bf16 /tmp/models/l1b
  step lone_1b 130 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 13 --max-tokens 256 --cold-starts 0
  export MLXD_TRACE_STEPS="$out/trace_1b.jsonl"
  step batching_1b 220 python3 benchmarks/batching.py --model /tmp/models/l1b --widths 1,8,16 --rounds 3 --batch 16 \
    --only server,mlxd --warmup-tokens 128
  unset MLXD_TRACE_STEPS
  [ -n "${CLOSE_SHORT:-}" ] && step lone_1b_long 150 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 41 \
    --max-tokens 256 --cold-starts 0
  [ -n "${CLOSE_SHORT:-}" ] && exit 0
  step batching_1b_8 150 python3 benchmarks/batching.py --model /tmp/models/l1b --widths 8 --rounds 3 --batch 16 \
    --only server,mlxd --warmup-tokens 128
  ;;
close8b)
  # the 8B model's batching run with the final code (server warmed up at full length)
  model 8b-4bit /tmp/models/l8q
  step batching_8b4 300 python3 benchmarks/batching.py --model /tmp/models/l8q --widths 1,8,16 --rounds 2 --batch 16 \
    --only server,mlxd --warmup-tokens 128
  ;;
lone)
  # the lone 1B stream with raw and engine pinned to the same CPUs, on two CPU sets, then unpinned
  model 1b-bf16 /tmp/models/l1b
  step cpus 10 bash -c 'nproc; lscpu | grep -i -E "model name|numa|thread|socket|mhz"'
  step lone_1b_a 150 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 11 --max-tokens 256 --cold-starts 0 --cpus 2-5
  step lone_1b_b 120 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 11 --max-tokens 256 --cold-starts 0 --cpus 10-13
  step lone_1b_c 120 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 11 --max-tokens 256 --cold-starts 0
  ;;
cache)
  # issue 11: the prompt cache's figures on the 8B-shaped 4-bit model with a 16k-token prefix
  # (TTFT, decode during write-behind and KV quantization first; then alternating clients and drain).
  # CACHE_PARTS=main runs only the first; the KV quantization uses the first bits/group size
  # that kv_quant_probe.py finds working at every shape (MLX's CUDA backend lacks some).
  t0=$SECONDS; model 8b-4bit /tmp/models/l8q; echo "model ready after $((SECONDS - t0)) s"
  step kv_quant_probe 40 python3 benchmarks/kv_quant_probe.py
  kvq="--kv-bits 8 --kv-group-size 64"
  for bg in "8 64" "8 32" "8 128" "4 64" "4 32" "4 128"; do
    set -- $bg
    if [ "$(grep -c "bits $1 group *$2 .*: ok" "$out/kv_quant_probe.txt")" = 3 ]; then kvq="--kv-bits $1 --kv-group-size $2"; break; fi
  done
  echo "kv quantization: $kvq"
  MLXD_BENCH_DIR=/tmp step prompt_cache 480 python3 benchmarks/prompt_cache.py --model /tmp/models/l8q \
    --prefix-tokens 16000 --runs "${CACHE_RUNS:-2}" --decode-runs 5 $kvq --warmup-tokens 16000 --skip alt,drain --logs "$out/logs_cache"
  [ "${CACHE_PARTS:-all}" = main ] && exit 0
  MLXD_BENCH_DIR=/tmp step prompt_cache_drain 200 python3 benchmarks/prompt_cache.py --model /tmp/models/l8q \
    --alt-tokens 4000 --turns 3 --burst 4 --skip ttft,decode,kv
  ;;
structured)
  # issue 12: JSON-schema-held decode against free decode, one stream and 8 (half held)
  model 1b-bf16 /tmp/models/l1b
  step structured 240 python3 benchmarks/structured.py --model /tmp/models/l1b --runs 5 --rounds 3
  ;;
grammar)
  # issue 12: where a held row's time goes (no HTTP), then structured.py again
  model 1b-bf16 /tmp/models/l1b
  step grammar_step 150 python3 benchmarks/grammar_step.py /tmp/models/l1b --runs 3
  step structured 240 python3 benchmarks/structured.py --model /tmp/models/l1b --runs 5 --rounds 3
  ;;
prefill)
  model 1b-bf16 /tmp/models/l1b
  step fair_prefill 120 python3 benchmarks/fair_prefill.py --model /tmp/models/l1b --streams 8 --batch 16 \
    --long-tokens 8000 --compare-step 8192
  ;;
load)
  model 1b-bf16 /tmp/models/l1b
  step load_1b 200 python3 benchmarks/load_progress.py --model /tmp/models/l1b --rounds 5
  model 8b-4bit /tmp/models/l8q
  step load_8b4 300 python3 benchmarks/load_progress.py --model /tmp/models/l8q --rounds 5
  ;;
auto)
  # issue 24: mlxd at its defaults (batch auto) against mlx_lm.server and raw mlx-lm on the 1B
  # model at 1-64 streams, then mlxd with batch 8 at 1 and 8 streams (what a wide batch costs).
  model 1b-bf16 /tmp/models/l1b
  step auto_1b 330 python3 benchmarks/batching.py --model /tmp/models/l1b --widths 1,8,16,32,64 --rounds 2 \
    --warmup-tokens 128 --logs "$out/logs_auto_1b" --json "$out/auto_1b.json"
  step batch8_1b 150 python3 benchmarks/batching.py --model /tmp/models/l1b --widths 1,8 --rounds 3 --batch 8 \
    --only mlxd --warmup-tokens 128 --logs "$out/logs_b8_1b"
  ;;
lonew)
  # issue 24: the lone 1B stream over the engine's socket (no supervisor) against raw
  # stream_generate, at batch 1, 8 and auto (128 on CUDA): what the width costs a lone request
  model 1b-bf16 /tmp/models/l1b
  for b in 1 8 auto; do
    step lone_b$b 100 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 7 --max-tokens 256 \
      --cold-starts 1 --engine-args "--batch $b"
  done
  ;;
long)
  # issue 24: a lone long prompt (8k, 24k tokens), engine vs raw stream_generate, on the 1B model
  # with a 32k window: at mlxd's defaults, then with 2048-token prefill chunks, then with cuDNN's
  # attention too (what raw mlx-lm runs with)
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step long_1b_default 300 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 3 \
    --engine-args "--batch auto"
  step long_1b_p2048 200 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 3 \
    --engine-args "--prefill-step 2048 --warmup off"
  step long_1b_cudnn 200 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 3 \
    --engine-args "--prefill-step 2048 --warmup off" --engine-env MLX_CUDA_USE_CUDNN_SDPA=1
  ;;
round2)
  # issue 24, after cuDNN's attention came back for long prefill chunks (prefill_attention.py)
  # and 2048-token solo chunks: the long prompt and the lone stream at defaults, then the
  # agent-shaped load against mlx_lm.server
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step long_1b_auto 260 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 3 \
    --engine-args "--batch auto"
  step lone_auto 130 python3 benchmarks/engine_decode.py --model /tmp/models/l1b32 --runs 7 --max-tokens 256 \
    --cold-starts 1 --engine-args "--batch auto"
  step agent_1b 200 python3 benchmarks/agent_load.py --model /tmp/models/l1b32 --clients 8 --turns 3 \
    --system-tokens 3000 --max-tokens 64
  ;;
prio)
  # issue 24: a priority-0 request's TTFT with 64 priority-10 streams running, against idle
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step priority_1b 150 python3 benchmarks/priority_ttft.py --model /tmp/models/l1b32 --background 64 --samples 5
  ;;
batch1b)
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step batching_1b_auto 400 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 1,8,16,64 --rounds 2 \
    --only server,mlxd --warmup-tokens 128
  ;;
lonegraph)
  # issue 24: the lone 1B stream at batch auto, as it is and with room for every CUDA graph the
  # warm-up makes
  model 1b-bf16 /tmp/models/l1b
  step lone_auto 200 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 7 --max-tokens 256 \
    --cold-starts 1 --engine-args "--batch auto"
  MLX_CUDA_GRAPH_CACHE_SIZE=4000 step lone_auto_graphs4000 200 python3 benchmarks/engine_decode.py \
    --model /tmp/models/l1b --runs 7 --max-tokens 256 --cold-starts 1 --engine-args "--batch auto"
  ;;
lonecap)
  # needs a warm-up capped at 8 rows (a one-off patch of warmup.py reading MLXD_WARMUP_ROWS, not in main)
  model 1b-bf16 /tmp/models/l1b
  MLXD_WARMUP_ROWS=8 step lone_auto_warm8 150 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 7 \
    --max-tokens 256 --cold-starts 1 --engine-args "--batch auto"
  ;;
loneauto)
  model 1b-bf16 /tmp/models/l1b
  step lone_auto 200 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 7 --max-tokens 256 \
    --cold-starts 1 --engine-args "--batch auto"
  ;;
lonecause)
  # issue 24: the wide lone stream again, without the warm-up, then without mlxd's decode kernel
  model 1b-bf16 /tmp/models/l1b
  step lone_auto_nowarm 100 python3 benchmarks/engine_decode.py --model /tmp/models/l1b --runs 7 --max-tokens 256 \
    --cold-starts 1 --engine-args "--batch auto --warmup off"
  MLXD_FUSED_DECODE_ATTENTION=0 step lone_auto_nokernel 100 python3 benchmarks/engine_decode.py --model /tmp/models/l1b \
    --runs 7 --max-tokens 256 --cold-starts 1 --engine-args "--batch auto"
  ;;
auto8b)
  # issue 24: the 8B-shaped 4-bit model at 1-32 streams, mlxd at its defaults
  model 8b-4bit /tmp/models/l8q
  step auto_8b 500 python3 benchmarks/batching.py --model /tmp/models/l8q --widths 1,8,16,32 --rounds 1 \
    --only server,mlxd --warmup-tokens 128 --logs "$out/logs_auto_8b" --json "$out/auto_8b.json"
  ;;
r3long)
  # issue 24, third session: the lone long prompt at defaults (width probe, padded last chunk)
  # on the 1B model at 8k and 24k, 24k again at --batch 1 (what auto costs decode), then 64k
  # on a model with a 64k window
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  model 1b-bf16 /tmp/models/l1b64 --context 65536
  step long_1b_auto 200 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 3 \
    --engine-args "--batch auto"
  step long_1b_b1 120 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 24000 --runs 3 \
    --engine-args "--batch 1"
  step long_1b_64k 150 python3 benchmarks/long_prompt.py --model /tmp/models/l1b64 --lengths 64000 --runs 2 \
    --engine-args "--batch auto"
  ;;
r3b8)
  # issue 24, third session: the 8B-shaped 4-bit model's long prompts, then its batching at defaults
  model 8b-4bit /tmp/models/l8q32 --context 32768
  step long_8b_auto 170 python3 benchmarks/long_prompt.py --model /tmp/models/l8q32 --lengths 8000,24000 --runs 2 \
    --engine-args "--batch auto"
  step auto_8b 330 python3 benchmarks/batching.py --model /tmp/models/l8q32 --widths 1,8,16,32 --rounds 1 \
    --only server,mlxd --warmup-tokens 128 --logs "$out/logs_auto_8b" --json "$out/auto_8b.json"
  ;;
r3prio)
  # issue 24, third session: priorities with 64 background streams, the agent-shaped load again
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step priority_1b 220 python3 benchmarks/priority_ttft.py --model /tmp/models/l1b32 --background 64 --samples 5
  step agent_1b 240 python3 benchmarks/agent_load.py --model /tmp/models/l1b32 --clients 8 --turns 3 \
    --system-tokens 3000 --max-tokens 64
  ;;
r3c)
  # issue 24, third session, after the urgent request's serial-lane start and MLX's cache cap:
  # priorities again, the 8B long prompt beside an engine at auto (it ran out of memory before),
  # then the 1B model at 8 and 16 streams
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step priority_1b 200 python3 benchmarks/priority_ttft.py --model /tmp/models/l1b32 --background 64 --samples 5
  model 8b-4bit /tmp/models/l8q32 --context 32768
  step long_8b_auto 230 python3 benchmarks/long_prompt.py --model /tmp/models/l8q32 --lengths 8000,24000 --runs 2 \
    --engine-args "--batch auto"
  step batch_1b 150 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 8,16 --rounds 2 \
    --only server,mlxd --warmup-tokens 128
  ;;
r3d)
  # issue 24, third session: priorities after the urgent request's serial-lane start, then the
  # 1B model at 8 and 16 streams (one short call: the session's device time was nearly spent)
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step priority_1b 200 python3 benchmarks/priority_ttft.py --model /tmp/models/l1b32 --background 64 --samples 5
  step batch_1b 110 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 8,16 --rounds 2 \
    --only server,mlxd --warmup-tokens 128
  ;;
r4)
  # what issue 24 still needs measured on the GPU after the third session: the 8B long prompt
  # beside an engine at auto (MLX's cache capped since), the lone stream at auto against batch 8,
  # and the 1B model at 16 streams against raw BatchGenerator and the server
  model 8b-4bit /tmp/models/l8q32 --context 32768
  step long_8b_auto 260 python3 benchmarks/long_prompt.py --model /tmp/models/l8q32 --lengths 8000,24000 --runs 3 \
    --engine-args "--batch auto"
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  for b in 8 auto; do
    step lone_b$b 100 python3 benchmarks/engine_decode.py --model /tmp/models/l1b32 --runs 7 --max-tokens 256 \
      --cold-starts 0 --engine-args "--batch $b"
  done
  step auto_1b_16 200 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 16 --rounds 3 \
    --warmup-tokens 128
  ;;
r5a)
  # issue 24, fourth session: where a 16-stream step goes on the 1B model (py-spy, every thread and
  # the GIL holder), then the lone long prompt with the engine's turns and raw's chunk times
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step prof_1b_16 200 python3 benchmarks/profile_step.py /tmp/models/l1b32 --streams 16 --py-spy "$pyspy" \
    --keep "$out/prof"
  step long_1b 200 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 5 \
    --max-tokens 256 --trace --engine-args "--batch auto"
  ;;
r5b)
  # issue 24, fourth session: is a batched step's time in MLX's CUDA-graph upkeep? The bare step
  # with CUDA graphs on and off, the engine at 16 streams both ways, and a native profile
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step serial_ab 150 python3 benchmarks/serial_ab.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 4
  step serial_ab_cap 100 python3 benchmarks/serial_ab.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 3 \
    --variants raw-plain,lane-routed --cache-limit-gib 14
  step step16_graphs 120 python3 benchmarks/decode_step.py /tmp/models/l1b32 --rows 16
  MLX_USE_CUDA_GRAPHS=0 step step16_nographs 120 python3 benchmarks/decode_step.py /tmp/models/l1b32 --rows 16
  step prof16_nographs 120 python3 benchmarks/profile_step.py /tmp/models/l1b32 --streams 16 --py-spy "$pyspy" \
    --env MLX_USE_CUDA_GRAPHS=0 --seconds 3
  step prof16_native 120 python3 benchmarks/profile_step.py /tmp/models/l1b32 --streams 16 --py-spy "$pyspy" \
    --native --seconds 3 --keep "$out/native"
  ;;
r5c)
  # issue 24, fourth session: the serial lane on a thread with the engine's MLX settings (what
  # else the engine process differs in), MLX's CUDA graphs off for the lone prompt, and the
  # 1B model at 16 streams with CUDA graphs on and off in mlxd's engines
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  MLX_ENABLE_CACHE_THRASHING_CHECK=0 MLX_CUDA_SDPA_CACHE_SIZE=1024 step serial_thread 75 \
    python3 benchmarks/serial_ab.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 2 --thread \
    --variants raw-plain,lane-routed --cache-limit-gib 14
  MLX_USE_CUDA_GRAPHS=0 step serial_nographs 75 python3 benchmarks/serial_ab.py --model /tmp/models/l1b32 \
    --lengths 8000,24000 --runs 2 --variants raw-plain,lane-routed
  step b16_graphs 250 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 16 --rounds 3 \
    --only server,mlxd --warmup-tokens 128
  step b16_nographs 140 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 16 --rounds 3 \
    --only mlxd --warmup-tokens 128 --mlxd-env MLX_USE_CUDA_GRAPHS=0
  ;;
r6a)
  # issue 24, next: the lone long prompt with the engine's warm-up off and on (what in the engine
  # process costs the lone prompt: serial_ab.py found the lane itself at raw speed), then the
  # lone stream at auto against batch 8, with CUDA graphs off by default since the fourth session
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  for w in off auto; do
    step long_1b_warmup_$w 150 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 8000,24000 \
      --runs 4 --max-tokens 256 --trace --engine-args "--batch auto --warmup $w"
  done
  for b in 8 auto; do
    step lone_b$b 100 python3 benchmarks/engine_decode.py --model /tmp/models/l1b32 --runs 7 --max-tokens 256 \
      --cold-starts 0 --engine-args "--batch $b"
  done
  ;;
r6b)
  # issue 24, next: the 1B model at 1-64 streams against raw and the server with graphs off by
  # default, the 8B model at 16 and 32 streams, and the 8B long prompt beside an engine at auto
  # (MLX's cache capped since the third session: the raw worker ran out of memory before)
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step batch_1b 240 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 1,8,16,64 --rounds 2 \
    --warmup-tokens 128
  model 8b-4bit /tmp/models/l8q32 --context 32768
  step long_8b_auto 300 python3 benchmarks/long_prompt.py --model /tmp/models/l8q32 --lengths 8000,24000 --runs 3 \
    --engine-args "--batch auto"
  ;;
r7a)
  # issue 24, fifth session: where the engine process loses a lone long prompt. serial_ab.py's
  # gw variant runs the engine's whole GPU side (gateway, sizing, probe, warm-up, GC freeze, GPU
  # thread) in one process beside raw stream_generate: with the engine's defaults, then with no
  # warm-up and no probe; then long_prompt.py against the engine process, as before
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step ab_gw_auto 220 python3 benchmarks/serial_ab.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 4 \
    --variants raw-plain,lane-routed,gw --gateway "--batch auto"
  step ab_gw_bare 130 python3 benchmarks/serial_ab.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 4 \
    --variants raw-plain,gw --gateway "--batch auto --warmup off --width-probe off"
  step long_1b 200 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 8000,24000 --runs 4 \
    --trace --engine-args "--batch auto"
  ;;
r7b)
  # issue 24, fifth session: the lone decode's loss (8B 4-bit at 8k: 0.66 of raw in r6b). The
  # engine at its defaults (MLX's CUDA graphs off), then with them on, at a short prompt and 8k
  model 8b-4bit /tmp/models/l8q32 --context 32768
  step dec_8b_default 270 python3 benchmarks/long_prompt.py --model /tmp/models/l8q32 --lengths 200,8000 --runs 3 \
    --max-tokens 200 --engine-args "--batch auto"
  step dec_8b_graphs 200 python3 benchmarks/long_prompt.py --model /tmp/models/l8q32 --lengths 200,8000 --runs 3 \
    --max-tokens 200 --engine-args "--batch auto" --engine-env MLX_USE_CUDA_GRAPHS=1
  ;;
r7c)
  # issue 24, fifth session: the 1B lone stream's decode (0.74 of raw through the supervisor in
  # r6b): the engine at defaults, with CUDA graphs on, and with no warm-up or probe
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step dec_1b_default 200 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200,8000 --runs 3 \
    --max-tokens 256 --engine-args "--batch auto"
  step dec_1b_graphs 120 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200,8000 --runs 3 \
    --max-tokens 256 --engine-args "--batch auto" --engine-env MLX_USE_CUDA_GRAPHS=1
  step dec_1b_bare 100 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200,8000 --runs 3 \
    --max-tokens 256 --engine-args "--batch auto --warmup off --width-probe off"
  ;;
r7d)
  # issue 24, fifth session: where a lone stream's decode goes in the engine (py-spy on every
  # thread and the GIL holder, 1 stream), then the lone stream against raw at 200 and 8k tokens
  # with the engine's step trace kept
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step prof_1b_1 240 python3 benchmarks/profile_step.py /tmp/models/l1b32 --streams 1 --py-spy "$pyspy" \
    --keep "$out/prof1"
  step dec_1b_default 150 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200,8000 --runs 3 \
    --max-tokens 256 --engine-args "--batch auto" --keep-trace "$out/steps_1b.jsonl"
  ;;
r7e)
  # issue 24, fifth session: raw mlx-lm's lone stream with MLX's CUDA graphs on and off, one
  # process each, alternated (what the engine's graphs-off default costs a lone decode)
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step raw_graphs 200 bash -c 'for g in 1 0 1 0 1 0; do MLX_USE_CUDA_GRAPHS=$g python3 benchmarks/raw_decode.py \
    /tmp/models/l1b32 --runs 4; done'
  ;;
r8a)
  # issue 24, next: which of the two leads costs the lone decode. Raw mlx-lm with MLX's CUDA
  # graphs on and off (a process each, alternated), then the engine's lone 200-token stream at
  # its defaults, with no warm-up or probe, and with graphs on and no warm-up
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step raw_graphs 150 bash -c 'for g in 1 0 1 0; do MLX_USE_CUDA_GRAPHS=$g python3 benchmarks/raw_decode.py \
    /tmp/models/l1b32 --runs 4; done'
  step lone_default 150 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200 --runs 5 \
    --max-tokens 256 --engine-args "--batch auto"
  step lone_bare 80 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200 --runs 5 \
    --max-tokens 256 --engine-args "--batch auto --warmup off --width-probe off"
  step lone_bare_graphs 80 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200 --runs 5 \
    --max-tokens 256 --engine-args "--batch auto --warmup off --width-probe off" --engine-env MLX_USE_CUDA_GRAPHS=1
  ;;
r8b)
  # issue 24, next: the lone 200-token stream with the engine's GPU side in raw's process
  # (serial_ab.py --gateway), then the 8B model served at 16 and 32 streams with graphs off
  # (the default) and on
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step ab_lone 120 python3 benchmarks/serial_ab.py --model /tmp/models/l1b32 --lengths 200 --runs 5 --max-tokens 256 \
    --variants raw-plain,lane-routed,gw --gateway "--batch auto"
  model 8b-4bit /tmp/models/l8q32 --context 32768
  step b8_off 240 python3 benchmarks/batching.py --model /tmp/models/l8q32 --widths 16,32 --rounds 1 \
    --only server,mlxd --warmup-tokens 128
  step b8_on 150 python3 benchmarks/batching.py --model /tmp/models/l8q32 --widths 16,32 --rounds 1 \
    --only mlxd --warmup-tokens 128 --mlxd-env MLX_USE_CUDA_GRAPHS=1
  ;;
r9a)
  # issue 24, sixth session: raw mlx-lm's lone decode under each of the engine's MLX settings
  # (graphs on/off, with and without its 100 ops a commit; a process each, two rounds), then
  # the engine's lone stream with graphs on and no warm-up or probe
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step raw_env 330 bash -c 'for r in 1 2; do for e in "MLX_USE_CUDA_GRAPHS=1" "MLX_USE_CUDA_GRAPHS=0" \
    "MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=100" "MLX_USE_CUDA_GRAPHS=1 MLX_MAX_OPS_PER_BUFFER=100"; do \
    env $e python3 benchmarks/raw_decode.py /tmp/models/l1b32 --runs 4; done; done'
  step lone_bare_graphs 100 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200 --runs 5 \
    --max-tokens 256 --engine-args "--batch auto --warmup off --width-probe off" --engine-env MLX_USE_CUDA_GRAPHS=1
  ;;
r9b)
  # the engine's lone stream at its defaults and with no warm-up or probe; the gateway in raw's
  # process
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step lone_default 150 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200 --runs 5 \
    --max-tokens 256 --engine-args "--batch auto"
  step lone_bare 90 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200 --runs 5 \
    --max-tokens 256 --engine-args "--batch auto --warmup off --width-probe off"
  step ab_lone 120 python3 benchmarks/serial_ab.py --model /tmp/models/l1b32 --lengths 200 --runs 5 --max-tokens 256 \
    --variants raw-plain,lane-routed,gw --gateway "--batch auto"
  ;;
r9c)
  # the 1B figures not yet taken under graphs off: 32 streams, priorities, the agent-shaped load
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step b1_32 240 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 32 --rounds 2 \
    --only server,mlxd --warmup-tokens 128
  step priority_1b 160 python3 benchmarks/priority_ttft.py --model /tmp/models/l1b32 --background 64 --samples 5
  step agent_1b 180 python3 benchmarks/agent_load.py --model /tmp/models/l1b32 --clients 8 --turns 3 \
    --system-tokens 3000 --max-tokens 64
  ;;
r9d)
  # the 8B model at 16 and 32 streams against the server, engine graphs off (the default), then on
  model 8b-4bit /tmp/models/l8q32 --context 32768
  step b8_off 300 python3 benchmarks/batching.py --model /tmp/models/l8q32 --widths 16,32 --rounds 1 \
    --only server,mlxd --warmup-tokens 128
  step b8_on 200 python3 benchmarks/batching.py --model /tmp/models/l8q32 --widths 16,32 --rounds 1 \
    --only mlxd --warmup-tokens 128 --mlxd-env MLX_USE_CUDA_GRAPHS=1
  ;;
r10a)
  # issue 24, seventh session: the engine's lone stream with graphs on and off (no warm-up or
  # probe, against raw in each run), then r10c's steps (they failed here, the device then
  # lacking llguidance)
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step lone_graphs 100 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200 --runs 5 \
    --max-tokens 256 --engine-args "--batch auto --warmup off --width-probe off" --engine-env MLX_USE_CUDA_GRAPHS=1
  step lone_nographs 90 python3 benchmarks/long_prompt.py --model /tmp/models/l1b32 --lengths 200 --runs 5 \
    --max-tokens 256 --engine-args "--batch auto --warmup off --width-probe off"
  ;&
r10c)
  # batching.py's mlxd at 1 and 16 streams, graphs on and off
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step b1_on 150 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 1,16 --rounds 1 \
    --only mlxd --warmup-tokens 128 --mlxd-env MLX_USE_CUDA_GRAPHS=1
  step b1_off 150 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 1,16 --rounds 1 \
    --only mlxd --warmup-tokens 128
  ;;
r10d)
  # the engine with graphs on and off alternated, twice, at 1, 16 and 64 streams
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  for v in on1 off1 on2 off2; do
    case $v in on*) e=(--mlxd-env MLX_USE_CUDA_GRAPHS=1) ;; *) e=() ;; esac
    step "g_$v" 200 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 1,16,64 --rounds 2 \
      --only mlxd --warmup-tokens 128 --logs "$out/logs_$v" "${e[@]}"
  done
  ;;
r10e)
  # next: where the engine's lone stream loses raw's gain from CUDA graphs. Every variant in one
  # process with graphs on (serial_ab.py keeps a setting the environment gives): raw mlx-lm
  # plain and through mlxd's attention routing, the serial lane both ways, the whole gateway
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  MLX_USE_CUDA_GRAPHS=1 step ab_graphs 200 python3 benchmarks/serial_ab.py --model /tmp/models/l1b32 \
    --lengths 200 --runs 5 --max-tokens 256 --variants raw-plain,raw-routed,lane-plain,lane-routed,gw \
    --gateway "--batch auto --warmup off --width-probe off"
  MLX_USE_CUDA_GRAPHS=0 step ab_nographs 200 python3 benchmarks/serial_ab.py --model /tmp/models/l1b32 \
    --lengths 200 --runs 5 --max-tokens 256 --variants raw-plain,raw-routed,lane-plain,lane-routed,gw \
    --gateway "--batch auto --warmup off --width-probe off"
  ;;
r11a)
  # issue 24, ninth session: the 8B model at 16 and 32 streams, the server alone (r9d's step ran
  # out of time as the server compiled its kernels); r11b is mlxd at its defaults (graphs off)
  model 8b-4bit /tmp/models/l8q32 --context 32768
  step b8_server 420 python3 benchmarks/batching.py --model /tmp/models/l8q32 --widths 16,32 --rounds 1 \
    --only server --warmup-tokens 128
  ;;
r11b)
  model 8b-4bit /tmp/models/l8q32 --context 32768
  step b8_mlxd 420 python3 benchmarks/batching.py --model /tmp/models/l8q32 --widths 16,32 --rounds 1 \
    --only mlxd --warmup-tokens 128
  ;;
r11c)
  # the engine's MLX operations a commit: its 100 against 20, alternated twice, at 1, 16 and 64
  # streams (raw mlx-lm's lone decode with graphs off ran slower at 100 in r9a)
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  for v in o100a o20a o100b o20b; do
    case $v in o20*) e=(--mlxd-env MLX_MAX_OPS_PER_BUFFER=20) ;; *) e=() ;; esac
    step "ops_$v" 150 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 1,16,64 --rounds 2 \
      --only mlxd --warmup-tokens 128 "${e[@]}"
  done
  ;;
r12a)
  # issue 24, tenth session: CUDA graphs on against off at every width the issue names, with
  # the server in the same call (the targets are ratios to it; raw mlx-lm and the server run
  # with graphs on), and graphs on with 300 operations a commit; alternated
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step g_server 150 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 1,8,16,32,64 --rounds 2 \
    --only server --warmup-tokens 128
  for v in off1 on1 ops1 off2 on2 ops2; do
    case $v in on*) e=(--mlxd-env MLX_USE_CUDA_GRAPHS=1) ;;
      ops*) e=(--mlxd-env MLX_USE_CUDA_GRAPHS=1,MLX_MAX_OPS_PER_BUFFER=300) ;; *) e=() ;; esac
    step "g_$v" 110 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 1,8,16,32,64 --rounds 2 \
      --only mlxd --warmup-tokens 128 "${e[@]}"
  done
  ;;
r13a)
  # issue 24, eleventh session: an 8B engine's start at `batch auto`, spawn to ready, three times
  # on a fresh machine: the first compiles kernels and runs the width probe, the later ones find
  # both remembered (MLX_PTX_CACHE_DIR, the probe's file)
  model 8b-4bit /tmp/models/l8q32 --context 32768
  step starts_8b 560 python3 benchmarks/engine_decode.py --model /tmp/models/l8q32 --engine-args "--batch auto" \
    --cold-starts 3 --runs 3 --max-tokens 128
  ;;
r10b)
  # a trial of the batch lane placing a burst eight at a time (applied to the working tree; not
  # landed: docs/benchmarks.md, "Seventh session"), against the code without it (.device/old:
  # git archive 52bd8a6 mlxd benchmarks pyproject.toml): 64 streams' TTFT and decode
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step b64_new 200 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 64 --rounds 1 \
    --only mlxd --warmup-tokens 128
  step b64_old 200 env PYTHONPATH="/tmp/site:$PWD/.device/old" python3 .device/old/benchmarks/batching.py \
    --model /tmp/models/l1b32 --widths 64 --rounds 1 --only mlxd --warmup-tokens 128
  ;;
r3batch)
  # issue 24, third session: the 1B model at 1-64 streams against both the server and raw
  model 1b-bf16 /tmp/models/l1b32 --context 32768
  step auto_1b 500 python3 benchmarks/batching.py --model /tmp/models/l1b32 --widths 1,8,16,64 --rounds 2 \
    --warmup-tokens 128 --logs "$out/logs_auto_1b" --json "$out/auto_1b.json"
  ;;
ck8)
  # issue 29: decode with generation checkpoints on (the default) against off, one supervisor at a time, no cut
  # (the card's memory sampled every 500 ms beside it: smi.csv). TURNS=1 ROUNDS=2: one engine a side,
  # two counted rounds each (a fresh machine's first engine compiles for about 4 minutes)
  model 8b-4bit /tmp/models/l8q
  nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv -lms 500 > "$out/smi.csv" 2>&1 &
  smi=$!
  step ck8 ${LIMIT:-540} python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8q --no-eos \
    --streams 8 --max-tokens 640 --samples 2 --cuts 0 --turns "${TURNS:-2}" --rounds "${ROUNDS:-1}" \
    --prompt-words 1500 --show-memory
  kill $smi
  echo "== smi at its highest"; sort -t, -k2 -n "$out/smi.csv" | tail -n 2
  ;;
warm8)
  # a fresh machine's first engines compile their kernels (about 4 minutes for the 8B shape): ck8's
  # engines, briefly (64 tokens a stream, one turn each way, no figure), so that ck8 after it on the
  # same machine times decode, not compiles
  model 8b-4bit /tmp/models/l8q
  step warm8 ${LIMIT:-400} python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8q --no-eos \
    --streams 8 --max-tokens 64 --samples 0 --cuts 0 --turns 1 --prompt-words 1500
  ;;
cut)
  # issue 29: one stream cut at token 560, the resume with and without a checkpoint
  model 8b-4bit /tmp/models/l8q
  step cut ${LIMIT:-540} python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8q --no-eos \
    --streams 1 --max-tokens 640 --samples 2 --cut-at 560 --prompt-words 1500
  ;;
cutck)
  # issue 29: the cut at token 560 with a checkpoint only, 3 samples, no decode turns (the new
  # engine restores the checkpoint while it starts: live_rows.py)
  model 8b-4bit /tmp/models/l8q
  step cutck ${LIMIT:-400} python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8q --no-eos \
    --streams 1 --max-tokens 640 --samples ${SAMPLES:-3} --turns 0 --sides with --cut-at 560 --prompt-words 1500
  ;;
cut1b)
  # issue 29: cutck's cut with the 1B model, one sample (a short call: a fresh machine's 1B engine
  # compiles faster than the 8B one); resume.py says why a cut gives no figure
  model 1b-bf16 /tmp/models/l1b
  step cut1b ${LIMIT:-170} python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l1b --no-eos \
    --streams 1 --max-tokens 640 --samples ${SAMPLES:-1} --turns 0 --sides with --cut-at 560 --prompt-words 1500
  ;;
cont29)
  # issue 29: the continuation probe, each with engine B's step trace: the checkpoints restored in
  # the queue, then early (as engine B starts: mlxd's way); with NOCK=1 early with engine B's
  # checkpoints off (is the continuation's own first checkpoint in its first turn?), then
  # restore_copy_probe.py. A fresh machine's first engine compiles its kernels for minutes: LIMIT=300.
  model 8b-4bit /tmp/models/l8q
  step contqueue ${LIMIT:-150} python3 benchmarks/continuation_probe.py --model /tmp/models/l8q --prompt-words 1500 \
    --cut-at 560 --streams ${STREAMS:-3} --trace --restore queue
  step contearly ${LIMIT:-150} python3 benchmarks/continuation_probe.py --model /tmp/models/l8q --prompt-words 1500 \
    --cut-at 560 --streams ${STREAMS:-3} --trace --restore early
  [ -n "${NOCK:-}" ] && step contnock ${LIMIT:-150} python3 benchmarks/continuation_probe.py --model /tmp/models/l8q --prompt-words 1500 \
    --cut-at 560 --streams ${STREAMS:-3} --trace --restore early "--b-flags=--generation-checkpoint 0"
  [ -n "${NOCK:-}" ] && step restore 60 python3 benchmarks/restore_copy_probe.py --rounds 2
  ;;
sweep29)
  # issue 29: a forward of M tokens over 5,024 cached ones, by M (chunk_sweep.py; 2026-12-07's
  # figures came from the same steps run inline), then a fresh engine's first turns (first29's)
  model 8b-4bit /tmp/models/l8q
  step sweep 120 python3 benchmarks/chunk_sweep.py --model /tmp/models/l8q
  step first ${LIMIT:-280} python3 benchmarks/first_turns.py --model /tmp/models/l8q --rounds ${ROUNDS:-3} \
    --flags "${FLAGS:---batch 8 --width-probe off}"
  ;;
dq29)
  # issue 29: a chunk of M tokens over 5,024 cached ones, MLX's quantized matmul against the
  # weights dequantized and a dense matmul (chunk_sweep.py --ways), then first29 at FLAGS
  model 8b-4bit /tmp/models/l8q
  step dq 200 python3 benchmarks/chunk_sweep.py --model /tmp/models/l8q --ways plain,dequant \
    --sizes ${SIZES:-1,2,8,16,24,32,45,46,47,48,64,128,256,512,1024,2048}
  [ -n "${FIRST:-}" ] && turns first "${LIMIT:-280}"
  ;;
dense29)
  # issue 29: a fresh engine's first turns (first_turns.py, traced) with prefill chunks through
  # quantized layers dequantized (dense_prefill.py, the default), then with MLXD_DENSE_PREFILL=0;
  # with CUT=1 then cutck's cut (SAMPLES, default 2)
  model 8b-4bit /tmp/models/l8q
  turns dense "${LIMIT:-200}"
  turns quantized "${LIMIT2:-120}" MLXD_DENSE_PREFILL=0
  [ -n "${GAP:-}" ] && turns gap0 "${LIMIT2:-120}" --gap 0
  [ -n "${CUT:-}" ] && step cutck ${CUTLIMIT:-240} python3 benchmarks/resume.py --phases checkpoint \
    --model /tmp/models/l8q --no-eos --streams 1 --max-tokens 640 --samples ${SAMPLES:-2} --turns 0 --sides with \
    --cut-at 560 --prompt-words 1500
  ;;
join29)
  # issue 29: a fresh engine's first turns (first_turns.py, traced) with the prompt's last piece and
  # its first token in one pass (first_pass.py, the default), then with MLXD_JOIN_FIRST_PASS=0
  model 8b-4bit /tmp/models/l8q
  turns joined "${LIMIT:-240}"
  turns split "${LIMIT:-240}" MLXD_JOIN_FIRST_PASS=0
  ;;
first29)
  # issue 29: one fresh engine's first long prompt and first continuation over it against later
  # rounds of the same shapes (first_turns.py; FLAGS: the engine's, default the width probe off to
  # fit a short call)
  model 8b-4bit /tmp/models/l8q
  step first ${LIMIT:-280} python3 benchmarks/first_turns.py --model /tmp/models/l8q --rounds ${ROUNDS:-3} \
    --flags "${FLAGS:---batch 8 --width-probe off}"
  ;;
tail29)
  # issue 29: a continuation's first turn outside any engine (tail_prefill_probe.py): the serial lane's
  # steps, with and without clearing MLX's cache, from a trimmed CUDA pool and from a grown one
  model 8b-4bit /tmp/models/l8q
  step tail ${LIMIT:-240} python3 benchmarks/tail_prefill_probe.py --model /tmp/models/l8q --rounds ${ROUNDS:-3}
  ;;
restore29)
  # issue 29: a continuation's first step reading KV restored from SSD (managed memory) against
  # KV a kernel made, and a copy ahead of it (restore_copy_probe.py; needs no model)
  step restore ${LIMIT:-120} python3 benchmarks/restore_copy_probe.py --rounds ${ROUNDS:-3}
  ;;
storm8)
  # issue 29: 8 streams of 4,574-token prompts, the engine SIGKILLed mid-decode KILLS times (one a
  # round, up to JITTER s after a token): the 7-8 replies going on at once on a fresh engine (on
  # 2026-12-07 such a batched prefill ran out of memory once on an H100, after an illegal memory access)
  # (the engines' step trace, with MLX's peak each turn, in storm8_steps.jsonl: which turns reach the limit)
  model 8b-4bit /tmp/models/l8q
  MLXD_TRACE_STEPS="$out/storm8_steps.jsonl" step storm8 ${LIMIT:-540} python3 benchmarks/resume.py --phases storm \
    --model /tmp/models/l8q --no-eos --streams 8 --kills ${KILLS:-4} --kills-per-round 1 --kill-jitter ${JITTER:-10} \
    --max-tokens 640 --prompt-words 1500
  python3 benchmarks/trace_turns.py "$out/storm8_steps.jsonl" 2>&1 | grep -B1 "highest peak" | head -n 40
  ;;
json)
  # issue 27: the schema-held JSON workload, n-gram drafts on against off, 1 and 8 streams
  model 8b-4bit /tmp/models/l8q
  step json ${LIMIT:-300} python3 benchmarks/speculative.py --model /tmp/models/l8q --widths 1,8 --rounds 2 \
    --max-tokens 256 --workloads json
  ;;
numerics)
  # issue 27: does the 8B's one-pass verification pick what its own steps pick?
  model 8b-4bit /tmp/models/l8q
  step numerics ${LIMIT:-300} python3 benchmarks/draft_agreement.py --model /tmp/models/l8q --draft /tmp/models/l8q \
    --tokens 256
  ;;
group1)
  # issue 30: a group of one rank against a plain engine (what the group machinery costs unneeded)
  model 1b-bf16 /tmp/models/l1b
  step group1_1b ${LIMIT:-240} python3 benchmarks/group_decode.py --model /tmp/models/l1b --ranks 1 --rounds 5 \
    --max-tokens 256 --streams 8
  ;;
close30)
  # issue 30's group of one rank, then issue 29's checkpoints on against off: one call (under 600 s)
  model 1b-bf16 /tmp/models/l1b
  step group1_1b 170 python3 benchmarks/group_decode.py --model /tmp/models/l1b --ranks 1 --rounds 3 \
    --max-tokens 256 --streams 8
  model 8b-4bit /tmp/models/l8q
  step ck8 330 python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8q --no-eos \
    --streams 8 --max-tokens 640 --samples 2 --cuts 0 --prompt-words 1500
  ;;
oom)
  # issue 29's ck8 ran the H100 out of memory in its second round (docs/benchmarks.md, "Tried on a
  # GPU"): the same two rounds, short replies, with the card's memory and each process's sampled
  # every 500 ms beside them (smi.csv, apps.csv) and the engine's memory (MLX's and the driver's)
  # after every round; then again with no SSD tier (nothing read on the host: no managed memory)
  model 8b-4bit /tmp/models/l8q
  nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv -lms 500 > "$out/smi.csv" 2>&1 &
  smi=$!
  nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv -lms 1000 > "$out/apps.csv" 2>&1 &
  apps=$!
  step oom ${LIMIT:-330} python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8q --no-eos \
    --streams 8 --max-tokens 64 --samples 1 --cuts 0 --prompt-words 1500 --show-memory
  echo "== smi at its highest"; sort -t, -k2 -n "$out/smi.csv" | tail -n 3
  step oom_nossd ${LIMIT2:-160} python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8q --no-eos \
    --streams 8 --max-tokens 64 --samples 1 --cuts 0 --prompt-words 1500 --show-memory --pool ssd_cache_bytes=0
  kill $smi $apps
  ;;
prefillmem)
  # issue 29's fix: 8 rows of 4,574 tokens prefilled together at MLX's own memory limit and whole
  # attention scores, against the engine's limit and scores a group of rows at a time (time, peaks)
  model 8b-4bit /tmp/models/l8q
  step prefill_memory ${LIMIT:-240} python3 benchmarks/prefill_memory.py --model /tmp/models/l8q --turns 2 --runs 3
  ;;
close27)
  # issue 29's cut, then issue 27's losing cases since new rows open at the lane's acceptance:
  # the self-draft (lone) and n-gram prose at 8 streams
  model 8b-4bit /tmp/models/l8q
  step cut 220 python3 benchmarks/resume.py --phases checkpoint --model /tmp/models/l8q --no-eos \
    --streams 1 --max-tokens 640 --samples 2 --cut-at 560 --prompt-words 1500
  step self16 150 python3 benchmarks/speculative.py --model /tmp/models/l8q --draft self:16 --widths 1 --rounds 3 \
    --max-tokens 256 --workloads prose
  step prose8 180 python3 benchmarks/speculative.py --model /tmp/models/l8q --widths 8 --rounds 2 \
    --max-tokens 256 --workloads prose
  ;;
spec27why|shrink)
  # issue 27: where n-gram drafting loses at 8 streams (seventh session: prose 0.96 and edit 0.94
  # with few passes; eighth: 0.97 and 0.97). Each run's engine writes its step trace, with the
  # batch lane's generator step timed (next_ms) and the passes, ended and lingering rows of each
  # turn; trace_turns.py sums it by phase and kind of turn. A freshly started machine compiles
  # kernels first (a traced prose run printed nothing in 215 s there): WARM=1 runs a short
  # speculative.py first for that. `shrink` first times what a row leaving costs (shrink_step.py).
  # MLXD_LINGER_ROWS=0 in the environment: rows leave the batch as they end (linger.py).
  model 8b-4bit /tmp/models/l8q
  [ "$1" = shrink ] && step shrink 90 python3 benchmarks/shrink_step.py /tmp/models/l8q --rows 8 --prompt 300 --rounds 1
  [ -n "${WARM:-}" ] && step warm 300 python3 benchmarks/speculative.py --model /tmp/models/l8q --widths 8 \
    --rounds 1 --max-tokens 32 --workloads prose
  for w in ${WORKLOADS:-prose edit}; do
    rm -f "$out/trace_$w.jsonl"
    MLXD_TRACE_STEPS="$out/trace_$w.jsonl" step ${w}8 ${LIMIT:-215} python3 benchmarks/speculative.py \
      --model /tmp/models/l8q --widths 8 --rounds ${ROUNDS:-2} --max-tokens 256 --workloads $w
    step turns_$w 20 python3 benchmarks/trace_turns.py "$out/trace_$w.jsonl"
  done
  ;;
spec27)
  # issue 27's two losing cases again with the fair speculative.py (each phase after the engine's
  # SSD writes of the one before settled, which phase goes first alternating; its idle reads shown)
  model 8b-4bit /tmp/models/l8q
  step self16 ${LIMIT:-220} python3 benchmarks/speculative.py --model /tmp/models/l8q --draft self:16 --widths 1 \
    --rounds 4 --max-tokens 256 --workloads prose
  step prose8 ${LIMIT:-280} python3 benchmarks/speculative.py --model /tmp/models/l8q --widths 8 --rounds 4 \
    --max-tokens 256 --workloads prose
  ;;
*) echo "usage: $0 shrink|prefillmem|oom|close30|close27|spec27|1b|8b|streams|close|close8b|lone|cache|structured|prefill|load|auto|auto8b|ck8|cut|json|numerics|group1" >&2; exit 2 ;;
esac
