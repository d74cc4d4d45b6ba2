#!/usr/bin/env bash
# CPU quickstart: make a tiny model and a "sort the digits" task, warm the model up with SFT, then
# train it with GRPO through the full stack (Ray, Megatron trainer on gloo, torch engine behind
# sglang-router, weight sync after every step). On the CPU a "GPU" is a worker process. The GRPO
# phase runs the overlapped loop (train_async.py): the engine generates rollout k+1 on one core while
# the trainer trains on rollout k on the other, one micro-batch of the step's 128 samples; the PPO
# ratio is taken against the engine's log-probs (--use-rollout-logprobs), which corrects for the
# samples being one update old. On 2 cores this is the fastest layout (docs/performance.md).
# Writes everything under $OUT (outputs/quickstart).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
OUT=${OUT:-outputs/quickstart}
SEED=${SEED:-0}
NUM_RL_ROLLOUTS=${NUM_RL_ROLLOUTS:-200}
mkdir -p "$OUT"

$PY tools/make_tiny_model.py --out "$OUT/base" --seed "$SEED"
$PY examples/quickstart/make_data.py --out "$OUT/data" --seed "$SEED"
source scripts/models/tiny-qwen2.sh

COMMON_ARGS=(
   --seed "$SEED"
   --rollout-seed "$SEED"
   --rollout-shuffle
   --input-key prompt
   --lr-decay-style constant
   --adam-beta2 0.98
   --weight-decay 0.0
)

echo "== 1/3 SFT warm start (75 steps of 64 pairs)"
$PY train.py "${MODEL_ARGS[@]}" "${COMMON_ARGS[@]}" \
   --hf-checkpoint "$OUT/base" \
   --prompt-data "$OUT/data/sft.jsonl" --label-key response \
   --loss-type sft_loss --rollout-function-path slime.rollout.sft_rollout.generate_rollout \
   --rollout-batch-size 64 --micro-batch-size 64 --num-rollout 75 \
   --lr 1e-3 \
   --save-hf "$OUT/sft" --tb-dir "$OUT/tb/sft"

echo "== 2/3 GRPO ($NUM_RL_ROLLOUTS rollouts of 16 prompts x 8 samples, exact-match reward)"
$PY train_async.py "${MODEL_ARGS[@]}" "${COMMON_ARGS[@]}" \
   --hf-checkpoint "$OUT/sft" \
   --prompt-data "$OUT/data/train.jsonl" --label-key label --rm-type exact \
   --eval-prompt-data sort "$OUT/data/eval.jsonl" --eval-interval 50 --n-samples-per-eval-prompt 1 \
   --rollout-num-gpus 1 --actor-num-gpus-per-node 1 \
   --rollout-batch-size 16 --n-samples-per-prompt 8 --num-rollout "$NUM_RL_ROLLOUTS" --micro-batch-size 128 \
   --rollout-temperature 1.0 --rollout-max-response-len 8 --rollout-skip-special-tokens \
   --advantage-estimator grpo --eps-clip 0.2 --share-prompts-in-train --use-rollout-logprobs \
   --lr 1e-4 --lr-warmup-iters 10 \
   --save "$OUT/ckpt" --save-interval "$NUM_RL_ROLLOUTS" --save-hf "$OUT/grpo" --tb-dir "$OUT/tb/grpo"

echo "== 3/3 reward curve"
$PY examples/quickstart/plot_rewards.py --tb-dir "$OUT/tb/grpo" --out "$OUT/reward_curve.png"
