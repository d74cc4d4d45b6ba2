"""Model flags vs the HF ``config.json`` of ``--hf-checkpoint``.

Trainers build a Megatron model from the Megatron flags and load HF weights into it; engines
load the same HF directory. If the two disagree the run fails (or, worse, trains a different
model) long after start-up, so every model flag is checked here:

* a flag the user left out is filled from ``config.json`` (``--hf-checkpoint`` alone is enough);
* a flag the user gave must match ``config.json``, or one ``ConfigError`` names it and the fix.

"Left out" is decided by the caller (``given``): ``parse_args`` knows the exact command line.
Only keys that Llama/Qwen-style configs spell out are read; a key that ``config.json`` does not
have is neither filled nor checked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.config.errors import ConfigError

CONFIG_NAME = "config.json"
_SOURCE_HINT = "(or source the right scripts/models/*.sh)"

# Model families whose attention shape is fixed by model_type rather than spelled in config.json.
_MLA_TYPES = frozenset({"deepseek_v3", "kimi_k2"})  # Kimi-K2 is DeepSeek-V3 under its own name
# MLA always norms the compressed key/value (and query) latents: Megatron's qk_layernorm.
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", *_MLA_TYPES})
_NO_QK_NORM_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "glm4", "qwen2_5_vl"})
# Qwen2 hard-codes bias=True on q/k/v; Qwen2.5-VL's language model is Qwen2's.
_QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen2_5_vl"})
_NO_BIAS_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "glm4",
        "glm4_moe",
        "qwen2_5_vl",
        *_MLA_TYPES,
    }
)
_SANDWICH_NORM_TYPES = frozenset({"glm4"})  # post_self_attn_layernorm and post_mlp_layernorm
_INTERLEAVED_ROPE_TYPES = frozenset({"glm4"})  # rotate_half over (x0, x1), (x2, x3), ...
_SIGMOID_ROUTER_TYPES = frozenset({"glm4_moe"})  # no scoring_func key: sigmoid, with the score bias
_KNOWN_TYPES = _NO_BIAS_TYPES  # every family slime converts

# What config.json implies for a flag: (value, "key=value" for the message), or None if it is silent.
Reading = tuple[Any, str] | None
# A parsed config.json (or one of its nested blocks): JSON keys to JSON values.
HFConfig = dict[str, Any]


def load_hf_config(hf_checkpoint: str) -> tuple[dict[str, Any], str]:
    """Read ``<hf_checkpoint>/config.json``; returns the (text-model) config and its path."""
    path = os.path.join(hf_checkpoint, CONFIG_NAME)
    if not os.path.isdir(hf_checkpoint):
        raise ConfigError(
            "--hf-checkpoint", f"{hf_checkpoint} is not a directory; pass an HF model directory"
        )
    if not os.path.isfile(path):
        raise ConfigError(
            "--hf-checkpoint", f"{hf_checkpoint} has no {CONFIG_NAME}; pass an HF model directory"
        )
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError("--hf-checkpoint", f"cannot read {path} ({e}); fix or replace the file") from e
    if not isinstance(config, dict):
        raise ConfigError("--hf-checkpoint", f"{path} is not a JSON object; fix or replace the file")
    # Multimodal checkpoints (e.g. Qwen2.5-VL) keep the language model under text_config, which wins
    # over the flat copies some files also carry at the top level; model_type stays the checkpoint's.
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text, "model_type": config.get("model_type")}
    return config, path


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


def _key(*names: str) -> Callable[[HFConfig], Reading]:
    def read(cfg: HFConfig) -> Reading:
        for name in names:
            if cfg.get(name) is not None:
                return cfg[name], f"{name}={_show(cfg[name])}"
        return None

    return read


def _rope_setting(cfg: HFConfig, name: str) -> tuple[Any, str] | None:
    """A RoPE key (``rope_theta``, ``partial_rotary_factor``) and where it was found: at the top level,
    or in ``rope_parameters``, where transformers 5 moved it."""
    params = cfg.get("rope_parameters")
    if cfg.get(name) is not None:
        return cfg[name], name
    if isinstance(params, dict) and params.get(name) is not None:
        return params[name], f"rope_parameters.{name}"
    return None


def _rope_kind(block: HFConfig) -> str:
    """The scheme of a RoPE block (transformers 5 says ``rope_type``, older configs ``type``)."""
    return str(block.get("rope_type", block.get("type", "default")))


def _rope_theta(cfg: HFConfig) -> Reading:
    found = _rope_setting(cfg, "rope_theta")
    if found is None:
        return None
    theta, where = found
    theta = int(theta) if float(theta).is_integer() else theta
    return theta, f"{where}={theta}"


def _rope_scaling(cfg: HFConfig) -> tuple[HFConfig, str] | None:
    """The RoPE scaling block and where it lives, or None when config.json has no RoPE settings."""
    for key in ("rope_scaling", "rope_parameters"):  # transformers 4 / transformers 5
        block = cfg.get(key)
        if isinstance(block, dict):
            return block, key
    if "rope_scaling" in cfg or _rope_theta(cfg) is not None:
        return {}, "rope_scaling"  # RoPE without scaling (rope_scaling: null or absent)
    return None


def _use_rope_scaling(cfg: HFConfig) -> Reading:
    # --use-rope-scaling is Megatron-LM's name for Llama-3.x scaling; other schemes (yarn, ...) are
    # not expressible with it, so they are neither filled nor checked.
    found = _rope_scaling(cfg)
    if found is None:
        return None
    block, key = found
    kind = _rope_kind(block)
    if kind not in ("llama3", "default"):
        return None
    return kind == "llama3", f"{key}.rope_type={kind}"


def _rope_scaling_factor(cfg: HFConfig) -> Reading:
    found = _rope_scaling(cfg)
    if found is None or _rope_kind(found[0]) != "llama3":
        return None
    block, key = found
    return (block["factor"], f"{key}.factor={block['factor']}") if "factor" in block else None


def _rotary_percent(cfg: HFConfig) -> Reading:
    found = _rope_setting(cfg, "partial_rotary_factor")
    return None if found is None else (float(found[0]), f"{found[1]}={found[0]}")


def _by_type(types: frozenset[str], what: str) -> Callable[[HFConfig], Reading]:
    """A switch that a family has and the others (of the families slime converts) lack."""

    def read(cfg: HFConfig) -> Reading:
        model_type = cfg.get("model_type")
        if model_type not in _KNOWN_TYPES:
            return None
        on = model_type in types
        return on, f"model_type={model_type} ({'' if on else 'no '}{what})"

    return read


def _mla(cfg: HFConfig) -> bool:
    return cfg.get("kv_lora_rank") is not None


def _multi_latent_attention(cfg: HFConfig) -> Reading:
    if "kv_lora_rank" in cfg:
        return _mla(cfg), f"kv_lora_rank={_show(cfg['kv_lora_rank'])}"
    return _by_type(_MLA_TYPES, "multi-latent attention")(cfg)


def _mla_key(name: str) -> Callable[[HFConfig], Reading]:
    """An MLA size; null is a value too (``q_lora_rank: null``: a full query projection)."""

    def read(cfg: HFConfig) -> Reading:
        return (cfg[name], f"{name}={_show(cfg[name])}") if _mla(cfg) and name in cfg else None

    return read


def _yarn(name: str, cast: Callable[[Any], Any] = float) -> Callable[[HFConfig], Reading]:
    """A YaRN setting of an MLA model's ``rope_scaling`` block."""

    def read(cfg: HFConfig) -> Reading:
        found = _rope_scaling(cfg) if _mla(cfg) else None
        if found is None or _rope_kind(found[0]) != "yarn":
            return None
        block, key = found
        return (cast(block[name]), f"{key}.{name}={block[name]}") if name in block else None

    return read


