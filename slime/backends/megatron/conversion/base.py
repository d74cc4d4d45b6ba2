"""What every architecture converter provides.

Names on the Megatron side are *global* and *unsharded*: ``decoder.layers.<global index>...`` with the
full (TP-gathered) tensor in Megatron's layout. Sharding across tensor-parallel ranks and the
local-to-global layer numbering of pipeline stages live in ``slime.backends.megatron.sharding``, so a
converter only knows how one architecture's tensors are named and laid out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

HFGetter = Callable[[str], torch.Tensor]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ModelShape:
    """The few sizes a conversion needs (GQA grouping and vocab padding)."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool


def split_layer_name(name: str) -> tuple[int | None, str]:
    """``decoder.layers.3.mlp.linear_fc2.weight`` -> ``(3, "mlp.linear_fc2...")``; else ``(None, name)``"""
    match = _LAYER.match(name)
    if match is None:
        return None, name
    return int(match.group(1)), match.group(2)


class ModelConverter:
    """Maps one architecture's parameters between HF names and Megatron (global, unsharded) names."""

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape

    def megatron_from_hf(self, name: str, hf: HFGetter) -> torch.Tensor:
        """The full Megatron tensor ``name``, assembled from HF tensors fetched through ``hf``."""
        raise NotImplementedError

    def hf_from_megatron(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors held in the full Megatron tensor ``name`` (empty when it duplicates another)."""
        raise NotImplementedError

    def pad_vocab(self, tensor: torch.Tensor) -> torch.Tensor:
        """Zero rows up to Megatron's padded vocab (never sampled: logits are cut to the HF vocab)."""
        extra = self.shape.padded_vocab_size - tensor.shape[0]
        if extra <= 0:
            return tensor
        return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))], dim=0)

    def unpad_vocab(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[: self.shape.vocab_size]
