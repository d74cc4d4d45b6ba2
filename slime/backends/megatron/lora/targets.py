"""Which Megatron linears carry an adapter, from the HF module names of ``--target-modules``.

Megatron fuses q, k, v into ``linear_qkv`` and gate, up into ``linear_fc1``: one adapter serves the
fused layer (A shared, B with the fused rows), so a fused layer's HF modules are targeted all or none
(interface 3). Pure Python: ``slime.config.validate`` checks flags with it before anything imports torch.
"""

from __future__ import annotations

LAYER_MODULES: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
"""A dense decoder layer's Megatron linear (path inside the layer) -> the HF modules it holds, in the
order the converter fuses them."""

MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def partly_targeted(targets: tuple[str, ...]) -> tuple[str, ...] | None:
    """The HF modules of a fused layer of which ``targets`` names some but not all; None if none is."""
    for modules in LAYER_MODULES.values():
        named = [m for m in modules if m in targets]
        if named and len(named) < len(modules):
            return modules
    return None


def targeted_layers(targets: tuple[str, ...]) -> list[str]:
    """The Megatron linears (paths inside a layer) that get adapters."""
    return [path for path, modules in LAYER_MODULES.items() if modules[0] in targets]


def peft_target_modules(targets: tuple[str, ...]) -> list[str]:
    """``adapter_config.json``'s ``target_modules``: the HF modules that really carry an adapter
    (``all-linear``'s MLA names are left out on a model without them)."""
    return [m for path in targeted_layers(targets) for m in LAYER_MODULES[path]]


ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_param(name: str) -> bool:
    """A LoRA tensor of the Megatron model (``<linear>.lora_A.weight`` / ``.lora_B.weight``): not part
    of the HF checkpoint, so the full-model conversions leave it out."""
    return name.endswith(ADAPTER_SUFFIXES)