def _rope_type(cfg: HFConfig) -> Reading:
    found = _rope_scaling(cfg) if _mla(cfg) else None
    if found is None:
        return None
    block, key = found
    kind = _rope_kind(block)
    return ("yarn" if kind == "yarn" else "rope"), f"{key}.rope_type={kind}"


def _mrope_section(cfg: HFConfig) -> Reading:
    """Multimodal RoPE's split of the rotary pairs (Qwen2.5-VL): in ``rope_scaling`` (transformers 4,
    the published files) or ``rope_parameters`` (transformers 5)."""
    for key in ("rope_scaling", "rope_parameters"):
        block = cfg.get(key)
        if isinstance(block, dict) and block.get("mrope_section") is not None:
            section = [int(pairs) for pairs in block["mrope_section"]]
            return section, f"{key}.mrope_section={section}"
    return None


def _position_embedding(cfg: HFConfig) -> Reading:
    mrope = _mrope_section(cfg)
    if mrope is not None:
        return "mrope", mrope[1]
    reading = _rope_theta(cfg)
    return ("rope", reading[1]) if reading else None


def _normalization(cfg: HFConfig) -> Reading:
    if "rms_norm_eps" in cfg:
        return "RMSNorm", f"rms_norm_eps={cfg['rms_norm_eps']} (RMSNorm)"
    for key in ("layer_norm_eps", "layer_norm_epsilon"):
        if key in cfg:
            return "LayerNorm", f"{key}={cfg[key]} (LayerNorm)"
    return None


