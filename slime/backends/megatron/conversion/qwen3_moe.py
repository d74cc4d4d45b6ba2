"""Qwen3-MoE (and Qwen2-MoE): the dense family's attention with a routed-expert MLP in every layer.

HF keeps every expert as its own gated MLP (``mlp.experts.<e>.{gate,up,down}_proj``) and the router
as ``mlp.gate``; Qwen2-MoE adds one shared expert (``mlp.shared_expert.*``) scaled by
``sigmoid(mlp.shared_expert_gate(x))``. On the Megatron side the router is ``mlp.router``, expert
``e`` is ``mlp.experts.local_experts.<e>.linear_fc{1,2}`` (SequentialMLP) or
``mlp.experts.linear_fc{1,2}.weight<e>`` (Transformer Engine's TEGroupedMLP), and the shared expert
is ``mlp.shared_experts.linear_fc{1,2}`` with ``gate_weight``; every ``linear_fc1`` fuses
``[gate; up]`` as the dense MLP does. Expert numbers are global here (see ``sharding``).
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch

from slime.backends.megatron.conversion.base import HFGetter, split_layer_name
from slime.backends.megatron.conversion.llama_like import LlamaLikeConverter

_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<local>\d+)\.(?P<fc>linear_fc[12])\.weight"
    r"|(?P<grouped_fc>linear_fc[12])\.weight(?P<grouped>\d+))$"
)
_SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"


def _expert(rest: str) -> tuple[int, str] | None:
    """``(expert index, "linear_fc1" | "linear_fc2")`` of an expert weight's in-layer name, else None."""
    match = _EXPERT.match(rest)
    if match is None:
        return None
    if match.group("local") is not None:
        return int(match.group("local")), match.group("fc")
    return int(match.group("grouped")), match.group("grouped_fc")


class Qwen3MoeConverter(LlamaLikeConverter):
    SHARED = "mlp.shared_expert."
    """HF prefix of the shared expert's gated MLP (its ``linear_fc1`` is fused from it)."""
    LAYER_NAMES: ClassVar[dict[str, str]] = {
        **LlamaLikeConverter.LAYER_NAMES,
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
        "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    }

    def megatron_from_hf(self, name: str, hf: HFGetter) -> torch.Tensor:
        layer, rest = split_layer_name(name)
        if layer is None:
            return super().megatron_from_hf(name, hf)
        prefix = f"model.layers.{layer}."
        if rest == _SHARED_FC1:
            return self._fuse_gate_up(hf, prefix + self.SHARED)
        expert = _expert(rest)
        if expert is None:
            return super().megatron_from_hf(name, hf)
        index, fc = expert
        mlp = f"{prefix}mlp.experts.{index}."
        if fc == "linear_fc1":
            return self._fuse_gate_up(hf, mlp)
        return hf(mlp + "down_proj.weight")

    def hf_from_megatron(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        layer, rest = split_layer_name(name)
        if layer is None:
            return super().hf_from_megatron(name, tensor)
        prefix = f"model.layers.{layer}."
        if rest == _SHARED_FC1:
            return self._split_gate_up(tensor, prefix + self.SHARED)
        expert = _expert(rest)
        if expert is None:
            return super().hf_from_megatron(name, tensor)
        index, fc = expert
        mlp = f"{prefix}mlp.experts.{index}."
        if fc == "linear_fc1":
            return self._split_gate_up(tensor, mlp)
        return [(mlp + "down_proj.weight", tensor)]
