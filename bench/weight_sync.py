"""Weight-sync throughput of slime's two live paths, each against the raw transfer of the same bytes.

- distributed: ``DistributedWeightUpdater`` (announce a flattened per-dtype bucket over HTTP, broadcast
  it in one collective over the trainer-engine process group, the engine loads it) into a real torch
  engine, vs a raw ``torch.distributed`` broadcast of the same bytes, in buckets of the same size, to a
  process that does nothing but receive them (same group kind, same backend: gloo here, NCCL on GPUs).
- tensor (colocated): ``TensorWeightUpdater`` (pack each bucket into one buffer, hand its shared-memory
  handle to the engine through ``/update_weights_from_tensor``, the engine copies it into its weights),
  vs a raw memcpy of the same bytes in buckets of the same size.

Both updaters are the classes the trainer runs, fed by a stand-in trainer whose ``iter_hf_weights``
yields an HF checkpoint's tensors (fresh values each round, checked on the engine afterwards). Rounds
alternate and the best of ``--repeats`` counts, because the machines this runs on are shared.

    python bench/weight_sync.py                         # qwen2-shaped, hidden 1024, 4 layers (~170 MB)
    python bench/weight_sync.py --hidden-size 512 --num-layers 2 --repeats 5

Writes bench/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slime.backends.engine_server import start_engine_server  # noqa: E402
from slime.backends.torch_engine.launcher import serving  # noqa: E402
from slime.backends.torch_engine.weights import iter_safetensors  # noqa: E402
from slime.engine_client.weight_updates import weight_update_session  # noqa: E402
from slime.utils.http import free_port, get_json, post_json_sync  # noqa: E402
from slime.weight_sync import ipc  # noqa: E402
from slime.weight_sync.bucketing import iter_buckets, iter_packed_buckets  # noqa: E402
from slime.weight_sync.process_group import broadcast_from_rank0, create_weight_update_group  # noqa: E402

RESULTS = REPO / "bench" / "results" / "weight_sync.json"


class StandInTrainer:
    """What the updaters read from a trainer rank: its weights as full HF tensors (on any device;
    tests/gpu/check_gpu.py uses it too)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def perturb(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for tensor in self.state.values():  # drawn on the CPU, so the values do not depend on the device
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 0.02
            tensor.copy_(noise.to(tensor.device))

    def iter_hf_weights(self):
        yield from self.state.items()


def raw_receiver(address: str, port: int, sizes: list[int], rounds: int) -> None:
    """The raw broadcast's other end: joins the same kind of group and receives every bucket."""
    torch.set_num_threads(1)
    group = create_weight_update_group(address, port, 1, 2, "raw", "gloo")
    buffers = [torch.empty(size, dtype=torch.uint8) for size in sizes]
    for _ in range(rounds):
        for buffer in buffers:
            broadcast_from_rank0(group, buffer, 300)


def bucket_sizes(state: dict[str, torch.Tensor], max_bytes: int) -> list[int]:
    return [sum(t.numel() * t.element_size() for _, t in b) for b in iter_buckets(state.items(), max_bytes)]


def check_engine(url: str, state: dict[str, torch.Tensor]) -> None:
    for name in ("model.norm.weight", next(iter(state))):
        got = torch.tensor(post_json_sync(f"{url}/get_weights_by_name", {"name": name, "truncate_size": 4}))
        want = state[name][:4].float()
        if not torch.equal(got.reshape(want.shape), want):
            raise AssertionError(f"engine weight {name} differs from the trainer's after the update")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)

    from megatron.core import parallel_state as mpu

    from slime.config.settings.weight_sync import WeightSyncSettings
    from slime.weight_sync.distributed import DistributedWeightUpdater
    from slime.weight_sync.tensor import TensorWeightUpdater
    from tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench_weight_sync_"))
    model = make_tiny_model(
        work / "model",
        hidden_size=cli.hidden_size,
        num_layers=cli.num_layers,
        num_attention_heads=cli.hidden_size // 64,
        num_key_value_heads=cli.hidden_size // 128,
        intermediate_size=cli.hidden_size * 4,
    )
    state = {name: tensor.clone() for name, tensor in iter_safetensors(str(model))}
    total = sum(t.numel() * t.element_size() for t in state.values())
    bucket_bytes = cli.bucket_mb * 2**20
    sizes = bucket_sizes(state, bucket_bytes)

    threads = {"OMP_NUM_THREADS": str(cli.threads)}
    engine = start_engine_server(
        "torch engine", serving(model), work / "engine.log", timeout_s=300, env=threads
    )
    url = engine.url

    # The updaters ask torch.distributed and Megatron for their ranks: a world of one trainer rank.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mpu.initialize_model_parallel()
    settings = WeightSyncSettings("distributed", bucket_bytes=bucket_bytes, timeout_s=300.0)
    trainer = StandInTrainer(state)
    distributed = DistributedWeightUpdater(settings, trainer)
    distributed.connect([url])
    tensor = TensorWeightUpdater(settings, trainer)
    tensor.connect([url])

    raw_port = free_port()
    receiver = mp.get_context("spawn").Process(
        target=raw_receiver, args=("127.0.0.1", raw_port, sizes, cli.repeats), daemon=True
    )
    receiver.start()
    raw_group = create_weight_update_group("127.0.0.1", raw_port, 0, 2, "raw", "gloo")
    sources = [torch.randint(0, 255, (size,), dtype=torch.uint8) for size in sizes]
    targets = [torch.empty_like(source) for source in sources]

    staging = (ipc.StagingBuffer(), ipc.StagingBuffer())
    keys = ("distributed", "raw_broadcast", "tensor", "raw_memcpy", "tensor_pack_only")
    best = dict.fromkeys(keys, float("inf"))
    for round_ in range(cli.repeats):
        trainer.perturb(2 * round_)
        start = time.perf_counter()
        with weight_update_session([url], 300):  # as TrainingSession.push_weights opens it
            distributed.update(f"d{round_}")
        best["distributed"] = min(best["distributed"], time.perf_counter() - start)
        check_engine(url, state)

        start = time.perf_counter()
        for source in sources:
            broadcast_from_rank0(raw_group, source, 300)
        best["raw_broadcast"] = min(best["raw_broadcast"], time.perf_counter() - start)

        trainer.perturb(2 * round_ + 1)
        start = time.perf_counter()
        with weight_update_session([url], 300):
            tensor.update(f"t{round_}")
        best["tensor"] = min(best["tensor"], time.perf_counter() - start)
        check_engine(url, state)

        start = time.perf_counter()
        for source, target in zip(sources, targets, strict=True):
            target.copy_(source)
        best["raw_memcpy"] = min(best["raw_memcpy"], time.perf_counter() - start)

        # Where the tensor path's time goes: packing alone, as the updater packs (warm staging buffers).
        start = time.perf_counter()
        for _ in iter_packed_buckets(state.items(), bucket_bytes, staging):
            pass
        best["tensor_pack_only"] = min(best["tensor_pack_only"], time.perf_counter() - start)
    assert get_json(f"{url}/model_info")["weight_version"] == f"t{cli.repeats - 1}"

    distributed.disconnect()
    receiver.join(60)
    engine.stop()
    shutil.rmtree(work)  # the checkpoint and the engine's log (kept when a run fails)
    raw_group.shutdown()
    dist.destroy_process_group()

    gbps = {key: total / seconds / 1e9 for key, seconds in best.items()}
    result = {
        "bytes": total,
        "num_tensors": len(state),
        "bucket_bytes": bucket_bytes,
        "num_buckets": len(sizes),
        "repeats": cli.repeats,
        "threads": cli.threads,
        "seconds_best": best,
        "GB_per_s": gbps,
        "ratio_distributed_vs_raw_broadcast": best["raw_broadcast"] / best["distributed"],
        "ratio_tensor_vs_raw_memcpy": best["raw_memcpy"] / best["tensor"],
        "target_ratio": 0.7,
        "why": {
            "distributed": "per bucket the trainer packs one flattened buffer per dtype (overlapped with the "
            "previous bucket's broadcast), announces it over HTTP and broadcasts it in one collective into "
            "the engine's reused receive buffer, as the raw run does; but the engine must then copy the "
            "bytes out of that buffer into its parameters before it answers, and the next bucket waits "
            "for that answer (SGLang's protocol), so on CPU every byte costs a gloo broadcast plus a "
            "memcpy: about 0.6 of raw at best here. On GPUs the broadcast runs at network or NVLink speed "
            "and the device copy at HBM speed, so that copy costs a few percent",
            "tensor": "the raw run copies each byte once between warm buffers; the handoff copies it "
            "twice (the trainer packs it into a warm shared staging buffer, the engine copies it out of "
            "the mapped buffer into its parameters), plus an HTTP call, the unpickling and the mapping "
            "per bucket. Packing the next bucket overlaps the engine's copy of the current one, but both "
            "copies draw on the memory bandwidth a raw memcpy saturates, so the handoff lands near 0.5 "
            "(on GPUs too: CUDA IPC saves the trip through host memory, not the second device copy). "
            "tensor_pack_only is the trainer's copy alone",
        },
        "model": {"hidden_size": cli.hidden_size, "num_layers": cli.num_layers, "dtype": "float32"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "backend": "gloo / shared memory (CPU)" if not torch.cuda.is_available() else "cuda",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