def _swiglu(cfg: HFConfig) -> Reading:
    act = cfg.get("hidden_act")
    return (act in ("silu", "swish"), f"hidden_act={act}") if isinstance(act, str) else None


def _untie(cfg: HFConfig) -> Reading:
    # A missing key is read as False: the default of LlamaConfig, Qwen2Config and Qwen3(-MoE)Config.
    tied = bool(cfg.get("tie_word_embeddings", False))
    return not tied, f"tie_word_embeddings={_show(tied)}"


def _qk_layernorm(cfg: HFConfig) -> Reading:
    if "use_qk_norm" in cfg:  # GLM-4.5
        return bool(cfg["use_qk_norm"]), f"use_qk_norm={_show(cfg['use_qk_norm'])}"
    model_type = cfg.get("model_type")
    if model_type in _QK_NORM_TYPES:
        return True, f"model_type={model_type} (QK layernorm)"
    if model_type in _NO_QK_NORM_TYPES:
        return False, f"model_type={model_type} (no QK layernorm)"
    return None


def _qkv_bias(cfg: HFConfig) -> Reading:
    model_type = cfg.get("model_type")
    if model_type in _QKV_BIAS_TYPES:
        return True, f"model_type={model_type} (QKV bias)"
    if "attention_bias" in cfg:
        return bool(cfg["attention_bias"]), f"attention_bias={_show(cfg['attention_bias'])}"
    if model_type in _NO_BIAS_TYPES:
        return False, f"model_type={model_type} (no QKV bias)"
    return None


def _bias_linear(cfg: HFConfig) -> Reading:
    if "mlp_bias" in cfg:
        return bool(cfg["mlp_bias"]), f"mlp_bias={_show(cfg['mlp_bias'])}"
    model_type = cfg.get("model_type")
    if model_type in _NO_BIAS_TYPES:
        return False, f"model_type={model_type} (no linear bias)"
    return None


def _scores_by(cfg: HFConfig) -> str:
    """The router's score function config.json implies (softmax when it says nothing)."""
    reading = _score_function(cfg)
    return "softmax" if reading is None else reading[0]


def _score_function(cfg: HFConfig) -> Reading:
    if "scoring_func" in cfg:  # DeepSeek-V3
        return cfg["scoring_func"], f"scoring_func={cfg['scoring_func']}"
    model_type = cfg.get("model_type")
    if model_type in _SIGMOID_ROUTER_TYPES:
        return "sigmoid", f"model_type={model_type} (sigmoid router)"
    return None


def _expert_bias(cfg: HFConfig) -> Reading:
    """DeepSeek-V3's aux-loss-free balancing: a score bias (``e_score_correction_bias``) that picks
    the experts but does not weight them."""
    if "topk_method" in cfg:
        return cfg["topk_method"] == "noaux_tc", f"topk_method={cfg['topk_method']}"
    model_type = cfg.get("model_type")
    if model_type in _SIGMOID_ROUTER_TYPES:
        return True, f"model_type={model_type} (e_score_correction_bias)"
    return None


