#!/usr/bin/env bash
# Search-R1 on the tiny CPU model: make the model, a made-up corpus and questions about it, then train
# a multi-turn search agent with GRPO (model turn -> BM25 search -> <information> appended with loss
# mask 0 -> ... -> <answer>), rewarded by exact match. Writes everything under $OUT
# (outputs/search-r1); extra arguments are passed on to train.py (later flags win).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
OUT=${OUT:-outputs/search-r1}
NUM_ROLLOUT=${NUM_ROLLOUT:-20}
PLUGIN=examples/search-r1/generate_with_search.py
mkdir -p "$OUT"

$PY tools/make_tiny_model.py --out "$OUT/base"
$PY examples/search-r1/make_data.py --out "$OUT/data"
source scripts/models/tiny-qwen2.sh

$PY train.py "${MODEL_ARGS[@]}" \
   --hf-checkpoint "$OUT/base" \
   --prompt-data "$OUT/data/train.jsonl" --input-key prompt --label-key label --apply-chat-template \
   --rollout-shuffle \
   --custom-generate-function-path "$PLUGIN:generate" \
   --custom-rm-path "$PLUGIN:reward_func" \
   --max-turns 3 --rollout-max-response-len 256 --rollout-temperature 1.0 \
   --rollout-num-gpus 1 --actor-num-gpus-per-node 1 \
   --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "$NUM_ROLLOUT" --micro-batch-size 32 \
   --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 \
   --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl \
   --lr 1e-5 --lr-decay-style constant \
   --tb-dir "$OUT/tb" "$@"
