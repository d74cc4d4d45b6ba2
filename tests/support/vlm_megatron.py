"""The megatron-core Qwen2.5-VL policy on the tiny VLM, run in a process of its own (the CPU trainer
setup patches ``torch.cuda`` for the whole process, so a test never runs it in pytest's).

``python -m tests.support.vlm_megatron MODEL_DIR OUT_DIR RANK WORLD PORT``: a world of one rank records
everything the single-rank tests check; a world of two runs tensor parallelism 2 and records its
logits and exported weights. Results go to ``OUT_DIR/rank<RANK>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from tools.make_tiny_model import IMAGE_PAD

Sample = dict[str, torch.Tensor | None]


def images() -> list[Any]:
    """A 56x56 red square (2x2 merged tokens) and 112x84 noise (4x3 merged tokens)."""
    import numpy as np
    from PIL import Image, ImageDraw

    square = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(square).rectangle([14, 14, 41, 41], fill="red")
    noise = np.random.default_rng(0).integers(0, 256, (84, 112, 3), dtype=np.uint8)
    return [square, Image.fromarray(noise)]


def samples(model_dir: Path, hf_model: Any) -> list[Sample]:
    """Two image prompts and a text one as the trainer receives them: expanded image pads, the
    images' patches and grids, and 3-D positions from transformers' own ``get_rope_index``."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True, backend="pil")
    image_id = hf_model.config.image_token_id
    out: list[Sample] = []
    for image, text in zip([*images(), None], ["Colour?", "What is it?", "12+3="], strict=True):
        parts = (
            [{"type": "text", "text": text}]
            if image is None
            else [{"type": "image"}, {"type": "text", "text": text}]
        )
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
        )
        if image is None:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            positions = torch.arange(ids.shape[1]).expand(3, 1, -1).clone()
            out.append(
                {"input_ids": ids, "positions": positions, "pixel_values": None, "image_grid_thw": None}
            )
            continue
        vision = processor(images=[image], return_tensors="pt")
        grid = vision["image_grid_thw"]
        prompt = prompt.replace(IMAGE_PAD, IMAGE_PAD * (int(grid.prod()) // processor.merge_size**2), 1)
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        positions, _ = hf_model.model.get_rope_index(ids, (ids == image_id).int(), image_grid_thw=grid)
        out.append(
            {
                "input_ids": ids,
                "positions": positions,
                "pixel_values": vision["pixel_values"],
                "image_grid_thw": grid,
            }
        )
    return out


def hf_logits(model: Any, sample: Sample) -> torch.Tensor:
    ids = sample["input_ids"]
    assert ids is not None
    extra = {}
    if sample["pixel_values"] is not None:
        extra = {"pixel_values": sample["pixel_values"], "image_grid_thw": sample["image_grid_thw"]}
    with torch.no_grad():
        return model(input_ids=ids, position_ids=sample["positions"], **extra).logits[0]


def packed(parts: list[Sample]) -> tuple[Sample, Any]:
    """One THD row of ``parts`` (positions restart in each) and its ``PackedSeqParams``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [int(p["input_ids"].shape[1]) for p in parts]  # type: ignore[union-attr]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with_images = [p for p in parts if p["pixel_values"] is not None]
    row: Sample = {
        "input_ids": torch.cat([p["input_ids"] for p in parts], dim=1),  # type: ignore[misc]
        "positions": torch.cat([p["positions"] for p in parts], dim=2),  # type: ignore[misc]
        "pixel_values": torch.cat([p["pixel_values"] for p in with_images]) if with_images else None,  # type: ignore[misc]
        "image_grid_thw": torch.cat([p["image_grid_thw"] for p in with_images]) if with_images else None,  # type: ignore[misc]
    }
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    return row, params


def padded(parts: list[Sample]) -> Sample:
    """``parts`` as rows of one right-padded ``[b, s]`` batch (``--qkv-format bshd``)."""
    length = max(int(p["input_ids"].shape[1]) for p in parts)  # type: ignore[union-attr]
    ids = torch.zeros(len(parts), length, dtype=torch.long)
    positions = torch.zeros(3, len(parts), length, dtype=torch.long)
    for row, part in enumerate(parts):
        n = int(part["input_ids"].shape[1])  # type: ignore[union-attr]
        ids[row, :n] = part["input_ids"][0]  # type: ignore[index]
        positions[:, row, :n] = part["positions"][:, 0]  # type: ignore[index]
    with_images = [p for p in parts if p["pixel_values"] is not None]
    return {
        "input_ids": ids,
        "positions": positions,
        "pixel_values": torch.cat([p["pixel_values"] for p in with_images]),  # type: ignore[misc]
        "image_grid_thw": torch.cat([p["image_grid_thw"] for p in with_images]),  # type: ignore[misc]
    }


def megatron_logits(
    model: torch.nn.Module, sample: Sample, vocab: int, packed_seq_params: Any = None
) -> torch.Tensor:
    """``[s, vocab]`` logits (``[b, s, vocab]`` for several rows), gathered over tensor-parallel ranks
    and cut to the HF vocab."""
    from megatron.core import tensor_parallel

    model.eval()
    with torch.no_grad():
        logits = model(
            sample["input_ids"],
            sample["positions"],
            None,
            packed_seq_params=packed_seq_params,
            pixel_values=sample["pixel_values"],
            image_grid_thw=sample["image_grid_thw"],
        )
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits[..., :vocab].squeeze(0)


def shared_prompts(
    model_dir: Path, hf_model: Any, model: torch.nn.Module, inputs: list[Sample]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two responses to one image prompt and one to a text prompt, packed by the trainer's batching with
    ``--share-prompts-in-train`` (the image prompt once): each response's logits, ours and
    transformers' on the sample alone."""
    from megatron.core import tensor_parallel

    from slime.backends.megatron.batching import MULTIMODAL_KEY, make_micro_batches
    from slime.backends.megatron.mrope_positions import read_mrope_config
    from slime.backends.megatron.packed_attention import packed_seq_params, shared_prompt_layouts

    image, text = inputs[0], inputs[2]
    images = {"pixel_values": image["pixel_values"], "image_grid_thw": image["image_grid_thw"]}
    prompts = [image, image, text]
    responses = [[5, 9, 17, 3], [40, 41, 42], [60, 61, 62, 63, 64]]
    data = {
        "tokens": [p["input_ids"][0].tolist() + r for p, r in zip(prompts, responses, strict=True)],  # type: ignore[index]
        "response_lengths": [len(r) for r in responses],
        "loss_masks": [[1] * len(r) for r in responses],
        "loss_weights": [1.0] * 3,
        MULTIMODAL_KEY: [images, images, None],
    }
    mrope = read_mrope_config(model_dir)
    (batch,) = make_micro_batches(
        data, [[0, 1, 2]], torch.device("cpu"), packed=True, share_prompts=True, mrope=mrope
    )
    assert batch.response_blocks is not None  # the image prompt is shared
    vocab = hf_model.config.text_config.vocab_size
    model.eval()
    with torch.no_grad(), shared_prompt_layouts([batch]):
        logits = model(
            batch.tokens,
            batch.position_ids,
            None,
            packed_seq_params=packed_seq_params(batch),
            pixel_values=batch.pixel_values,
            image_grid_thw=batch.image_grid_thw,
        )
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :vocab]
    ours = batch.response_slices(logits)
    theirs = []
    for tokens, prompt, n in zip(data["tokens"], prompts, data["response_lengths"], strict=True):
        ids = torch.tensor([tokens])
        if prompt["pixel_values"] is None:
            positions = torch.arange(len(tokens)).expand(3, 1, -1).clone()
        else:
            pads = (ids == hf_model.config.image_token_id).int()
            positions, _ = hf_model.model.get_rope_index(ids, pads, image_grid_thw=prompt["image_grid_thw"])
        sample = {**prompt, "input_ids": ids, "positions": positions}
        theirs.append(hf_logits(hf_model, sample)[len(tokens) - 1 - n : len(tokens) - 1])
    return ours, theirs


def build(model_dir: Path, world: int, extra: list[str]) -> tuple[Any, list[torch.nn.Module], Any, Any]:
    """Settings, model chunks with the HF checkpoint loaded, transformer config and converter."""
    from slime.backends.megatron.config import transformer_config
    from slime.backends.megatron.hf_checkpoint import load_hf_weights
    from slime.backends.megatron.model import build_model_chunks
    from slime.backends.megatron.trainer import converter_for
    from slime.config.settings.trainer import TrainerSettings
    from tests.support.models import model_args
    from tests.support.trainers import trainer_args

    flags = [*extra, "--tensor-model-parallel-size", str(world)]
    args = trainer_args(model_dir, world=world, extra=flags, model_flags=model_args("tiny-qwen2.5-vl.sh"))
    settings = TrainerSettings.from_args(args)
    config = transformer_config(settings)
    chunks = build_model_chunks(settings, config, torch.device("cpu"))
    converter = converter_for(settings)
    load_hf_weights(chunks, model_dir, converter, gated=True)
    return settings, chunks, config, converter


def train_step(
    settings: Any, config: Any, chunks: list[torch.nn.Module], sample: Sample
) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """One optimizer step through the trainer's DDP and optimizer: which parameters DDP gave a gradient
    buffer, every parameter before and after; and the wrapped model, optimizer and LR schedule."""

    from slime.backends.megatron.model import build_optimizer, wrap_for_training

    model = wrap_for_training(settings, config, chunks)
    optimizer, scheduler = build_optimizer(settings, model)
    inner = model[0].module
    before = {name: p.detach().clone() for name, p in inner.named_parameters()}
    buffered = {id(p) for buffer in model[0].buffers for p in buffer.params}
    assert one_step(model, optimizer, sample)
    record = {
        "buffered": sorted(name for name, p in inner.named_parameters() if id(p) in buffered),
        "requires_grad": sorted(name for name, p in inner.named_parameters() if p.requires_grad),
        "before": before,
        "after": {name: p.detach().clone() for name, p in inner.named_parameters()},
    }
    return record, (model, optimizer, scheduler)


def steps_with_and_without_images(model_dir: Path, inputs: list[Sample]) -> int:
    """``--overlap-grad-reduce``: optimizer steps on an image prompt, then a text one, then an image one.
    megatron-core's DDP learns at the first step which parameters get gradients and waits for all of
    them in every later step; returns the steps taken."""

    from slime.backends.megatron.model import build_optimizer, wrap_for_training

    settings, chunks, config, _ = build(model_dir, 1, ["--overlap-grad-reduce"])
    model = wrap_for_training(settings, config, chunks)
    optimizer, _ = build_optimizer(settings, model)
    steps = 0
    for sample in (inputs[0], inputs[2], inputs[0]):
        steps += one_step(model, optimizer, sample)
    return steps


def one_step(model: list[Any], optimizer: Any, sample: Sample) -> bool:
    """One optimizer step of the wrapped model on ``sample`` (a logsumexp loss: every logit gets a
    gradient); whether the optimizer updated."""
    from megatron.core.distributed import finalize_model_grads

    model[0].train()
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    logits = model[0](
        sample["input_ids"],
        sample["positions"],
        None,
        pixel_values=sample["pixel_values"],
        image_grid_thw=sample["image_grid_thw"],
    )
    torch.logsumexp(logits.float(), dim=-1).mean().backward()
    finalize_model_grads(model)
    return bool(optimizer.step()[0])


def checkpoint_round_trip(model_dir: Path, world: int, trained: tuple[Any, ...], directory: Path) -> bool:
    """The trained model, saved as the trainer saves (megatron-core's distributed checkpoint, with the
    optimizer) and loaded into a fresh one: whether every parameter, the tower's included, came back."""
    from slime.backends.megatron import checkpoint
    from slime.backends.megatron.model import build_optimizer, wrap_for_training

    checkpoint.save(directory, 0, *trained, 1)
    settings, chunks, config, _ = build(model_dir, world, [])
    model = wrap_for_training(settings, config, chunks)
    optimizer, scheduler = build_optimizer(settings, model)
    assert checkpoint.load(directory, model, optimizer, scheduler) is not None
    saved = dict(trained[0][0].module.named_parameters())
    return all(torch.equal(saved[name], p) for name, p in model[0].module.named_parameters())


def main(model_dir: Path, out_dir: Path, rank: int, world: int, port: int) -> None:
    from slime.utils.device import import_megatron_core, setup_device

    import_megatron_core()
    device = setup_device(rank)
    assert device.type == "cpu"
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from slime.backends.megatron.hf_checkpoint import HFCheckpointWriter, iter_hf_weights

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, local_files_only=True).eval()
    vocab = hf.config.text_config.vocab_size
    inputs = samples(model_dir, hf)
    results: dict[str, Any] = {"hf": [hf_logits(hf, s) for s in inputs]}

    settings, chunks, config, converter = build(model_dir, world, [])
    results["exported"] = dict(iter_hf_weights(chunks, converter, gated=True))
    results["checkpoint"] = load_file(model_dir / "model.safetensors")
    results["alone"] = [megatron_logits(chunks[0], s, vocab) for s in inputs]
    row, params = packed(inputs)
    results["packed"] = megatron_logits(chunks[0], row, vocab, params)
    results["padded"] = megatron_logits(chunks[0], padded(inputs[:2]), vocab)
    results["lengths"] = [int(s["input_ids"].shape[1]) for s in inputs]  # type: ignore[union-attr]
    results["no_image"] = megatron_logits(chunks[0], {**inputs[0], "pixel_values": None}, vocab)
    results["shared"] = shared_prompts(model_dir, hf, chunks[0], inputs)
    cast = chunks[0].bfloat16()  # as Float16Module casts it
    results["bf16_tower"] = (cast.visual.dtype, cast.visual.rotary_pos_emb.inv_freq.dtype)
    for frozen in (True, False) if world == 1 else (False,):
        extra = ["--freeze-vision-tower"] if frozen else []
        settings, chunks, config, converter = build(model_dir, world, extra)
        results[f"step_frozen={frozen}"], trained = train_step(settings, config, chunks, inputs[0])
    if world == 2:
        results["checkpoint_round_trip"] = checkpoint_round_trip(model_dir, world, trained, out_dir / "ckpt")
    if world == 1:
        results["overlap_steps"] = steps_with_and_without_images(model_dir, inputs)
        saved = out_dir / "saved_hf"
        writer = HFCheckpointWriter(model_dir, saved)
        writer.add(list(iter_hf_weights(chunks, converter, gated=True)))
        writer.close()
        results["trained_logits"] = megatron_logits(chunks[0], inputs[1], vocab)
        reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(saved, local_files_only=True).eval()
        results["reloaded_class"] = type(reloaded).__name__
        results["reloaded_logits"] = hf_logits(reloaded, inputs[1])
        results["saved"] = {**load_file(next(saved.glob("*.safetensors")))}
    torch.save(results, out_dir / f"rank{rank}.pt")
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("SLIME_FORCE_CPU", "1")
    model, out, rank, world, port = sys.argv[1:6]
    main(Path(model), Path(out), int(rank), int(world), int(port))


def tiny_vlm(directory: Path) -> Path:
    """The tiny Qwen2.5-VL with its language model's norms and biases redrawn (``redraw_norms_and_biases``:
    at ones and zeros a swapped or dropped one would convert and compute as the right one does)."""
    from tests.support.models import redraw_norms_and_biases
    from tools.make_tiny_model import make_tiny_model

    return redraw_norms_and_biases(make_tiny_model(directory, arch="qwen2_5_vl"), seed=3)


def run_ranks(model_dir: Path, out_dir: Path, world: int) -> list[dict[str, Any]]:
    """Runs this module on ``world`` gloo ranks (tensor parallelism ``world``); each rank's results."""
    from tests.support.gloo_ranks import run_gloo_ranks

    return run_gloo_ranks("tests.support.vlm_megatron", [str(model_dir)], out_dir, world)