def _shared_experts(cfg: HFConfig) -> Reading:
    """DeepSeek-V3 counts its shared experts (``n_shared_experts`` of ``moe_intermediate_size``);
    Megatron takes their total size."""
    shared = cfg.get("n_shared_experts")
    if shared is None or cfg.get("moe_intermediate_size") is None:
        return _key("shared_expert_intermediate_size")(cfg)
    total = shared * cfg["moe_intermediate_size"]
    return (
        total or None
    ), f"n_shared_experts={shared} × moe_intermediate_size={cfg['moe_intermediate_size']}"


def _pre_softmax(cfg: HFConfig) -> Reading:
    # HF takes the top-k of the softmax over all experts and renormalises them when norm_topk_prob is
    # set; Megatron's default (softmax over the top-k logits) is that renormalised form. A sigmoid
    # router always renormalises in Megatron (checked in ``_check_router``).
    if "norm_topk_prob" not in cfg or _scores_by(cfg) != "softmax":
        return None
    norm = bool(cfg["norm_topk_prob"])
    return not norm, f"norm_topk_prob={_show(norm)}"


def _shared_expert_gate(cfg: HFConfig) -> Reading:
    # Qwen2-MoE always multiplies its shared expert by sigmoid(shared_expert_gate(x)).
    if not cfg.get("shared_expert_intermediate_size"):
        return None
    model_type = cfg.get("model_type")
    return model_type == "qwen2_moe", f"model_type={model_type} (shared expert gate)"


@dataclass(frozen=True)
class _Rule:
    dest: str
    flag: str
    read: Callable[[HFConfig], Reading]
    switch: bool = False  # the flag takes no value, so a mismatch is fixed by dropping it
    check: bool = True  # False: only fill when omitted (a different value is a legitimate choice)


