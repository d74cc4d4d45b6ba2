"""GPU check for one node: run it where slime will train, before a long job.

    python tests/gpu/check_gpu.py            # prints one line per check, exits 1 if any failed

1. megatron-core on CUDA in bf16: the tiny model from its HF checkpoint, one SFT optimizer step
   (forward, backward, optimizer) through slime's own trainer; loss finite, weights changed.
2. The torch engine on CUDA: started as slime starts engines, one greedy generation over HTTP.
3. Colocated handoff through CUDA IPC: weights packed and serialized by ``slime.weight_sync.ipc`` (the
   code the colocated updater runs) are (a) loaded by the CUDA engine through
   ``/update_weights_from_tensor`` and read back exactly, (b) opened by a second process that
   checksums them, for ``--handoff-gb`` of bf16 tensors, with GB/s.

4. Where SGLang is installed, the real SGLang server on one GPU, started by slime's own launcher:
   its protocol as slime detects it (version, weight-update sessions, load endpoint), a greedy
   generation whose log-probs are compared with transformers, then a distributed push and a tensor
   (CUDA IPC) push through slime's own updaters (``DistributedWeightUpdater``, ``TensorWeightUpdater``,
   inside ``weight_update_session`` where the release has sessions), each followed by a read-back of
   the weights and the largest difference between the engine's log-probs and transformers' on the
   pushed weights.
   The trainer side is a world of one rank holding the weights on the GPU; one GPU cannot hold two
   NCCL ranks, so the distributed push runs over gloo with CUDA tensors.
5. A weight-update broadcast over NCCL to a peer that stops joining: two processes form a two-rank NCCL
   group on the one GPU (each with an ``NCCL_HOSTID`` of its own: NCCL refuses two ranks of one host on
   one device, and with two hosts they meet over its socket transport on loopback), one broadcast
   arrives, then the peer joins no more. The sender's ``wait_for_work`` must end at a stop (an engine's
   refusal) within a poll interval and, without one, at its deadline with one line naming the peer;
   the work's future, done when the kernel is enqueued, must not end the wait.

6. A vision-language model (the tiny Qwen2.5-VL): one bf16 megatron-core step on a picture prompt
   processed by the rollout's own processor (vision tower changed with the language model), and the
   torch engine on CUDA generating from the same picture sent as SGLang's ``image_data``, its prompt
   expanded to the rollout's length. ``--only vlm`` runs these alone.

Without CUDA every check is skipped (exit 0) and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def tiny_model(root: Path) -> Path:
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(root / "qwen2")


def check_megatron_bf16(
    model: Path, root: Path, model_flags: list[str] | None = None, image: str | None = None
) -> dict[str, float]:
    """One bf16 SFT step of megatron-core on CUDA (NCCL world of one) through ``MegatronTrainer``;
    ``model_flags`` default to the tiny Qwen2 script's ([]: every model flag from config.json). With
    ``image`` (a VLM) every sample's prompt shows that picture, processed as the rollout does."""
    from slime.backends.megatron.policy_inputs import step_shard
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.config import parse_args
    from slime.config.settings.trainer import TrainerSettings
    from slime.utils.http import free_port
    from tests.support.models import model_args

    args = parse_args(
        [
            *(model_args() if model_flags is None else model_flags),
            "--hf-checkpoint", str(model),
            "--debug-train-only",
            "--loss-type", "sft_loss",
            "--bf16",
            "--rollout-batch-size", "4",
            "--global-batch-size", "4",
            "--micro-batch-size", "2",
            "--lr", "1e-3",
            "--lr-decay-style", "constant",
            "--num-rollout", "1",
        ]
    )  # fmt: skip
    settings = TrainerSettings.from_args(args)
    trainer = MegatronTrainer(settings, args, 0, 1, "127.0.0.1", free_port())
    try:
        gen = torch.Generator().manual_seed(0)
        data: dict[str, list] = {"tokens": [], "response_lengths": [], "loss_masks": []}
        prompt, pictures = [], None
        if image is not None:
            prompt, pictures = vlm_prompt(model, image)
            data["multimodal_train_inputs"] = []
        for i in range(4):
            data["tokens"].append(prompt + torch.randint(3, 40, (12 + i,), generator=gen).tolist())
            data["response_lengths"].append(4)
            data["loss_masks"].append([1] * 4)
            if pictures is not None:
                data["multimodal_train_inputs"].append(pictures)
        # as a trainer rank prepares its shard
        data = step_shard(data, 0, 1, 0, 1, settings.loss.loss_agg_mode)
        before = {name: t.clone() for name, t in trainer.iter_hf_weights()}
        assert all(t.is_cuda for t in before.values()), "the trainer's weights are not on CUDA"
        torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer.train_step(data)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        after = dict(trainer.iter_hf_weights())
        changed = [n for n in before if not torch.equal(before[n], after[n])]
        assert torch.isfinite(torch.tensor(metrics["loss"])), metrics
        assert changed, "no weight changed after an optimizer step"
        result = {"step_s": seconds, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
        result |= {"changed": len(changed), "tensors": len(before)}
        if image is not None:
            visual = [n for n in changed if n.startswith("visual.")]
            assert visual, "the vision tower did not change"
            result["visual_changed"] = len(visual)
        return result
    finally:
        trainer.close()


def vlm_prompt(model: Path, image: str) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A prompt showing ``image`` and its processor tensors, made by the rollout's own code."""
    import argparse as ap

    from slime.rollout.generate_utils import prompt_ids
    from slime.rollout.sample import Sample

    sample = Sample(index=0, prompt="<image>colour?", multimodal_inputs={"image": [image]})
    ids = prompt_ids(ap.Namespace(hf_checkpoint=str(model)), sample)
    assert sample.multimodal_train_inputs is not None
    return ids, sample.multimodal_train_inputs


def picture(root: Path) -> str:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).rectangle([14, 14, 41, 41], fill="red")
    path = root / "red.png"
    image.save(path)
    return str(path)


