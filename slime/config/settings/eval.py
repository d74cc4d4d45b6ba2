"""What a run evaluates, how often, and where the scored samples go (``slime.rollout.evaluation``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime.config.eval_config import EvalSetSettings
from slime.config.settings.data import parse_multimodal_keys


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    sets: tuple[EvalSetSettings, ...] = ()
    """``--eval-config`` or ``--eval-prompt-data``, every fallback applied (``slime.config.eval_config``)."""
    interval: int | None = None
    """``--eval-interval``: evaluate every this many rollouts."""
    skip_eval_before_train: bool = False
    output_dir: str | None = None
    """``--eval-output-dir``: where each evaluation's samples go (default: ``<save>/eval``)."""
    save: str | None = None
    """``--save``: evaluation samples go next to the checkpoints they score, unless ``output_dir``."""
    log_passrate: bool = False
    pass_threshold: float = 1.0
    """``--eval-pass-threshold``: with ``--log-passrate`` a sample passes at this reward."""
    metadata_key: str | None = "metadata"
    """``--metadata-key``, and ``tool_key`` ``--tool-key``: read from every set's records as from the
    training prompts'."""
    tool_key: str | None = None
    tokenizer_path: str | None = None
    """``--hf-checkpoint``: renders the chat template of sets that apply it."""
    reward_key: str | None = None
    """``--reward-key``: what the metrics average of a dict reward."""
    multimodal_keys: dict[str, str] | None = None
    """``--multimodal-keys``: evaluation records carry their images in the same fields as training's."""

    @property
    def pass_threshold_or_none(self) -> float | None:
        """The pass@k threshold when ``--log-passrate`` asks for pass rates."""
        return self.pass_threshold if self.log_passrate else None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EvalSettings:
        return cls(
            sets=tuple(args.eval_sets or ()),
            interval=args.eval_interval,
            skip_eval_before_train=bool(args.skip_eval_before_train),
            output_dir=args.eval_output_dir,
            save=args.save,
            log_passrate=bool(args.log_passrate),
            pass_threshold=args.eval_pass_threshold,
            metadata_key=args.metadata_key,
            tool_key=args.tool_key,
            tokenizer_path=args.hf_checkpoint,
            reward_key=args.reward_key,
            multimodal_keys=parse_multimodal_keys(args.multimodal_keys),
        )
