#!/usr/bin/env bash
# Issue 22's device checks as one script for a lent GPU (a session's device time is minutes):
#   1. float32 token equality of the Triton paths on CUDA, engine steps eager, compiled and from CUDA graphs
#   2. an engine decode step at 64 sequences against a plain forward: eager, compiled, CUDA graphs
#      (TinyLlama shape, bf16)
#   3. the workloads: the engine eager, compiled and with graphs against stock generate() (SYSTEMS adds
#      transformers_cb: its warm-up alone took ~50 s for the 1.1B model on 2026-12-04)
# Every result goes under $OUT (default benchmarks/out); each part has its own deadline, so one slow
# part leaves the others their time. TOTAL_S (default 480) is what the script may use in all.
# A dry run on CPU: DEVICE=cpu DTYPE=float32 SHAPE=tiny SHAPES=tiny SIZES=tiny KV_GIB=0.05 benchmarks/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out}
TOTAL_S=${TOTAL_S:-480}
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16} SHAPE=${SHAPE:-tinyllama} SHAPES=${SHAPES:-tinyllama,issue} SIZES=${SIZES:-full} KV_GIB=${KV_GIB:-16}
SYSTEMS=${SYSTEMS:-engine,engine_compiled,engine_graphs,stock_generate}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - start) )); }
log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$OUT/device_run.log"; }

log "python $(python -c 'import sys; print(sys.version.split()[0])'); $(python -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/device_run.log" 2>&1 || true

log "1/3 gpu_equality"
timeout 150 python benchmarks/gpu_equality.py --out "$OUT" > "$OUT/gpu_equality.txt" 2>&1
log "gpu_equality rc=$? $(tail -1 "$OUT/gpu_equality.txt")"

for mode in off on graphs; do
  log "2/3 decode_step $mode"
  case $mode in
    off) args=(--compile off); limit=90 ;;
    on) args=(--compile on); limit=150 ;;
    graphs) args=(--compile off --cuda-graphs); limit=120 ;;
  esac
  timeout $limit python -m hf_paged.bench.decode_step --device "$DEVICE" --dtype "$DTYPE" --shape "$SHAPE" --num-seqs 64 \
    --steps 24 --rounds 3 --profile 10 "${args[@]}" --out "$OUT/decode_step_$mode.json" \
    > "$OUT/decode_step_$mode.txt" 2>&1
  log "decode_step $mode rc=$? $(grep 'engine decode step / plain' "$OUT/decode_step_$mode.txt")"
done

budget=$(( $(left) - 20 ))
log "3/3 on_device, ${budget}s"
timeout $(( budget + 15 )) python -m hf_paged.bench.on_device --device "$DEVICE" --dtype "$DTYPE" --shapes "$SHAPES" --sizes "$SIZES" --kv-gib "$KV_GIB" \
  --systems "$SYSTEMS" --rounds 2 --budget-s "$budget" --out "$OUT" \
  > "$OUT/on_device.txt" 2>&1
log "on_device rc=$?"
tail -40 "$OUT/on_device.txt"