_RULES: tuple[_Rule, ...] = (
    _Rule("num_layers", "--num-layers", _key("num_hidden_layers")),
    _Rule("hidden_size", "--hidden-size", _key("hidden_size")),
    _Rule("num_attention_heads", "--num-attention-heads", _key("num_attention_heads")),
    _Rule("ffn_hidden_size", "--ffn-hidden-size", _key("intermediate_size")),
    _Rule("kv_channels", "--kv-channels", _key("head_dim")),
    _Rule("vocab_size", "--vocab-size", _key("vocab_size")),
    _Rule(
        "max_position_embeddings", "--max-position-embeddings", _key("max_position_embeddings"), check=False
    ),
    _Rule("position_embedding_type", "--position-embedding-type", _position_embedding),
    _Rule("mrope_section", "--mrope-section", _mrope_section),
    _Rule("rotary_percent", "--rotary-percent", _rotary_percent),
    _Rule(
        "rotary_interleaved",
        "--rotary-interleaved",
        _by_type(_INTERLEAVED_ROPE_TYPES, "interleaved RoPE"),
        switch=True,
    ),
    _Rule("rotary_base", "--rotary-base", _rope_theta),
    _Rule("use_rope_scaling", "--use-rope-scaling", _use_rope_scaling, switch=True),
    _Rule("rope_scaling_factor", "--rope-scaling-factor", _rope_scaling_factor),
    _Rule("normalization", "--normalization", _normalization),
    _Rule("norm_epsilon", "--norm-epsilon", _key("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")),
    _Rule("swiglu", "--swiglu", _swiglu, switch=True),
    _Rule(
        "untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", _untie, switch=True
    ),
    _Rule("qk_layernorm", "--qk-layernorm", _qk_layernorm, switch=True),
    _Rule(
        "post_self_attn_layernorm",
        "--post-self-attn-layernorm",
        _by_type(_SANDWICH_NORM_TYPES, "post-attention norm"),
        switch=True,
    ),
    _Rule(
        "post_mlp_layernorm",
        "--post-mlp-layernorm",
        _by_type(_SANDWICH_NORM_TYPES, "post-MLP norm"),
        switch=True,
    ),
    _Rule("multi_latent_attention", "--multi-latent-attention", _multi_latent_attention, switch=True),
    _Rule("q_lora_rank", "--q-lora-rank", _mla_key("q_lora_rank")),
    _Rule("kv_lora_rank", "--kv-lora-rank", _mla_key("kv_lora_rank")),
    _Rule("qk_head_dim", "--qk-head-dim", _mla_key("qk_nope_head_dim")),
    _Rule("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", _mla_key("qk_rope_head_dim")),
    _Rule("v_head_dim", "--v-head-dim", _mla_key("v_head_dim")),
    _Rule("rope_type", "--rope-type", _rope_type),
    _Rule("rotary_scaling_factor", "--rotary-scaling-factor", _yarn("factor")),
    _Rule("mscale", "--mscale", _yarn("mscale")),
    _Rule("mscale_all_dim", "--mscale-all-dim", _yarn("mscale_all_dim")),
    _Rule(
        "original_max_position_embeddings",
        "--original-max-position-embeddings",
        _yarn("original_max_position_embeddings", int),
    ),
    _Rule("beta_fast", "--beta-fast", _yarn("beta_fast")),
    _Rule("beta_slow", "--beta-slow", _yarn("beta_slow")),
    _Rule("add_qkv_bias", "--add-qkv-bias", _qkv_bias, switch=True),
    _Rule("add_bias_linear", "--disable-bias-linear", _bias_linear, switch=True),
    _Rule("num_experts", "--num-experts", _key("num_experts", "num_local_experts", "n_routed_experts")),
    _Rule("moe_router_topk", "--moe-router-topk", _key("num_experts_per_tok")),
    _Rule("moe_ffn_hidden_size", "--moe-ffn-hidden-size", _key("moe_intermediate_size")),
    _Rule("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", _shared_experts),
    _Rule("moe_router_score_function", "--moe-router-score-function", _score_function),
    _Rule("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", _expert_bias, switch=True),
    _Rule("moe_router_num_groups", "--moe-router-num-groups", _key("n_group")),
    _Rule("moe_router_group_topk", "--moe-router-group-topk", _key("topk_group")),
    _Rule(
        "moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor", _key("routed_scaling_factor")
    ),
    _Rule("moe_router_pre_softmax", "--moe-router-pre-softmax", _pre_softmax, switch=True),
    _Rule("moe_shared_expert_gate", "--moe-shared-expert-gate", _shared_expert_gate, switch=True),
)


def _same(a: Any, b: Any) -> bool:
    def is_number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if is_number(a) and is_number(b):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return bool(a == b)


def _mismatch(flag: str, given: Any, desc: str, fix: str, path: str) -> ConfigError:
    return ConfigError(flag, f"{given} does not match {desc} in {path}; {fix} {_SOURCE_HINT}")


def apply_hf_config(
    args: argparse.Namespace, config: dict[str, Any], path: str, given: Callable[[str], bool]
) -> None:
    """Fill omitted model flags from ``config`` and check the given ones against it."""
    for rule in _RULES:
        reading = rule.read(config)
        if reading is None:
            continue
        value, desc = reading
        if not given(rule.dest):
            setattr(args, rule.dest, value)
        elif rule.check and not _same(getattr(args, rule.dest), value):
            if rule.switch:
                message = f"given, but {path} has {desc}; drop {rule.flag} {_SOURCE_HINT}"
                raise ConfigError(rule.flag, message)
            shown = " ".join(map(str, value)) if isinstance(value, list) else value  # nargs="+" flags
            fix = f"use {rule.flag} {shown}"
            raise _mismatch(rule.flag, getattr(args, rule.dest), desc, fix, path)
    _apply_query_groups(args, config, path, given)
    _apply_moe_layer_freq(args, config, path, given)
    _check_router(config, path)


