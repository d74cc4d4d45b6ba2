"""Write a tiny, randomly initialised HF-format causal LM (config, safetensors, tokenizer) to a directory.

No machine this project is built on reaches a model hub, yet the code that loads real checkpoints
(HF -> Megatron conversion, the rollout engines, weight sync, the quickstart) needs one to run on.
This tool generates a real checkpoint locally: Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / Llama / GLM-4 /
GLM-4.5 (``glm4_moe``) / DeepSeek-V3 architectures built by transformers itself from a config
(``FAMILY_TRAITS`` gives each family the traits that set it apart, at tiny sizes), fp32 weights in
safetensors, and a character-level tokenizer with Qwen's ChatML special tokens and chat template, so
every loader sees the same files a real model has. ``qwen2_5_vl`` adds a vision tower (``VISION_TRAITS``)
and the image processor's ``preprocessor_config.json``: a tiny Qwen2.5-VL for the multimodal paths.

Usage:
    python tools/make_tiny_model.py --out /tmp/tiny-qwen2
    python tools/make_tiny_model.py --out /tmp/tiny-qwen3 --arch qwen3 --num-layers 4 --seed 1
    python tools/make_tiny_model.py --out /tmp/tiny-qwen3-moe --arch qwen3_moe --untie-embeddings
    python tools/make_tiny_model.py --out /tmp/tiny-qwen2.5-vl --arch qwen2_5_vl

The call is idempotent: a directory that already holds a model made with the same settings (recorded
in ``slime_tiny_model.json``) is returned as is, so tests and examples can call it unconditionally.
``scripts/models/tiny-qwen2.sh`` holds the Megatron flags of the default model,
``scripts/models/tiny-qwen3-moe.sh`` those of the default ``qwen3_moe`` one (untied embeddings).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import string
import sys
import tempfile
from pathlib import Path
from typing import Any

SETTINGS_FILE = "slime_tiny_model.json"
FORMAT_VERSION = 1
ARCHITECTURES = (
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "llama",
    "glm4",
    "glm4_moe",
    "deepseek_v3",
    "qwen2_5_vl",
)
MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3")
VLM_ARCHITECTURES = ("qwen2_5_vl",)
VOCAB_MULTIPLE = 16

# Special tokens first, so their ids are small and fixed: 0 is both end-of-text and padding.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# One token per character; nothing else is in the vocabulary (there are no merges).
CHARACTERS = (
    string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + " \n"
    + "+-*/=()[]{}<>.,:;!?'\"_\\|#$%&^~@`"
)

# Qwen's ChatML, without Qwen2.5's default system prompt: every turn is
# "<|im_start|>ROLE\nCONTENT<|im_end|>\n"; add_generation_prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2-VL's vision tokens, appended after the text vocabulary (ids 99-102) so that the text archs' ids
# stay as they are. An image is "<|vision_start|><|image_pad|><|vision_end|>" in a prompt; the processor
# repeats <|image_pad|> once per merged patch, and the model's config names all four ids.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# CHAT_TEMPLATE with Qwen2-VL's content parts: a message's content is a string, or a list of
# {"type": "text", "text": ...} / {"type": "image"} / {"type": "video"} parts, each image one
# "<|vision_start|><|image_pad|><|vision_end|>" in place (as Qwen2.5-VL's template renders it).
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The vision tower at tiny size, with Qwen2.5-VL's patching (14-pixel patches, 2 frames per temporal
# patch, 2x2 patches merged into one token): 4 heads of 16, windowed attention in block 0 and full
# attention in block 1 (as the published models alternate them). The window of 56 pixels is 2x2 merged
# tokens, so a 56x56 image spans one window and a larger one several. min_pixels = 56*56 makes a
# 56x56 image 4x4 patches, i.e. 4 image tokens; max_pixels = 112*112 caps any image at 16.
VISION_TRAITS: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "tokens_per_second": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
}

# The split Qwen2's tokenizer applies before its byte-level step. The tokenizer here uses the very same
# pipeline (split, byte-level, BPE without merges) because transformers 5 loads any checkpoint whose
# config says model_type "qwen2" with its own Qwen2Tokenizer class, which rebuilds that pipeline from the
# vocabulary in tokenizer.json; with an identical pipeline every loader produces identical ids.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level tokenizers.

    Printable Latin-1 bytes stand for themselves; the others (space, newline, control bytes) are moved
    to code points from 256 on, in byte order, so space becomes 'Ġ' and newline 'Ċ' as in Qwen's vocab.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping: dict[int, str] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def _vocabulary() -> dict[str, int]:
    """Token string -> id: the special tokens, then one byte-level symbol per character in CHARACTERS."""
    byte_map = _byte_to_unicode()
    tokens = [*SPECIAL_TOKENS, *(byte_map[ord(ch)] for ch in CHARACTERS)]
    assert len(set(tokens)) == len(tokens), "duplicate characters in the tiny vocabulary"
    return {token: index for index, token in enumerate(tokens)}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _settings(
    arch: str,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    head_dim: int | None,
    tie_word_embeddings: bool,
    rope_theta: float,
    rms_norm_eps: float,
    max_position_embeddings: int,
    seed: int,
    moe: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Validate the arguments and return the canonical settings record (also the idempotence key)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    for name, value in (
        ("num_layers", num_layers),
        ("hidden_size", hidden_size),
        ("num_attention_heads", num_attention_heads),
        ("num_key_value_heads", num_key_value_heads),
        ("intermediate_size", intermediate_size),
        ("max_position_embeddings", max_position_embeddings),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({num_key_value_heads})"
        )
    if arch in VLM_ARCHITECTURES and head_dim not in (None, hidden_size // num_attention_heads):
        raise ValueError(
            f"{arch} derives head_dim from hidden_size / num_attention_heads; got head_dim={head_dim}"
        )
    if head_dim is None:
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by num_attention_heads "
                f"({num_attention_heads}) unless head_dim is given"
            )
        head_dim = hidden_size // num_attention_heads
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number (RoPE rotates pairs), got {head_dim}")
    if rope_theta <= 0 or rms_norm_eps <= 0:
        raise ValueError("rope_theta and rms_norm_eps must be positive")
    extra = _moe_settings(moe) if arch in MOE_ARCHITECTURES else {}
    if arch in VLM_ARCHITECTURES:
        extra["vision"] = dict(VISION_TRAITS)  # part of the idempotence key, so a changed tower is rebuilt
    return {
        "format_version": FORMAT_VERSION,
        "arch": arch,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "head_dim": head_dim,
        "tie_word_embeddings": bool(tie_word_embeddings),
        "rope_theta": float(rope_theta),
        "rms_norm_eps": float(rms_norm_eps),
        "max_position_embeddings": max_position_embeddings,
        "seed": int(seed),
        **extra,
    }


def _moe_settings(moe: dict[str, int] | None) -> dict[str, int]:
    """The expert sizes of an MoE arch; dense archs record none, so their settings files stay as they were."""
    moe = moe or {}
    for name, value in moe.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if moe["num_experts_per_tok"] > moe["num_experts"]:
        raise ValueError(
            f"num_experts_per_tok ({moe['num_experts_per_tok']}) exceeds num_experts ({moe['num_experts']})"
        )
    return dict(moe)


def _read_settings(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(directory: Path, settings: dict[str, Any]) -> bool:
    """True when ``directory`` holds a finished model made with exactly ``settings``."""
    if _read_settings(directory) != settings:
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if settings["arch"] in VLM_ARCHITECTURES:
        needed += ("preprocessor_config.json",)
    return all((directory / name).is_file() for name in needed)


def _build_tokenizer(max_length: int) -> Any:
    """The character-level tokenizer, as a transformers fast tokenizer ready for ``save_pretrained``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    # A BPE model with no merges is a plain lookup: every pre-token splits into single byte-level
    # symbols, each of which is in the vocabulary. Characters outside it have no symbol and are dropped,
    # exactly as Qwen2Tokenizer (which transformers 5 substitutes for model_type qwen2) would drop them.
    model = BPE(vocab=_vocabulary(), merges=[], unk_token=None, fuse_unk=False, byte_fallback=False)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # Special tokens are matched before pre-tokenization, so "<|im_start|>" is always one token.
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        # Decoding must give back the exact text (no " ." -> "." clean-up), or round trips break.
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# What sets each newer family apart, at tiny sizes (the published models' choices where they are
# not sizes): GLM-4's partial interleaved RoPE and q/k/v bias; GLM-4.5's first dense layer, shared
# expert, sigmoid routing with the score bias and q/k norms; DeepSeek-V3's multi-latent attention
# with YaRN, and group-limited routing (2 groups, 1 per token: each group scored by its best 2, the
# rule megatron-core and transformers share when top-k / groups per token = 2).
FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    "glm4": {"partial_rotary_factor": 0.5, "attention_bias": True},
    "glm4_moe": {
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": True,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
    },
    "deepseek_v3": {
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "n_group": 2,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "attention_bias": False,
    },
}


