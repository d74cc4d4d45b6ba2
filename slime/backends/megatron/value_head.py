"""The critic's model: the policy's GPTModel with its vocab projection replaced by a scalar value head.

Everything else (layers, HF loading, TP/PP/DP, optimizer, checkpoints) is the actor's code; only the
last pipeline stage's ``output_layer`` differs, so the critic is ``MegatronTrainer`` with another head
and another loss (``value_loss``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


class ValueHead(torch.nn.Module):
    """``V(s_t) = w·h_t + b`` on the final (normed) hidden state; replicated on tensor-parallel ranks.

    Zero-initialised: every value starts at exactly 0 on every rank and seed (deterministic, no RNG),
    so the first value loss is ``½ mean(R²)`` and the first step moves only the head. Called as
    GPTModel calls its output layer, ``(hidden [s, b, h], weight=..., runtime_gather_output=...)``, and
    returns ``([s, b, 1], None)``: the model's "logits" are then values of shape ``[b, s, 1]``.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def attach_value_heads(chunks: Sequence[GPTModel], hidden_size: int) -> None:
    """Replaces the vocab projection of the last-stage chunk(s) with a ``ValueHead`` (before DDP wrapping).

    The head has no tie to the input embedding, so tying is switched off on every chunk (on PP > 1 the
    first stage would otherwise all-reduce its embedding gradient with the last stage's head).
    """
    for chunk in chunks:
        chunk.share_embeddings_and_output_weights = False
        if chunk.post_process:
            device = next(chunk.parameters()).device
            chunk.output_layer = ValueHead(hidden_size).to(device)