def check_engine_vlm_generate(url: str, model: Path, image: str) -> dict[str, float]:
    """The CUDA torch engine generates from a picture sent as SGLang's image_data with one pad per
    picture; its expanded prompt has the rollout's length."""
    from slime.rollout.vision import vision_processor
    from slime.utils.http import post_json_sync

    processor = vision_processor(str(model))
    ids, _ = vlm_prompt(model, image)
    start = time.perf_counter()
    reply = post_json_sync(
        f"{url}/generate",
        {
            "input_ids": processor.collapse(ids, 1),
            "image_data": processor.data_urls([image]),
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    seconds = time.perf_counter() - start
    assert reply["meta_info"]["prompt_tokens"] == len(ids), (reply["meta_info"], len(ids))
    assert len(reply["output_ids"]) == 8, reply
    return {
        "generate_s": seconds,
        "prompt_tokens": len(ids),
        "image_tokens": reply["meta_info"].get("image_tokens", -1),
    }


def check_vlm(root: Path, timed: Callable[[str, Callable[[], dict]], None]) -> None:
    """Check 6: the tiny Qwen2.5-VL trained in bf16 and served by the CUDA torch engine."""
    from slime.backends.engine_server import start_engine_server
    from slime.backends.torch_engine.launcher import serving
    from tools.make_tiny_model import make_tiny_model

    vlm = make_tiny_model(root / "qwen2_5_vl", arch="qwen2_5_vl")
    image = picture(root)
    timed("megatron_bf16_train_step_qwen2_5_vl", lambda: check_megatron_bf16(vlm, root, [], image))
    command = serving(vlm, "--device", "cuda", "--random-seed", "0")
    server = start_engine_server("torch engine (cuda, VLM)", command, root / "vlm.log", timeout_s=300)
    try:
        timed("torch_engine_cuda_vlm_generate", lambda: check_engine_vlm_generate(server.url, vlm, image))
    finally:
        server.stop()


def family_flags() -> dict[str, list[str]]:
    """GLM-4, GLM-4.5 and DeepSeek-V3 (MLA) with their flags from config.json, on Transformer Engine's
    layer spec when it is installed (what a GPU run uses; the CPU suite checks the local spec)."""
    import importlib.util

    te = importlib.util.find_spec("transformer_engine") is not None
    impl = ["--transformer-impl", "transformer_engine"] if te else []
    return {arch: list(impl) for arch in ("glm4", "glm4_moe", "deepseek_v3")}


def make_family_model(root: Path, arch: str) -> Path:
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(root / arch, arch=arch, tie_word_embeddings=False)


def check_engine_generate(url: str) -> dict[str, float]:
    from slime.utils.http import get_json, post_json_sync

    assert get_json(f"{url}/get_server_info")["device"].startswith("cuda")
    start = time.perf_counter()
    reply = post_json_sync(
        f"{url}/generate",
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        },
    )
    seconds = time.perf_counter() - start
    assert len(reply["output_ids"]) == 16, reply
    return {"generate_s": seconds, "tokens": 16}


def check_engine_ipc_update(url: str, model: Path) -> dict[str, float]:
    """The engine loads CUDA-IPC-shared buckets through /update_weights_from_tensor; values read back."""
    from slime.backends.torch_engine.weights import iter_safetensors
    from slime.engine_client.weight_updates import weight_update_session
    from slime.utils.http import post_json_sync
    from slime.weight_sync import ipc

    gen = torch.Generator().manual_seed(1)
    state = {
        n: torch.randn(t.shape, generator=gen).to(t.dtype).cuda() for n, t in iter_safetensors(str(model))
    }
    start = time.perf_counter()
    with weight_update_session([url], 120):  # the engine, like SGLang 0.5.23, refuses updates outside one
        for named in ipc.split_by_dtype(state.items()):
            bucket = ipc.FlattenedBucket.from_named_tensors(named)
            reply = post_json_sync(
                f"{url}/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [ipc.serialize(bucket.payload())],
                    "load_format": "flattened_bucket",
                    "flush_cache": True,
                    "weight_version": "ipc",
                },
                timeout=120,
            )
            assert reply["success"], reply
    seconds = time.perf_counter() - start
    for name, tensor in state.items():
        got = torch.tensor(
            post_json_sync(f"{url}/get_weights_by_name", {"name": name, "truncate_size": 10**9})
        )
        assert torch.equal(got.reshape(tensor.shape), tensor.float().cpu()), (
            f"{name} differs after the handoff"
        )
    return {"update_s": seconds, "tensors": len(state)}


