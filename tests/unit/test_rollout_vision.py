"""The rollout side of images: the processor turns a sample's raw items into expanded ids and training
tensors once, the request carries one pad per image and the resized PNGs, and a bad image fails its
sample, never the rollout."""

from __future__ import annotations

import argparse
import base64
import io
import json
from pathlib import Path

import pytest
import torch

from slime.rollout.errors import RolloutError
from slime.rollout.generate_utils import append_image_observation, prompt_ids, request_images
from slime.rollout.sample import Sample
from slime.rollout.train_data import samples_to_train_data
from slime.rollout.vision import ImageError, check_expanded_length, decode_image, vision_processor
from tools.make_tiny_model import IMAGE_PAD, VISION_END, VISION_START, make_tiny_model


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "vlm", arch="qwen2_5_vl")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 56x56 red square and a 90x60 blue bar (not a multiple of 28: the processor resizes it)."""
    from PIL import Image, ImageDraw

    root = tmp_path_factory.mktemp("images")
    red = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(red).rectangle([14, 14, 41, 41], fill="red")
    blue = Image.new("RGB", (90, 60), "white")
    ImageDraw.Draw(blue).rectangle([10, 20, 80, 40], fill="blue")
    red.save(root / "red.png")
    blue.save(root / "blue.png")
    return {"red": root / "red.png", "blue": root / "blue.png"}


def _args(vlm: Path) -> argparse.Namespace:
    return argparse.Namespace(hf_checkpoint=str(vlm))


def _sample(prompt: str | list, items: list) -> Sample:
    return Sample(index=3, prompt=prompt, multimodal_inputs={"image": items})


def _reference_ids(
    vlm: Path, text: str, image_paths: list[Path]
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """What the HF processor would make of ``text`` (``<image>`` per image): the PIL image processor
    and the tokenizer by hand, as tests/unit/test_tiny_vlm.py does (no torchvision on the CPU)."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm, local_files_only=True)
    processor = AutoImageProcessor.from_pretrained(vlm, local_files_only=True, backend="pil")
    vision = processor(images=[Image.open(p).convert("RGB") for p in image_paths], return_tensors="pt")
    for grid in vision["image_grid_thw"]:
        block = VISION_START + IMAGE_PAD * (int(grid.prod()) // processor.merge_size**2) + VISION_END
        text = text.replace("<image>", block.replace(IMAGE_PAD, "\0"), 1)
    ids = tokenizer(text.replace("\0", IMAGE_PAD), add_special_tokens=False)["input_ids"]
    return ids, dict(vision)


def test_a_prompt_with_two_images_becomes_the_processors_ids_and_tensors(vlm: Path, images: dict) -> None:
    text = "<image>A<image>B?"
    sample = _sample(text, [str(images["red"]), str(images["blue"])])
    ids = prompt_ids(_args(vlm), sample)
    expected_ids, vision = _reference_ids(vlm, text, [images["red"], images["blue"]])
    assert ids == expected_ids
    train = sample.multimodal_train_inputs
    assert train is not None and set(train) == {"pixel_values", "image_grid_thw"}
    assert torch.equal(train["image_grid_thw"], vision["image_grid_thw"])
    assert torch.equal(train["pixel_values"], vision["pixel_values"].float())
    # 56x56 -> a 4x4 patch grid -> 4 tokens; 90x60 resizes to 84x56 -> 6x4 patches -> 6 tokens
    assert train["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    pad = vision_processor(str(vlm)).tokens.image_pad_id
    assert ids.count(pad) == 4 + 6


def test_base64_and_data_url_items_equal_the_path(vlm: Path, images: dict) -> None:
    raw = base64.b64encode(images["blue"].read_bytes()).decode()
    forms = [str(images["blue"]), raw, "data:image/png;base64," + raw]
    results = []
    for item in forms:
        sample = _sample("<image>?", [item])
        results.append((prompt_ids(_args(vlm), sample), sample.multimodal_train_inputs["pixel_values"]))
    assert all(ids == results[0][0] and torch.equal(pv, results[0][1]) for ids, pv in results)


def test_an_items_max_pixels_bounds_its_token_count(vlm: Path, images: dict) -> None:
    item = {"image": str(images["blue"]), "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 2}
    sample = _sample("<image>?", [item])
    ids = prompt_ids(_args(vlm), sample)
    grid = sample.multimodal_train_inputs["image_grid_thw"]  # 90x60 -> 28x28 -> 2x2 patches -> 1 token
    assert grid.tolist() == [[1, 2, 2]] and ids.count(vision_processor(str(vlm)).tokens.image_pad_id) == 1


def test_the_request_carries_one_pad_per_image_and_the_resized_pngs(vlm: Path, images: dict) -> None:
    processor = vision_processor(str(vlm))
    sample = _sample("<image>x<image>", [str(images["red"]), str(images["blue"])])
    ids = prompt_ids(_args(vlm), sample)
    urls = request_images(_args(vlm), sample)
    collapsed = processor.collapse(ids, len(urls))
    assert collapsed == processor.encode_text("<image>x<image>")
    assert processor.expand(collapsed, [4, 6]) == ids
    sizes = [decode_image(url, "url").size for url in urls]
    assert sizes == [(56, 56), (84, 56)]  # what was patched, so the engine's resize is the identity
    with pytest.raises(ImageError, match=r"2 runs of image tokens in the ids but 3 image\(s\) given"):
        processor.collapse(ids, 3)
    with pytest.raises(ImageError, match="1 image placeholder"):
        processor.expand(processor.encode_text("<image>"), [4, 6])


def test_the_engines_expanded_length_is_checked(vlm: Path) -> None:
    check_expanded_length(12, {"meta_info": {"prompt_tokens": 12}}, 0)
    with pytest.raises(RolloutError, match="sample 5: the engine expanded the prompt's images to 14"):
        check_expanded_length(12, {"meta_info": {"prompt_tokens": 14}}, 5)


def test_an_undecodable_image_names_itself(vlm: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png at all")
    with pytest.raises(ImageError, match=r"image 0 \('.*broken.png'\) cannot be decoded"):
        prompt_ids(_args(vlm), _sample("<image>?", [str(broken)]))


def test_an_image_observation_appends_expanded_tokens_masked_and_its_tensors(vlm: Path, images: dict) -> None:
    from PIL import Image

    args = _args(vlm)
    sample = _sample("<image>?", [str(images["red"])])
    sample.tokens = prompt_ids(args, sample)
    prompt_length = len(sample.tokens)
    append_image_observation(args, sample, "then <image>", [Image.open(images["blue"])])
    observation = sample.tokens[prompt_length:]
    processor = vision_processor(str(vlm))
    assert observation == processor.expand(processor.encode_text("then <image>"), [6])
    assert sample.loss_mask == [0] * len(observation) and sample.response_length == len(observation)
    assert len(sample.multimodal_inputs["image"]) == 2
    grid = sample.multimodal_train_inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4], [1, 4, 6]]
    assert sample.multimodal_train_inputs["pixel_values"].shape[0] == 16 + 24
    # the next request sends both images and collapses both runs
    assert len(request_images(args, sample)) == 2 and processor.collapse(sample.tokens, 2)


def test_train_data_carries_the_tensors_and_the_saved_buffer_drops_them(vlm: Path, images: dict) -> None:
    args = _args(vlm)
    with_image = _sample("<image>?", [str(images["red"])])
    with_image.tokens = [*prompt_ids(args, with_image), 5]
    text = Sample(index=4, prompt="hi", tokens=[1, 2, 5])
    for sample in (with_image, text):
        sample.response_length, sample.loss_mask, sample.reward = 1, [1], 1.0
        sample.status = Sample.Status.COMPLETED
    data = samples_to_train_data([[with_image, text]])
    assert data["multimodal_train_inputs"][1] is None
    assert torch.equal(data["multimodal_train_inputs"][0]["image_grid_thw"], torch.tensor([[1, 4, 4]]))
    assert "multimodal_train_inputs" not in samples_to_train_data([[text]])
    saved = json.loads(json.dumps(with_image.to_dict()))
    restored = Sample.from_dict(saved)
    assert restored.multimodal_train_inputs is None and restored.tokens == with_image.tokens
    request_images(args, restored)  # a resumed sample gets its tensors back from its raw images
    assert torch.equal(
        restored.multimodal_train_inputs["pixel_values"], with_image.multimodal_train_inputs["pixel_values"]
    )


def test_png_data_url_is_lossless(images: dict) -> None:
    from PIL import Image

    from slime.rollout.vision import png_data_url

    original = Image.open(images["blue"]).convert("RGB")
    decoded = decode_image(png_data_url(original), "x")
    buffer_a, buffer_b = io.BytesIO(), io.BytesIO()
    original.save(buffer_a, format="BMP")
    decoded.save(buffer_b, format="BMP")
    assert buffer_a.getvalue() == buffer_b.getvalue()


def test_a_sampled_image_pad_outside_an_image_fails_its_sample_and_not_the_batch(
    vlm: Path, images: dict
) -> None:
    """A tiny model samples <|image_pad|> about once in its vocabulary's size: sent on, SGLang would
    take it for a placeholder (and count one image too many), so that sample fails before a request."""
    import asyncio

    from slime.rollout.generate_utils import append_model_turn, generate_turns

    args = _args(vlm)
    sample = _sample("<image>?", [str(images["red"])])
    sample.tokens = prompt_ids(args, sample)
    pad = vision_processor(str(vlm)).tokens.image_pad_id
    with pytest.raises(ImageError, match=r"token \d+ is an image pad outside an image"):
        vision_processor(str(vlm)).collapse([*sample.tokens, 7, pad], 1)
    stray = [*sample.tokens, 7, pad]
    turns = asyncio.run(
        generate_turns(
            args, [stray], {"max_new_tokens": 4}, indices=[3], images=[request_images(args, sample)]
        )
    )
    assert turns[0].status is Sample.Status.FAILED and turns[0].output_ids == []
    sample.tokens, sample.response_length, sample.loss_mask = stray, 2, [1, 1]
    append_model_turn(sample, turns[0])
    assert sample.status is Sample.Status.FAILED and "image pad outside an image" in sample.metadata["error"]
