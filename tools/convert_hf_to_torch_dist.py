"""Convert an HF checkpoint into a Megatron torch_dist checkpoint that ``train.py --load`` reads.

    source scripts/models/tiny-qwen2.sh
    python tools/convert_hf_to_torch_dist.py "${MODEL_ARGS[@]}" --hf-checkpoint HF_DIR --save CKPT_DIR \\
        [--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --actor-num-gpus-per-node 4]

Takes train.py's Megatron model and layout flags; the training-only flags train.py requires default
to ``--rollout-batch-size 1 --num-rollout 1 --lr 0``. The weights are written as rollout 0
(``CKPT_DIR/iter_0000000``, with a fresh optimizer and scheduler state); train it with
``--load CKPT_DIR --no-load-optim`` (it resumes at rollout 1). Bad input: one error line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.config import ConfigError
from tools._trainer_cli import parse_conversion_args, trainer_group


def _check(args: argparse.Namespace) -> None:
    if args.save is None:
        raise ConfigError("--save", "required; pass the directory to write the torch_dist checkpoint to")
    if args.load is not None:
        raise ConfigError("--load", "not used here (the weights come from --hf-checkpoint); drop it")


def main(argv: list[str] | None = None) -> str:
    args = parse_conversion_args(argv, _check)
    with trainer_group(args) as group:
        path = group.save(0)
    print(f"torch_dist checkpoint written to {path}")
    return path


if __name__ == "__main__":
    main()
