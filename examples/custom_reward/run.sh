#!/usr/bin/env bash
# The CPU quickstart's GRPO phase with a reward of your own: examples/custom_reward/reward.py scores
# the sort task with partial credit, passed as --custom-rm-path instead of --rm-type exact.
# Starts from the quickstart's SFT checkpoint when `make quickstart` left one in $QUICKSTART/sft,
# else from a fresh tiny model; data and model come from the quickstart's own tools.
# Writes everything under $OUT (outputs/custom_reward).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
OUT=${OUT:-outputs/custom_reward}
QUICKSTART=${QUICKSTART:-outputs/quickstart}
SEED=${SEED:-0}
NUM_RL_ROLLOUTS=${NUM_RL_ROLLOUTS:-50}
mkdir -p "$OUT"

$PY examples/quickstart/make_data.py --out "$OUT/data" --seed "$SEED"
if [ -f "$QUICKSTART/sft/config.json" ]; then
   INIT="$QUICKSTART/sft"
else
   $PY tools/make_tiny_model.py --out "$OUT/base" --seed "$SEED"
   INIT="$OUT/base"
fi
source scripts/models/tiny-qwen2.sh

echo "== GRPO from $INIT ($NUM_RL_ROLLOUTS rollouts of 16 prompts x 8 samples, partial-credit reward)"
$PY train.py "${MODEL_ARGS[@]}" \
   --hf-checkpoint "$INIT" \
   --prompt-data "$OUT/data/train.jsonl" --input-key prompt --label-key label \
   --custom-rm-path examples/custom_reward/reward.py:partial_sort_reward \
   --seed "$SEED" --rollout-seed "$SEED" --rollout-shuffle \
   --rollout-num-gpus 1 --actor-num-gpus-per-node 2 \
   --rollout-batch-size 16 --n-samples-per-prompt 8 --num-rollout "$NUM_RL_ROLLOUTS" --micro-batch-size 32 \
   --rollout-temperature 1.0 --rollout-max-response-len 8 --rollout-skip-special-tokens \
   --advantage-estimator grpo --eps-clip 0.2 --share-prompts-in-train \
   --lr 1e-4 --lr-decay-style constant --adam-beta2 0.98 --weight-decay 0.0 \
   --tb-dir "$OUT/tb"
