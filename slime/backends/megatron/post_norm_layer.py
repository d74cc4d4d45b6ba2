"""GLM-4's sandwich norms: a transformer layer that also norms the attention output and the MLP output
before each is added to the residual stream (``x + norm(attn(norm(x)))``, then the same for the MLP).

megatron-core's ``TransformerLayer`` has no slot for them: its only norm after attention,
``pre_cross_attn_layernorm``, acts after the residual add. Rather than rewrite its forward, this layer
builds the two norms as its own submodules (``post_self_attn_layernorm``, ``post_mlp_layernorm``, the
Megatron parameter names) and wraps the two bias-dropout-add steps the forward already calls, so they
compute ``residual + dropout(norm(out + bias))``. Recomputation, pipeline stages, tensor parallelism
and the local and Transformer Engine specs thus run megatron-core's own code. The norms are built like
``input_layernorm`` (hidden size, ``--norm-epsilon``), are not tensor-parallel, so every TP rank holds
them whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

BiasDropoutAdd = Callable[[tuple[torch.Tensor, torch.Tensor | None], torch.Tensor, float], torch.Tensor]


@dataclass
class PostNormLayerSubmodules(TransformerLayerSubmodules):
    """megatron-core's layer submodules plus the norm of the attention output and of the MLP output."""

    post_self_attn_layernorm: ModuleSpec | type = IdentityOp
    post_mlp_layernorm: ModuleSpec | type = IdentityOp


def _normed(bda: BiasDropoutAdd, norm: torch.nn.Module) -> BiasDropoutAdd:
    """``bda`` applied to ``norm(out + bias)``: a linear's bias is part of the output the norm sees."""

    def apply(
        out_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor, prob: float
    ) -> torch.Tensor:
        out, bias = out_with_bias
        if bias is not None:
            out = out + bias
        return bda((norm(out), None), residual, prob)

    return apply


class PostNormTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` whose attention and MLP outputs are normed before their residual adds."""

    self_attn_bda: Callable[..., Any]
    mlp_bda: Callable[..., Any]

    def __init__(self, config: TransformerConfig, submodules: PostNormLayerSubmodules, **kwargs) -> None:
        super().__init__(config, submodules, **kwargs)
        self.post_self_attn_layernorm = self._build_norm(submodules.post_self_attn_layernorm)
        self.post_mlp_layernorm = self._build_norm(submodules.post_mlp_layernorm)
        # megatron-core calls ``self.<x>_bda(training, fused)(out_with_bias, residual, dropout)``.
        self._attn_bda = self.self_attn_bda
        self.self_attn_bda = self._normed_attn_bda
        self._mlp_bda = self.mlp_bda
        self.mlp_bda = self._normed_mlp_bda

    def _build_norm(self, spec: ModuleSpec | type) -> torch.nn.Module:
        return build_module(
            spec, config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon
        )

    def _normed_attn_bda(self, training: bool, fused: bool) -> BiasDropoutAdd:
        return _normed(self._attn_bda(training, fused), self.post_self_attn_layernorm)

    def _normed_mlp_bda(self, training: bool, fused: bool) -> BiasDropoutAdd:
        return _normed(self._mlp_bda(training, fused), self.post_mlp_layernorm)


def _norm_class(te: bool, normalization: str) -> type:
    """The norm the spec's own unfused norms use: TENorm (which reads RMSNorm from the config) with
    Transformer Engine, else megatron-core's local norm for ``normalization``."""
    if te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return LocalSpecProvider().layer_norm(rms_norm=normalization == "RMSNorm")


def with_post_norms(
    spec: ModuleSpec, te: bool, normalization: str, post_self_attn: bool, post_mlp: bool
) -> ModuleSpec:
    """``spec``, a plain ``TransformerLayer`` spec, as a ``PostNormTransformerLayer`` with the norms asked
    for; the other submodules stay as the spec chose them (local or Transformer Engine)."""
    if spec.module is not TransformerLayer:
        raise ValueError(f"post-attention / post-MLP norms need a TransformerLayer spec, got {spec.module}")
    norm = _norm_class(te, normalization)
    inherited = {field.name: getattr(spec.submodules, field.name) for field in fields(spec.submodules)}
    submodules = PostNormLayerSubmodules(
        **inherited,
        post_self_attn_layernorm=norm if post_self_attn else IdentityOp,
        post_mlp_layernorm=norm if post_mlp else IdentityOp,
    )
    return ModuleSpec(module=PostNormTransformerLayer, params=spec.params, submodules=submodules)
