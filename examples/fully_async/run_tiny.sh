#!/usr/bin/env bash
# Fully asynchronous GRPO on the tiny CPU model: a persistent generation worker keeps the engine busy
# across rollout boundaries while train_async.py trains. Writes everything under $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
OUT=${OUT:-outputs/fully_async}
NUM_ROLLOUT=${NUM_ROLLOUT:-10}
mkdir -p "$OUT"

[ -f "$OUT/base/config.json" ] || $PY tools/make_tiny_model.py --out "$OUT/base"
[ -f "$OUT/data/train.jsonl" ] || $PY examples/quickstart/make_data.py --out "$OUT/data"
source scripts/models/tiny-qwen2.sh

$PY train_async.py "${MODEL_ARGS[@]}" \
   --hf-checkpoint "$OUT/base" \
   --prompt-data "$OUT/data/train.jsonl" --input-key prompt --label-key label --rm-type exact \
   --rollout-function-path examples/fully_async/fully_async_rollout.py:generate_rollout \
   --rollout-num-gpus 1 --actor-num-gpus-per-node 1 \
   --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "$NUM_ROLLOUT" --micro-batch-size 32 \
   --rollout-max-response-len 8 --rollout-skip-special-tokens \
   --async-buffer-size 1 --update-weights-interval 1 \
   --lr 1e-4 --lr-decay-style constant \
   --tb-dir "$OUT/tb" "$@"
