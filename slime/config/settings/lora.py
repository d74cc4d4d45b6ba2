"""LoRA: which linear layers get low-rank adapters, their shape, and whether the engines serve them.

The trainer, the weight sync and the engine launcher read this one object; with ``rank`` 0 nothing of
it applies and the whole model trains and moves as before.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime.config.errors import ConfigError

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""``--target-modules all-linear``: HF names of the attention and MLP projections (MLA's own
projections are added where the model has them)."""
ADAPTER_NAME = "slime_lora"
"""The adapter's name on the engines: every ``/generate`` of a run that serves it names it."""
MLA_LINEAR = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
"""Multi-latent attention's projections (DeepSeek-V3, Kimi-K2, GLM-4.5's MLA variants)."""


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 0
    """``--lora-rank``: 0 is no LoRA."""
    alpha: float = 16.0
    """``--lora-alpha``: an adapter's update is ``alpha / rank · B A x``."""
    dropout: float = 0.0
    """``--lora-dropout``: on the adapter's input, in training only."""
    target_modules: tuple[str, ...] = ALL_LINEAR
    """``--target-modules`` with ``all-linear`` expanded and ``--exclude-modules`` removed (HF names)."""
    adapter_path: str | None = None
    """``--lora-adapter-path``: an HF PEFT adapter directory to start from (else B = 0, A random)."""
    train_only: bool = False
    """``--lora-train-only``: the engines serve the base model and receive no adapter."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    @property
    def adapter_name(self) -> str:
        """The name the engines know the adapter by (SGLang's ``lora_name`` / ``lora_path``)."""
        return ADAPTER_NAME

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoraSettings:
        return cls(
            rank=int(args.lora_rank),
            alpha=float(args.lora_alpha),
            dropout=float(args.lora_dropout),
            target_modules=target_modules(args.target_modules, args.exclude_modules),
            adapter_path=args.lora_adapter_path,
            train_only=bool(args.lora_train_only),
        )


def target_modules(targets: list[str], excluded: list[str]) -> tuple[str, ...]:
    """``--target-modules`` minus ``--exclude-modules``; ``all-linear`` stands for ``ALL_LINEAR`` plus
    MLA's projections (a model without them simply has none to match)."""
    names: list[str] = []
    for name in targets:
        expanded = (*ALL_LINEAR, *MLA_LINEAR) if name == "all-linear" else (name,)
        names += [n for n in expanded if n not in names]
    unknown = [n for n in excluded if n not in names]
    if unknown:
        raise ConfigError(
            "--exclude-modules", f"{' '.join(unknown)} is not among --target-modules {' '.join(names)}"
        )
    kept = tuple(n for n in names if n not in excluded)
    if not kept:
        raise ConfigError("--exclude-modules", "leaves no module for LoRA; drop it or --lora-rank")
    return kept


def engine_server_args(lora: LoraSettings) -> dict[str, object]:
    """The SGLang server flags that let an engine serve the adapter (SGLang needs the rank and the
    targets up front when it starts without one): none without LoRA or with ``--lora-train-only``.
    The default targets are SGLang's ``all``; ``--sglang-*`` flags given by the user win."""
    if not lora.enabled or lora.train_only:
        return {}
    everything = target_modules(["all-linear"], [])
    targets = ["all"] if lora.target_modules == everything else list(lora.target_modules)
    return {"enable_lora": True, "max_lora_rank": lora.rank, "lora_target_modules": targets}
