#!/usr/bin/env bash
# CPU vision-language example: make a tiny Qwen2.5-VL and a "what colour is the shape?" task of 56x56
# pictures, warm the model up with SFT, then train it with GRPO through the full stack (Ray, Megatron
# trainer on gloo, engine behind sglang-router, weight sync after every step), images travelling from
# the prompt files (--multimodal-keys) to the engine and the trainer. Shaped like
# examples/quickstart/run.sh. Writes everything under $OUT (outputs/vlm). With MULTI_TURN_ROLLOUTS=N
# it then trains the two-turn variant (a second picture shown mid-trajectory) for N rollouts.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/vlm}
SEED=${SEED:-0}
NUM_SFT_STEPS=${NUM_SFT_STEPS:-60}
NUM_RL_ROLLOUTS=${NUM_RL_ROLLOUTS:-100}
MULTI_TURN_ROLLOUTS=${MULTI_TURN_ROLLOUTS:-0}  # > 0: also train the two-picture variant (step 4)
mkdir -p "$OUT"

$PY tools/make_tiny_model.py --arch qwen2_5_vl --out "$OUT/base" --seed "$SEED"
$PY examples/vlm/make_data.py --out "$OUT/data" --seed "$SEED"
source scripts/models/tiny-qwen2.5-vl.sh

COMMON_ARGS=(
   --seed "$SEED"
   --rollout-seed "$SEED"
   --rollout-shuffle
   --input-key prompt
   --multimodal-keys '{"image": "images"}'
   --lr-decay-style constant
   --adam-beta2 0.98
   --weight-decay 0.0
)

echo "== 1/3 SFT warm start ($NUM_SFT_STEPS steps of 64 picture/colour pairs)"
$PY train.py "${MODEL_ARGS[@]}" "${COMMON_ARGS[@]}" \
   --hf-checkpoint "$OUT/base" \
   --prompt-data "$OUT/data/sft.jsonl" --label-key response \
   --loss-type sft_loss --rollout-function-path slime.rollout.sft_rollout.generate_rollout \
   --rollout-batch-size 64 --micro-batch-size 64 --num-rollout "$NUM_SFT_STEPS" \
   --lr 1e-3 \
   --save-hf "$OUT/sft" --tb-dir "$OUT/tb/sft"

echo "== 2/3 GRPO ($NUM_RL_ROLLOUTS rollouts of 16 pictures x 8 samples, exact-match reward)"
$PY train.py "${MODEL_ARGS[@]}" "${COMMON_ARGS[@]}" \
   --hf-checkpoint "$OUT/sft" \
   --prompt-data "$OUT/data/train.jsonl" --label-key label --rm-type exact \
   --eval-prompt-data colour "$OUT/data/eval.jsonl" --eval-interval 25 --n-samples-per-eval-prompt 1 \
   --rollout-num-gpus 1 --actor-num-gpus-per-node 2 \
   --rollout-batch-size 16 --n-samples-per-prompt 8 --num-rollout "$NUM_RL_ROLLOUTS" --micro-batch-size 32 \
   --rollout-temperature 1.0 --rollout-max-response-len 8 --rollout-skip-special-tokens \
   --advantage-estimator grpo --eps-clip 0.2 --share-prompts-in-train \
   --lr 1e-4 --lr-warmup-iters 10 \
   --save "$OUT/ckpt" --save-interval "$NUM_RL_ROLLOUTS" --save-hf "$OUT/grpo" --tb-dir "$OUT/tb/grpo"

echo "== 3/3 reward curve"
$PY examples/quickstart/plot_rewards.py --tb-dir "$OUT/tb/grpo" --out "$OUT/reward_curve.png"

if [ "$MULTI_TURN_ROLLOUTS" -gt 0 ]; then
   echo "== 4 two-turn GRPO ($MULTI_TURN_ROLLOUTS rollouts; the second picture is an observation)"
   $PY train.py "${MODEL_ARGS[@]}" "${COMMON_ARGS[@]}" \
      --hf-checkpoint "$OUT/sft" \
      --prompt-data "$OUT/data/multi_turn.jsonl" --label-key label \
      --custom-generate-function-path examples/vlm/multi_turn_generate.py:generate \
      --custom-rm-path examples/vlm/reward.py:multi_turn_reward \
      --rollout-num-gpus 1 --actor-num-gpus-per-node 2 \
      --rollout-batch-size 16 --n-samples-per-prompt 8 --num-rollout "$MULTI_TURN_ROLLOUTS" --micro-batch-size 32 \
      --rollout-temperature 1.0 --rollout-max-response-len 64 \
      --advantage-estimator grpo --eps-clip 0.2 --share-prompts-in-train \
      --lr 1e-4 \
      --tb-dir "$OUT/tb/multi_turn"
fi
