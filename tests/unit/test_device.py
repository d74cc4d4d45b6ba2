"""The CPU seam of ``slime.utils.device``, checked in a process of its own (it changes torch globally)."""

import dataclasses
import subprocess
import sys

from slime.utils.device import missing_fusion_kernels

PROBE = """
import torch
from slime.utils.device import setup_device

compiled = []

def backend(graph, example_inputs):
    compiled.append(graph)
    return graph.forward

@torch.compile(backend=backend)
def bias_update(counts):
    return (counts.float() - counts.float().mean()).sign()

assert setup_device().type == "cpu"
out = bias_update(torch.tensor([3, 1, 2, 2]))
print(len(compiled), out.tolist())
"""


def test_torch_compile_runs_eagerly_on_the_cpu():
    """megatron-core's ``jit_fuser`` is ``torch.compile``: on the CPU its helpers must run as plain torch,
    not be handed to a compiler backend (inductor built C++ for 28 s in a DeepSeek-V3 run)."""
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "0 [1.0, -1.0, 0.0, 0.0]"


MEGATRON_PROBE = """
import sys
import torch
compile_ = torch.compile
from slime.utils.device import import_megatron_core
import_megatron_core()  # what a trainer rank does first (TrainerActor.init)
from megatron.core.activations import squared_relu
print(torch.compile is compile_, "torch._inductor" in sys.modules, hasattr(squared_relu, "__wrapped__"))
"""


def test_megatron_core_is_imported_without_torch_compile_on_the_cpu():
    """Its ``@jit_fuser`` helpers are plain functions (not dynamo wrappers), inductor is never imported
    (2.1 s of every trainer process's start), and ``torch.compile`` is torch's own again afterwards."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", MEGATRON_PROBE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "True False False"


def test_cpu_worker_threads_split_the_cores_and_engines_leave_one_to_the_http_path(monkeypatch):
    """Trainers share a node's cores; engines share them less one, which their HTTP path (server
    thread, router, rollout manager) uses beside each forward; never fewer than one thread."""
    from slime.utils import hardware as device

    monkeypatch.setattr(device, "has_gpu", lambda: False)
    monkeypatch.delenv("SLIME_WORKER_THREADS", raising=False)
    threads = lambda env: int(env["OMP_NUM_THREADS"])  # noqa: E731
    cases = [(2, 1, 2, 1), (2, 2, 1, 1), (16, 1, 16, 15), (16, 2, 8, 7), (1, 1, 1, 1)]
    for cores, per_node, trainer, engine in cases:
        monkeypatch.setattr(device.os, "cpu_count", lambda cores=cores: cores)
        assert threads(device.worker_env(per_node)) == trainer
        assert threads(device.engine_env(per_node)) == engine
    monkeypatch.setenv("SLIME_WORKER_THREADS", "3")
    assert threads(device.engine_env(1)) == 3


def test_a_gpu_node_without_te_or_apex_turns_off_only_the_fusions_it_lacks():
    """Seen on an H200 without Transformer Engine: megatron-core refused apply_rope_fusion at config time."""
    assert missing_fusion_kernels(lambda module: False) == [
        "apply_rope_fusion",
        "moe_permute_fusion",
        "gradient_accumulation_fusion",
        "masked_softmax_fusion",
        "persist_layer_norm",
    ]
    assert missing_fusion_kernels(lambda module: module == "transformer_engine") == [
        "gradient_accumulation_fusion"
    ]
    apex_only = {"apex", "fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda"}
    assert missing_fusion_kernels(apex_only.__contains__) == ["apply_rope_fusion", "moe_permute_fusion"]
    assert missing_fusion_kernels(lambda module: True) == []


def test_the_overlapped_loop_splits_a_cpu_node_between_trainer_ranks_and_engines():
    """train_async.py generates while it trains: each side counts the other's processes on the node
    (2 cores, 1 rank, 1 engine: one thread each); train.py's sides take turns and count none."""
    from slime.config.settings.cluster import ClusterSettings

    cluster = ClusterSettings(
        actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=4, rollout_num_gpus_per_engine=2,
        num_gpus_per_node=8, colocate=False, critic_num_nodes=1, critic_num_gpus_per_node=0,
        has_critic=False, debug_rollout_only=False, debug_train_only=False, uses_engines=True,
        ray_address=None, external_engine_addrs=(), engine_api_key=None,
    )  # fmt: skip
    assert cluster.cpu_neighbours == {"trainer": 0, "engine": 0}
    overlapped = dataclasses.replace(cluster, overlapped=True)
    assert overlapped.cpu_neighbours == {"trainer": 2, "engine": 2}
    no_engines = dataclasses.replace(overlapped, uses_engines=False)
    assert no_engines.cpu_neighbours == {"trainer": 0, "engine": 0}