def _check_router(config: dict[str, Any], path: str) -> None:
    """Routings megatron-core computes differently from transformers: one line before anything starts."""
    topk = config.get("num_experts_per_tok") or 1
    if _scores_by(config) == "sigmoid" and config.get("norm_topk_prob") is False and topk > 1:
        raise ConfigError(
            "--moe-router-score-function",
            f"sigmoid with norm_topk_prob=false in {path}: megatron-core always renormalises the "
            "top-k sigmoid scores; this checkpoint cannot be trained as it is",
        )
    groups, group_topk = config.get("n_group") or 1, config.get("topk_group") or 1
    if groups > 1 and topk // group_topk != 2:
        # transformers scores a group by its 2 best experts, megatron-core by its best topk/group_topk.
        raise ConfigError(
            "--moe-router-num-groups",
            f"n_group={groups} with num_experts_per_tok={topk}, topk_group={group_topk} in {path}: "
            "megatron-core scores an expert group by its best num_experts_per_tok/topk_group experts, "
            "transformers by its best 2, so they route differently; it cannot be trained as it is",
        )


def _apply_query_groups(
    args: argparse.Namespace, config: dict[str, Any], path: str, given: Callable[[str], bool]
) -> None:
    """GQA is two Megatron flags for one HF key, so it gets its own rule.

    Without ``--group-query-attention`` Megatron ignores ``--num-query-groups`` (every head is its
    own group); a config with fewer KV heads than heads therefore turns GQA on when the flag was
    left out, and a given ``--num-query-groups`` must equal ``num_key_value_heads``.
    """
    heads = args.num_attention_heads
    kv_heads = config.get("num_key_value_heads")
    if kv_heads is None:
        kv_heads = config.get("num_attention_heads")  # HF's default: plain multi-head attention
    if kv_heads is None or heads is None:
        return
    if not given("group_query_attention"):
        args.group_query_attention = kv_heads != heads
    if given("num_query_groups"):
        if args.num_query_groups != kv_heads:
            desc = f"num_key_value_heads={kv_heads}"
            fix = f"use --num-query-groups {kv_heads}"
            raise _mismatch("--num-query-groups", args.num_query_groups, desc, fix, path)
    else:
        args.num_query_groups = kv_heads


def _layer_pattern(freq: int | list[int], num_layers: int) -> list[int]:
    """Megatron's per-layer MoE pattern (1 = MoE layer) of ``--moe-layer-freq``."""
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(num_layers)]
    return list(freq)


def _apply_moe_layer_freq(
    args: argparse.Namespace, config: dict[str, Any], path: str, given: Callable[[str], bool]
) -> None:
    """HF says which layers are sparse with two keys, Megatron with one pattern, so this gets its own rule.

    HF (Qwen-MoE): layer i is an MoE layer unless listed in ``mlp_only_layers``, and only if
    ``(i + 1) % decoder_sparse_step == 0``; (DeepSeek-V3, GLM-4.5) if ``i >= first_k_dense_replace``.
    Megatron's integer N means ``i % N == 0`` instead, so the pattern is compared (and filled) layer
    by layer.
    """
    num_layers = args.num_layers
    if args.num_experts is None or num_layers is None:
        return
    if "decoder_sparse_step" in config:  # Qwen-MoE
        step, dense = config["decoder_sparse_step"], set(config.get("mlp_only_layers") or [])
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]
        desc = f"decoder_sparse_step={step}, mlp_only_layers={sorted(dense)}"
    elif "first_k_dense_replace" in config:  # DeepSeek-V3, GLM-4.5: the first k layers are dense
        first = config["first_k_dense_replace"]
        pattern = [int(i >= first) for i in range(num_layers)]
        desc = f"first_k_dense_replace={first}"
    else:
        return
    if not given("moe_layer_freq"):
        args.moe_layer_freq = 1 if all(pattern) else pattern
    elif _layer_pattern(args.moe_layer_freq, num_layers) != pattern:
        fix = "use --moe-layer-freq " + ("1" if all(pattern) else str(pattern).replace(" ", ""))
        raise _mismatch("--moe-layer-freq", args.moe_layer_freq, desc, fix, path)
