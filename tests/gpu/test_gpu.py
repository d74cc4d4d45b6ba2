"""The GPU checks of ``check_gpu.py`` as tests; skipped cleanly on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.e2e,
    pytest.mark.slow,
]


def test_gpu_checks_pass():
    from check_gpu import run_checks

    results = run_checks(handoff_gb=0.5)
    assert results["megatron_bf16_train_step"]["changed"] > 0
    assert results["cuda_ipc_handoff_two_processes"]["GB_per_s"] > 0
