"""Convert a Megatron torch_dist checkpoint (``--save`` of train.py) into an HF checkpoint.

    source scripts/models/tiny-qwen2.sh
    python tools/convert_torch_dist_to_hf.py "${MODEL_ARGS[@]}" --hf-checkpoint SRC_HF --load CKPT_DIR \\
        --save-hf OUT_DIR [--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --actor-num-gpus-per-node 4]

Takes train.py's Megatron model and layout flags; ``--hf-checkpoint`` is the model the run started
from (its config and tokenizer files are copied to OUT_DIR next to the converted safetensors). The
latest checkpoint under CKPT_DIR is read; only the model weights, so the optimizer is never loaded.
The layout may differ from the one the checkpoint was saved with (dist_checkpointing reshards on
load). The training-only flags train.py requires default to ``--rollout-batch-size 1 --num-rollout 1
--lr 0``. Bad input: one error line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.config import ConfigError
from slime.config.validate import check_checkpoint_to_load
from tools._trainer_cli import parse_conversion_args, trainer_group


def _check(args: argparse.Namespace) -> None:
    check_checkpoint_to_load(args, required=True)
    if args.save_hf is None:
        raise ConfigError("--save-hf", "required; pass the directory to write the HF checkpoint to")
    args.no_load_optim = True  # the weights are all a conversion needs


def main(argv: list[str] | None = None) -> str:
    args = parse_conversion_args(argv, _check)
    with trainer_group(args) as group:
        path = group.save_hf(args.save_hf)
    print(f"HF checkpoint written to {path}")
    return path


if __name__ == "__main__":
    main()
