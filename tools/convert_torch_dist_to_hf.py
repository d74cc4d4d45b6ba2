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
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.config import ConfigError
from tools._trainer_cli import parse_conversion_args, trainer_group

# slime.backends.megatron.checkpoint's tracker file, named here: bad input fails before Megatron loads.
TRACKER_FILE = "latest_checkpointed_iteration.txt"


def _check(args: argparse.Namespace) -> None:
    if args.load is None:
        raise ConfigError("--load", "required; pass the torch_dist checkpoint directory (train.py's --save)")
    tracker = os.path.join(args.load, TRACKER_FILE)
    if not os.path.isfile(tracker):
        raise ConfigError(
            "--load", f"{args.load} holds no checkpoint ({TRACKER_FILE} is missing); check the path"
        )
    text = Path(tracker).read_text().strip()
    if not text.isdigit() or not os.path.isdir(os.path.join(args.load, f"iter_{int(text):07d}")):
        raise ConfigError(
            "--load", f"{tracker} names {text!r}, which is not a checkpoint here; check the path"
        )
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
