"""Llama, Qwen2 and Qwen3: the dense decoder family (GQA, RoPE, RMSNorm, SwiGLU).

They differ only in optional tensors (Qwen2's q/k/v biases, Qwen3's q/k norms, tied or untied
embeddings), which simply appear or not in the checkpoint.

Megatron fuses q, k and v into ``linear_qkv`` grouped per KV head: for each of the ``ng`` groups,
its ``np/ng`` query heads, then its key head, then its value head, each ``head_dim`` rows. The gated
MLP fuses ``[gate; up]`` into ``linear_fc1``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from slime.backends.megatron.conversion.base import HFGetter, ModelConverter, split_layer_name


class LlamaLikeConverter(ModelConverter):
    LAYER_NAMES: ClassVar[dict[str, str]] = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    """Megatron name (inside a layer) -> HF name, for the tensors that map one to one: looked up first,
    so a family extends (or overrides) it rather than its methods."""

    def megatron_from_hf(self, name: str, hf: HFGetter) -> torch.Tensor:
        layer, rest = split_layer_name(name)
        if layer is None:
            return self._megatron_global(name, hf)
        prefix = f"model.layers.{layer}."
        if rest in self.LAYER_NAMES:
            return hf(prefix + self.LAYER_NAMES[rest])
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = (hf(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv")
            return self._fuse_qkv(q, k, v)
        if rest == "mlp.linear_fc1.weight":
            return self._fuse_gate_up(hf, prefix + "mlp.")
        raise KeyError(f"no HF source for Megatron parameter {name}")

    def _megatron_global(self, name: str, hf: HFGetter) -> torch.Tensor:
        if name == "embedding.word_embeddings.weight":
            return self.pad_vocab(hf("model.embed_tokens.weight"))
        if name == "output_layer.weight":
            source = "model.embed_tokens.weight" if self.shape.tie_word_embeddings else "lm_head.weight"
            return self.pad_vocab(hf(source))
        if name == "decoder.final_layernorm.weight":
            return hf("model.norm.weight")
        raise KeyError(f"no HF source for Megatron parameter {name}")

    def hf_from_megatron(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        layer, rest = split_layer_name(name)
        if layer is None:
            if name == "embedding.word_embeddings.weight":
                return [("model.embed_tokens.weight", self.unpad_vocab(tensor))]
            if name == "output_layer.weight":
                if self.shape.tie_word_embeddings:
                    return []
                return [("lm_head.weight", self.unpad_vocab(tensor))]
            if name == "decoder.final_layernorm.weight":
                return [("model.norm.weight", tensor)]
            raise KeyError(f"no HF name for Megatron parameter {name}")
        prefix = f"model.layers.{layer}."
        if rest in self.LAYER_NAMES:
            return [(prefix + self.LAYER_NAMES[rest], tensor)]
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = self._split_qkv(tensor)
            return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v), strict=True)]
        if rest == "mlp.linear_fc1.weight":
            return self._split_gate_up(tensor, prefix + "mlp.")
        raise KeyError(f"no HF name for Megatron parameter {name}")

    @staticmethod
    def _fuse_gate_up(hf: HFGetter, mlp: str) -> torch.Tensor:
        """A gated MLP's ``[gate; up]`` (Megatron's ``linear_fc1``) from HF's ``<mlp>{gate,up}_proj``."""
        return torch.cat([hf(mlp + "gate_proj.weight"), hf(mlp + "up_proj.weight")], dim=0)

    @staticmethod
    def _split_gate_up(tensor: torch.Tensor, mlp: str) -> list[tuple[str, torch.Tensor]]:
        gate, up = tensor.chunk(2, dim=0)
        return [(mlp + "gate_proj.weight", gate), (mlp + "up_proj.weight", up)]

    def _fuse_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = self.shape
        groups, per_group = s.num_query_groups, s.num_attention_heads // s.num_query_groups
        tail = q.shape[1:]
        q = q.reshape(groups, per_group * s.head_dim, *tail)
        k = k.reshape(groups, s.head_dim, *tail)
        v = v.reshape(groups, s.head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail).contiguous()

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        groups, per_group = s.num_query_groups, s.num_attention_heads // s.num_query_groups
        tail = qkv.shape[1:]
        grouped = qkv.reshape(groups, (per_group + 2) * s.head_dim, *tail)
        q, k, v = grouped.split([per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
        return (
            q.reshape(-1, *tail).contiguous(),
            k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous(),
        )
