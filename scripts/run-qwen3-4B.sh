#!/usr/bin/env bash
# GRPO on Qwen3-4B with DAPO-Math-17k, on one 8×H100 node: 4 GPUs train (TP 2 × DP 2), 4 GPUs
# generate (two SGLang engines of 2 GPUs). Run inside the project's image; every flag group is
# explained in docs/get-started/single-node-gpu.md. On a multi-node Ray cluster pass --ray-address
# and scale the CLUSTER_ARGS (docs/get-started/multi-node.md).
#
#   MODEL_DIR=/root/models DATA_DIR=/root/data CKPT_DIR=/root/ckpt bash scripts/run-qwen3-4B.sh
#
# Extra flags are appended, so they override the ones below (argparse keeps the last value).
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "${SCRIPT_DIR}")"
PYTHON="${PYTHON:-python3}"
MODEL_DIR="${MODEL_DIR:-/root/models}"
DATA_DIR="${DATA_DIR:-/root/data}"
CKPT_DIR="${CKPT_DIR:-/root/ckpt}"

# shellcheck source=models/qwen3-4B.sh
source "${SCRIPT_DIR}/models/qwen3-4B.sh"

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}/Qwen3-4B"
   --load "${CKPT_DIR}/qwen3-4B-grpo"
   --save "${CKPT_DIR}/qwen3-4B-grpo"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_DIR}/dapo-math-17k/dapo-math-17k.jsonl"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type math
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1.0
   --global-batch-size 256
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime "${DATA_DIR}/aime-2024/aime-2024.jsonl"
   --n-samples-per-eval-prompt 16
   --eval-max-response-len 16384
   --eval-top-p 0.7
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
   --use-distributed-optimizer
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 2
   --sglang-mem-fraction-static 0.7
)

CLUSTER_ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node 4
   --rollout-num-gpus 4
   --num-gpus-per-node 8
)

MISC_ARGS=(
   --bf16
   --transformer-impl transformer_engine
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

exec "${PYTHON}" "${REPO_DIR}/train.py" \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${EVAL_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" \
   "${CLUSTER_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "$@"
