"""What the Megatron flags become in megatron-core's ``TransformerConfig``."""

from __future__ import annotations

from slime.config import parse_args
from slime.config.settings.run import RunSettings
from slime.utils.device import import_megatron_core
from tests.support.models import model_args


def test_attention_backend_and_cpu_kernel_overrides_reach_the_transformer_config(tiny_models, reverse_task):
    """``--attention-backend`` was accepted but never passed on; on the CPU the fused kernels are off."""
    import_megatron_core()
    from megatron.core.transformer.enums import AttnBackend

    from slime.backends.megatron.config import transformer_config

    flags = [*model_args("tiny-qwen2.sh"), "--hf-checkpoint", str(tiny_models["qwen2"])]
    flags += [
        "--prompt-data",
        str(reverse_task),
        "--rollout-batch-size",
        "4",
        "--num-rollout",
        "1",
        "--rollout-num-gpus",
        "1",
    ]
    settings = RunSettings.from_args(parse_args([*flags, "--attention-backend", "flash"]))
    config = transformer_config(settings.trainer)
    assert config.attention_backend == AttnBackend.flash
    assert not config.apply_rope_fusion and not config.gradient_accumulation_fusion
    default = transformer_config(RunSettings.from_args(parse_args(flags)).trainer)
    assert default.attention_backend == AttnBackend.auto