def _receiver(conn) -> None:
    """Second process: open each handle, copy into its own memory (timed), then checksum the copy."""
    from slime.weight_sync import ipc

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # CUDA context up before the first timed handoff
    conn.send("ready")
    while True:
        message = conn.recv()
        if message is None:
            return
        start = time.perf_counter()
        tensors = ipc.named_tensors_from_payload(ipc.deserialize(message), "flattened_bucket")
        copies = [t.clone() for _, t in tensors]
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        del tensors  # the sender may free its buffer now
        conn.send((seconds, [checksum(t) for t in copies]))


def checksum(tensor: torch.Tensor) -> int:
    """A position-sensitive checksum of the tensor's bytes (as 32-bit words), computed on its device."""
    words = tensor.contiguous().view(-1).view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), device=tensor.device, dtype=torch.int64) % 65521 + 1
    return int((words * weights).sum().item())


def check_ipc_throughput(gigabytes: float) -> dict[str, float]:
    """``gigabytes`` of bf16 in 512 MiB buckets to a second process through CUDA IPC, checksummed there.

    Timed: packing and serializing here plus opening and copying there (what a colocated engine does
    with each bucket); the pipe carries only the handle.
    """
    from slime.weight_sync import ipc

    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_receiver, args=(child,), daemon=True)
    process.start()
    try:
        assert parent.recv() == "ready"
        staging = ipc.StagingBuffer()
        bucket_elems = 256 * 2**20  # 512 MiB of bf16
        total, pack, receive = 0, 0.0, 0.0
        remaining = int(gigabytes * 2**30)
        index = 0
        while remaining > 0:
            part = min(bucket_elems, remaining // 2) // 8 * 2  # four tensors, an even count each
            named = [(f"w{index}.{k}", torch.randn(part, device="cuda").to(torch.bfloat16)) for k in range(4)]
            expected = [checksum(t) for _, t in named]
            torch.cuda.synchronize()
            start = time.perf_counter()
            bucket = staging.pack(named)
            entry = ipc.serialize(bucket.payload())
            torch.cuda.synchronize()
            pack += time.perf_counter() - start
            parent.send(entry)
            seconds, sums = parent.recv()
            receive += seconds
            assert sums == expected, "checksums differ after the CUDA IPC handoff"
            total += bucket.nbytes
            remaining -= bucket.nbytes
            index += 1
        parent.send(None)
        process.join(60)
        staging.release()
    finally:
        if process.is_alive():
            process.kill()
    seconds = pack + receive
    return {"bytes": total, "pack_s": pack, "open_copy_s": receive, "GB_per_s": total / seconds / 1e9}


PEER_CHECK_TIMEOUT_S = 90.0  # spawning, CUDA start-up and the communicator of both ranks, with room
# 64 MiB of fp32 per broadcast: over NCCL's staging buffer (NCCL_BUFFSIZE, 4 MiB by default), which a
# sender fills without its peer, so a smaller broadcast ends on the sender alone (seen on an H200).
BROADCAST_ELEMS = 1 << 24


def _join_as(rank: int, port: int, device: str):
    """Rank ``rank`` of check 5's two-rank weight-update group: NCCL on "cuda", gloo on "cpu"."""
    from slime.weight_sync.process_group import create_weight_update_group

    if device == "cuda":
        # NCCL refuses two ranks of one host on one GPU; a host id each makes them two hosts, which meet
        # over NCCL's socket transport on loopback. Set before this process starts NCCL.
        os.environ["NCCL_HOSTID"] = f"slime-gpu-check-rank-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        torch.cuda.set_device(0)
    backend = "nccl" if device == "cuda" else "gloo"
    return create_weight_update_group("127.0.0.1", port, rank, 2, "gpu-check", backend, timeout_s=120)


def _sender(port: int, device: str, conn) -> None:
    """Rank 0 of check 5 (spawned): its measurements, or its error, go back through ``conn``."""
    from slime.weight_sync.process_group import abandon_group

    group = None
    try:
        group = _join_as(0, port, device)
        conn.send(("ok", _broadcast_to_a_peer_that_stops_joining(group, device)))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    abandon_group(group)  # aborts an NCCL communicator: its last kernels wait for the peer forever
    os._exit(0)


def _broadcast_to_a_peer_that_stops_joining(group, device: str) -> dict[str, float | bool | str]:
    from slime.weight_sync.process_group import start_broadcast_from_rank0, wait_for_work

    tensor = torch.zeros(BROADCAST_ELEMS, device=device)
    peer = "rank 1 (the idle peer)"
    start = time.perf_counter()
    wait_for_work(
        start_broadcast_from_rank0(group, tensor, 60), 60, peer=peer
    )  # NCCL: builds the communicator
    results: dict[str, float | bool | str] = {"joined_broadcast_s": time.perf_counter() - start}

    # The peer joins no more broadcasts. A stop (an engine's refusal) after 1 s ends the wait then.
    work = start_broadcast_from_rank0(group, tensor, 60)
    results["future_done_at_start"] = work.get_future().done()
    refusal = RuntimeError("stand-in for an engine's refusal")
    stop_at = time.monotonic() + 1.0
    try:
        wait_for_work(work, 60, stop=lambda: refusal if time.monotonic() >= stop_at else None, peer=peer)
    except RuntimeError as exc:
        if exc is not refusal:
            raise
    else:
        raise AssertionError("a broadcast that the peer never joined finished")
    results["stop_to_raise_s"] = time.monotonic() - stop_at
    results["completed_without_the_peer"] = work.is_completed()

    # Without a stop, the deadline ends it, with one line naming the peer.
    start = time.perf_counter()
    try:
        wait_for_work(start_broadcast_from_rank0(group, tensor, 3), 3, stop=lambda: None, peer=peer)
    except TimeoutError as exc:
        results["deadline_s"] = time.perf_counter() - start
        results["deadline_error"] = str(exc)
    else:
        raise AssertionError("a broadcast that the peer never joined finished")
    return results


def _idle_peer(port: int, device: str, conn) -> None:
    """Rank 1 of check 5 (spawned): joins the group and one broadcast, then nothing until told to go."""
    from slime.weight_sync.process_group import broadcast_from_rank0

    try:
        group = _join_as(1, port, device)
        tensor = torch.ones(BROADCAST_ELEMS, device=device)
        broadcast_from_rank0(group, tensor, 60)
        conn.send(("ok", {"received": bool((tensor == 0).all())}))
        conn.recv()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    os._exit(0)


def _answer(conn, who: str) -> dict:
    if not conn.poll(PEER_CHECK_TIMEOUT_S):
        raise AssertionError(f"{who} sent nothing within {PEER_CHECK_TIMEOUT_S:.0f} s")
    kind, value = conn.recv()
    if kind == "error":
        raise AssertionError(f"{who}: {value}")
    return value


def check_broadcast_to_a_peer_that_stops_joining(device: str = "cuda") -> dict[str, float | bool | str]:
    """Check 5: ``wait_for_work`` ends at a stop and at its deadline, not at the work's future (NCCL's
    is done at once); ``device="cpu"`` runs the same check over gloo."""
    from slime.utils.http import free_port

    context = mp.get_context("spawn")
    port = free_port()
    ends, processes = {}, []
    for who, target in (("the sender", _sender), ("the idle peer", _idle_peer)):
        ours, theirs = context.Pipe()
        processes.append(context.Process(target=target, args=(port, device, theirs), daemon=True))
        processes[-1].start()
        ends[who] = ours
    try:
        peer = _answer(ends["the idle peer"], "the idle peer")
        results = _answer(ends["the sender"], "the sender")
        ends["the idle peer"].send("go")
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    assert peer["received"], "the broadcast both ranks joined did not arrive"
    assert not results["completed_without_the_peer"], "a broadcast without its peer counts as completed"
    assert results["stop_to_raise_s"] < 0.5, (
        f"the stop took {results['stop_to_raise_s']:.2f} s to end the wait"
    )
    assert 3.0 <= results["deadline_s"] < 4.0, (
        f"a deadline of 3 s ended the wait after {results['deadline_s']:.2f} s"
    )
    message = results["deadline_error"]
    assert "rank 1 (the idle peer)" in message and "\n" not in message, message
    return results


def hf_logprobs(
    model_dir: Path, state: dict[str, torch.Tensor], ids: list[int], prompt_len: int
) -> list[float]:
    """transformers' log-probs of ``ids[prompt_len:]`` with ``state`` loaded (fp32, on the GPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(ids[prompt_len:], device="cuda")
    return logprobs[prompt_len - 1 : len(ids) - 1].gather(1, targets[:, None])[:, 0].tolist()


def engine_vs_hf(url: str, model_dir: Path, state: dict[str, torch.Tensor]) -> float:
    """Largest |engine log-prob - transformers log-prob| over a 16-token greedy generation."""
    from slime.utils.http import post_json_sync

    prompt = [1, 2, 3, 4, 5]
    reply = post_json_sync(
        f"{url}/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
        timeout=120,
    )
    engine = [t[0] for t in reply["meta_info"]["output_token_logprobs"]]
    reference = hf_logprobs(model_dir, state, prompt + reply["output_ids"], len(prompt))
    return max(abs(a - b) for a, b in zip(engine, reference, strict=True))


def engine_has(url: str, state: dict[str, torch.Tensor]) -> None:
    from slime.utils.http import post_json_sync

    for name in ("model.norm.weight", "model.layers.0.mlp.down_proj.weight"):
        got = torch.tensor(post_json_sync(f"{url}/get_weights_by_name", {"name": name, "truncate_size": 4}))
        want = state[name][:4].float().cpu()
        assert torch.allclose(got.reshape(want.shape), want, atol=1e-2), (
            f"engine {name} differs after the push"
        )


def check_real_sglang(model: Path, root: Path) -> dict[str, float | str | bool]:
    """The real SGLang server through slime's launcher, client and updaters (see the module docstring)."""

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from bench.weight_sync import StandInTrainer
    from slime.backends.engine_server import start_engine_server
    from slime.backends.sglang import server_command
    from slime.backends.torch_engine.weights import iter_safetensors
    from slime.config.settings.rollout import EngineSettings
    from slime.config.settings.weight_sync import WeightSyncSettings
    from slime.engine_client.protocol import probe_engine_api
    from slime.engine_client.weight_updates import weight_update_session
    from slime.utils.http import free_port
    from slime.weight_sync import distributed as distributed_sync
    from slime.weight_sync.tensor import TensorWeightUpdater

    launch = EngineSettings(
        backend="sglang",
        hf_checkpoint=str(model),
        seed=0,
        log_level="warning",
        server_args=(("mem_fraction_static", "0.2"), ("disable_cuda_graph", True)),
    )

    def command(host: str, port: int) -> list[str]:
        return server_command(launch, host, port, engine_rank=0, num_gpus=1, nccl_port=free_port())

    server = start_engine_server("sglang server", command, root / "sglang.log", timeout_s=600)
    url = server.url
    results: dict[str, float | str | bool] = {}
    try:
        api = probe_engine_api(url)
        results.update(version=api.version, sessions=api.weight_update_sessions, load_path=api.load_path)
        state = {name: t.clone().cuda() for name, t in iter_safetensors(str(model))}
        results["logprob_diff_initial"] = engine_vs_hf(url, model, state)

        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
        if not mpu.model_parallel_is_initialized():
            mpu.initialize_model_parallel()
        settings = WeightSyncSettings("distributed", bucket_bytes=1 << 20, timeout_s=120.0)
        trainer = StandInTrainer(state)

        distributed_sync.distributed_backend = lambda: "gloo"  # one GPU cannot hold two NCCL ranks
        updaters = {
            "distributed": distributed_sync.DistributedWeightUpdater(settings, trainer),
            "tensor": TensorWeightUpdater(settings, trainer),
        }
        for seed, (name, updater) in enumerate(updaters.items(), start=1):
            updater.connect([url])
            trainer.perturb(seed)
            start = time.perf_counter()
            with weight_update_session([url], 120):  # as TrainingSession.push_weights opens it
                updater.update(f"gpu-check-{seed}")
            results[f"{name}_push_s"] = time.perf_counter() - start
            engine_has(url, state)
            results[f"logprob_diff_after_{name}"] = engine_vs_hf(url, model, state)
            updater.disconnect()
    finally:
        server.stop()
    for key in ("logprob_diff_initial", "logprob_diff_after_distributed", "logprob_diff_after_tensor"):
        assert results[key] < 2e-2, (
            f"{key} = {results[key]:.4f}: the engine's log-probs differ from the trainer's"
        )
    return results


def run_checks(handoff_gb: float = 1.0, only: str | None = None) -> dict[str, dict]:
    """Every check in order; the engine runs from check 2 to check 3. Raises on the first failure.
    ``only="vlm"`` runs check 6 alone."""
    results: dict[str, dict] = {}
    root = Path(tempfile.mkdtemp(prefix="slime_gpu_check_"))

    def timed(name: str, fn: Callable[[], dict]) -> None:
        start = time.perf_counter()
        results[name] = {**fn(), "wall_s": time.perf_counter() - start}
        print(f"ok   {name}: {json.dumps(results[name])}", flush=True)

    if only == "vlm":
        check_vlm(root, timed)
        return results
    model = tiny_model(root)

    timed("megatron_bf16_train_step", lambda: check_megatron_bf16(model, root))
    for arch, flags in family_flags().items():  # the Transformer Engine spec, where TE is installed
        family = make_family_model(root, arch)
        timed(
            f"megatron_bf16_train_step_{arch}",
            lambda family=family, flags=flags: check_megatron_bf16(family, root, flags),
        )
    from slime.backends.engine_server import start_engine_server
    from slime.backends.torch_engine.launcher import serving

    command = serving(model, "--device", "cuda", "--random-seed", "0")
    server = start_engine_server("torch engine (cuda)", command, root / "engine.log", timeout_s=300)
    url = server.url
    try:
        timed("torch_engine_cuda_generate", lambda: check_engine_generate(url))
        timed("engine_update_weights_from_tensor_cuda_ipc", lambda: check_engine_ipc_update(url, model))
    finally:
        server.stop()
    timed("cuda_ipc_handoff_two_processes", lambda: check_ipc_throughput(handoff_gb))
    timed("nccl_broadcast_to_a_peer_that_stops_joining", check_broadcast_to_a_peer_that_stops_joining)
    from slime.config.engine_backend import sglang_installed

    if sglang_installed():
        timed("real_sglang_generate_and_weight_pushes", lambda: check_real_sglang(model, root))
    else:
        print("skip real_sglang_generate_and_weight_pushes: SGLang is not installed", flush=True)
    check_vlm(root, timed)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--handoff-gb", type=float, default=2.0, help="bytes handed over in the IPC check")
    parser.add_argument("--only", choices=["vlm"], help="run only the vision-language checks (6)")
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: no CUDA device visible; every GPU check skipped")
        return
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    try:
        run_checks(cli.handoff_gb, cli.only)
    except Exception as exc:
        print(f"FAIL {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