def _yarn(settings: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's RoPE block at tiny size: YaRN from a quarter of the context, its betas and mscales."""
    return {
        "rope_type": "yarn",
        "rope_theta": settings["rope_theta"],
        "factor": 4.0,
        "original_max_position_embeddings": settings["max_position_embeddings"] // 4,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


def _patch_json(path: Path, updates: dict[str, Any]) -> None:
    data = json.loads(path.read_text())
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_model(directory: Path, settings: dict[str, Any]) -> None:
    """Build the model and tokenizer and save every file of the checkpoint into ``directory``."""
    import inspect

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig
    from transformers.utils import logging as hf_logging

    arch = settings["arch"]
    tokenizer = _build_tokenizer(settings["max_position_embeddings"])
    chat_template = CHAT_TEMPLATE
    if arch in VLM_ARCHITECTURES:
        tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
        tokenizer.chat_template = chat_template = VLM_CHAT_TEMPLATE
    vocab_size = _round_up(len(tokenizer), VOCAB_MULTIPLE)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)

    config_kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": settings["hidden_size"],
        "intermediate_size": settings["intermediate_size"],
        "num_hidden_layers": settings["num_layers"],
        "num_attention_heads": settings["num_attention_heads"],
        "num_key_value_heads": settings["num_key_value_heads"],
        "head_dim": settings["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": settings["max_position_embeddings"],
        "rms_norm_eps": settings["rms_norm_eps"],
        "rope_theta": settings["rope_theta"],
        "tie_word_embeddings": settings["tie_word_embeddings"],
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }
    derived_head_dim = settings["hidden_size"] // settings["num_attention_heads"]
    if arch in ("qwen2", "qwen2_moe") and settings["head_dim"] == derived_head_dim:
        # Qwen2's own config.json has no head_dim; keep it out unless it differs from the derived value.
        del config_kwargs["head_dim"]
    if arch in ("qwen3", "qwen3_moe", "llama"):
        config_kwargs["attention_bias"] = False  # Qwen2 always has q/k/v bias; these two have none.
    if arch == "llama":
        config_kwargs["mlp_bias"] = False
    if arch in MOE_ARCHITECTURES:
        # Every layer sparse, as in the published configs. Qwen3-MoE renormalises the top-k weights;
        # Qwen2-MoE does not and adds a gated shared expert of twice an expert's width.
        config_kwargs.update(
            num_experts=settings["num_experts"],
            num_experts_per_tok=settings["num_experts_per_tok"],
            moe_intermediate_size=settings["moe_intermediate_size"],
            norm_topk_prob=arch == "qwen3_moe",
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if arch == "qwen2_moe":
        config_kwargs["shared_expert_intermediate_size"] = 2 * settings["moe_intermediate_size"]
    if arch in FAMILY_TRAITS:
        config_kwargs.update(FAMILY_TRAITS[arch])
    if arch in (
        "glm4_moe",
        "deepseek_v3",
    ):  # experts counted as n_routed_experts; Qwen's layer keys do not apply
        config_kwargs["n_routed_experts"] = config_kwargs.pop("num_experts")
        del config_kwargs["decoder_sparse_step"], config_kwargs["mlp_only_layers"]
    if arch == "deepseek_v3":  # MLA: no GQA and no head_dim of its own
        config_kwargs["num_key_value_heads"] = settings["num_attention_heads"]
        del config_kwargs["head_dim"]
        config_kwargs["rope_scaling"] = _yarn(settings)
    if arch in VLM_ARCHITECTURES:
        config = _vlm_config(config_kwargs, settings, tokenizer)
        model_class: Any = AutoModelForImageTextToText
    else:
        config = AutoConfig.for_model(arch, **config_kwargs)
        model_class = AutoModelForCausalLM

    # transformers' own initialisation, under a fixed seed, without disturbing the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings["seed"])
        model = model_class.from_config(config, dtype=torch.float32)
        for name, tensor in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # starts at 0; a trained one picks other experts
                torch.nn.init.normal_(tensor, std=0.3)
    model.generation_config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        # transformers fills a missing top_k with 50, which would make generate() disagree with the
        # trainer's full-softmax log-probs. 0 disables top-k in transformers but SGLang rejects 0 when it
        # takes its defaults from generation_config.json (only -1 or >= 1 are valid there, and -1 crashes
        # transformers' TopKLogitsWarper); top_k = vocab_size keeps every token in both.
        top_k=vocab_size,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    save_kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar is only noise in test logs
    try:
        model.save_pretrained(directory, **save_kwargs)
    finally:
        if progress_bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(directory)

    # Compatibility keys for readers on transformers 4.x (e.g. an SGLang image): transformers 5 stores the
    # RoPE base only under rope_parameters and the dtype only as "dtype", and names a tokenizer class 4.x
    # does not know. Both versions accept these keys, and 4.x reads the chat template from here.
    compat: dict[str, Any] = {"rope_theta": settings["rope_theta"], "torch_dtype": "float32"}
    if arch in ("qwen2_moe", "qwen3_moe"):
        compat["num_experts"] = settings["num_experts"]  # 5.x writes only its alias num_local_experts
    if arch in VLM_ARCHITECTURES:
        compat.update(_vlm_compat(directory / "config.json", settings))
        _write_image_processor(directory, settings)
    _patch_json(directory / "config.json", compat)
    _patch_json(
        directory / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template},
    )
    # Written last: its presence marks a complete checkpoint.
    (directory / SETTINGS_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    _apply_umask(directory)


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary pairs into (time, height, width): [16, 24, 24] of 64 pairs scaled."""
    pairs = head_dim // 2
    time = pairs // 4
    height = (pairs - time) // 2
    return [time, height, pairs - time - height]


def _vlm_config(config_kwargs: dict[str, Any], settings: dict[str, Any], tokenizer: Any) -> Any:
    """The Qwen2.5-VL config: the text arch's keys as its text_config, the tower from VISION_TRAITS.

    The vision tower projects into the language model's width (out_hidden_size), and the token ids the
    model looks for in input_ids (image_token_id for the embedding scatter, vision_start_token_id for the
    3-D RoPE index) are those the tokenizer gives the vision tokens.
    """
    from transformers import Qwen2_5_VLConfig

    text = {key: value for key, value in config_kwargs.items() if key not in ("head_dim", "rope_theta")}
    # Multimodal RoPE: each rotary pair is driven by the time, height or width position of its token.
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": settings["rope_theta"],
        "mrope_section": _mrope_section(settings["head_dim"]),
    }
    vision = {
        key: value for key, value in settings["vision"].items() if key not in ("min_pixels", "max_pixels")
    }
    vision["out_hidden_size"] = settings["hidden_size"]
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=settings["tie_word_embeddings"],
        dtype="float32",
    )


def _vlm_compat(config_path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The keys a transformers 4.x reader (an SGLang image) takes the language model from.

    The published Qwen2.5-VL config.json files are flat (the text sizes at the top level) and give the
    RoPE as rope_scaling {"type": "mrope", "mrope_section": ...}, which 4.x reads from text_config.
    transformers 5 reads that rope_scaling in text_config back as the same default RoPE with the same
    sections; at the top level it would only warn, so it goes in text_config alone.
    """
    text = json.loads(config_path.read_text())["text_config"]
    flat = {key: text[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    flat.update({key: text[key] for key in ("num_attention_heads", "num_key_value_heads", "rms_norm_eps")})
    flat.update({key: text[key] for key in ("max_position_embeddings", "eos_token_id", "pad_token_id")})
    rope = {"type": "mrope", "mrope_section": text["rope_parameters"]["mrope_section"]}
    flat["text_config"] = {**text, "rope_scaling": rope, "rope_theta": settings["rope_theta"]}
    return flat


def _write_image_processor(directory: Path, settings: dict[str, Any]) -> None:
    """preprocessor_config.json: Qwen2-VL's image processor at the tiny pixel range, saved from its PIL class.

    Building it needs no torchvision (which the CPU environment lacks). The file names the processor as
    real checkpoints do ("Qwen2VLImageProcessor"), so AutoImageProcessor picks the PIL backend where
    torchvision is absent and the torchvision one where it is, unless told ``backend="pil"``.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = settings["vision"]
    processor = Qwen2VLImageProcessorPil(
        min_pixels=vision["min_pixels"],
        max_pixels=vision["max_pixels"],
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
    )
    processor.save_pretrained(directory)
    _patch_json(directory / "preprocessor_config.json", {"processor_class": "Qwen2_5_VLProcessor"})


def _apply_umask(directory: Path) -> None:
    """Give the checkpoint ordinary permissions (mkdtemp makes 0700, safetensors may write 0600 files).

    Other users' processes (a Ray worker, an engine in a container) must be able to read it.
    """
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: str = "qwen2",
    num_layers: int = 2,
    hidden_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 512,
    head_dim: int | None = None,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    max_position_embeddings: int = 512,
    seed: int = 0,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    force: bool = False,
) -> Path:
    """Write a tiny HF checkpoint to ``out_dir`` (or reuse the one already there) and return its path.

    The defaults match ``scripts/models/tiny-qwen2.sh``. ``head_dim`` defaults to
    hidden_size / num_attention_heads. The three expert sizes apply to the MoE archs only (every layer
    is an MoE layer there; ``intermediate_size`` is then unused but kept in config.json). The vocabulary
    is padded to a multiple of 16 so that the model has unused embedding rows, as real checkpoints do.
    ``qwen2_5_vl`` takes the language model's sizes from these arguments and its vision tower from
    ``VISION_TRAITS``; transformers 5.25 builds its ``AutoProcessor`` only with torchvision installed,
    so without it load ``AutoTokenizer`` and ``AutoImageProcessor`` (PIL) from the directory instead.

    If ``out_dir`` already holds a model made with the same settings nothing is written (cheap: no torch
    import). A non-empty directory holding anything else raises ``FileExistsError`` unless ``force``, in
    which case its contents are replaced. The checkpoint is built in a temporary sibling directory and
    renamed into place, so a reader never sees a half-written model and concurrent callers asking for
    the same model both succeed.
    """
    settings = _settings(
        arch,
        num_layers,
        hidden_size,
        num_attention_heads,
        num_key_value_heads,
        intermediate_size,
        head_dim,
        tie_word_embeddings,
        rope_theta,
        rms_norm_eps,
        max_position_embeddings,
        seed,
        {
            "num_experts": num_experts,
            "num_experts_per_tok": num_experts_per_tok,
            "moe_intermediate_size": moe_intermediate_size,
        },
    )
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir():
        if _is_complete(out, settings):
            return out
        if any(out.iterdir()) and not force:
            what = "a tiny model with different settings" if _read_settings(out) else "other files"
            raise FileExistsError(
                f"{out} is not empty (it holds {what}); pass force=True / --force to replace it"
            )

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_model(staging, settings)
        if out.is_dir():
            if _is_complete(out, settings):  # another process finished the same model meanwhile
                return out
            if any(out.iterdir()):
                shutil.rmtree(out)  # only reachable with force=True (checked above)
            else:
                out.rmdir()
        try:
            staging.rename(out)
        except OSError:
            if _is_complete(out, settings):  # lost a race against an identical build
                return out
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="make_tiny_model.py",
        description=(
            "Write a tiny random HF causal LM (Qwen2/Qwen3/Qwen2-MoE/Qwen3-MoE/Llama) or Qwen2.5-VL with a "
            "character-level tokenizer."
        ),
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen2")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-key-value-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=None, help="default: hidden size / attention heads")
    parser.add_argument("--untie-embeddings", action="store_true", help="separate output layer weights")
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--rms-norm-eps", type=float, default=1e-6)
    parser.add_argument("--max-position-embeddings", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-experts", type=int, default=4, help="experts per layer (MoE archs)")
    parser.add_argument("--num-experts-per-tok", type=int, default=2, help="top-k routing (MoE archs)")
    parser.add_argument("--moe-intermediate-size", type=int, default=64, help="expert FFN size (MoE archs)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output directory")

    def one_line_error(message: str) -> None:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = one_line_error  # type: ignore[method-assign]
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: one line on success (path, vocab size, special ids), one error line on failure."""
    args = _parse_args(argv)
    try:
        path = make_tiny_model(
            args.out,
            arch=args.arch,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            intermediate_size=args.intermediate_size,
            head_dim=args.head_dim,
            tie_word_embeddings=not args.untie_embeddings,
            rope_theta=args.rope_theta,
            rms_norm_eps=args.rms_norm_eps,
            max_position_embeddings=args.max_position_embeddings,
            seed=args.seed,
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size,
            force=args.force,
        )
    except (ValueError, OSError) as exc:
        print(f"make_tiny_model.py: error: {exc}", file=sys.stderr)
        return 2
    config = json.loads((path / "config.json").read_text())
    ids = ", ".join(f"{tok}={i}" for i, tok in enumerate(SPECIAL_TOKENS))
    print(f"{path}: {config['model_type']}, vocab_size={config['vocab_size']}, {ids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
