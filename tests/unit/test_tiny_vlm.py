"""The tiny Qwen2.5-VL is what the multimodal paths (processor, engine, trainer, weight sync) are tested on:
it must load offline in transformers as the real model does, expand an image into the right number of
image tokens, run a forward on the CPU (no torchvision) and give 3-D RoPE positions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from tools.make_tiny_model import (
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VISION_TRAITS,
    make_tiny_model,
)

# sha256 of the default qwen2 checkpoint's files, taken before qwen2_5_vl was added: adding an arch must
# not change a byte of the text models other tests and scripts are built on. Seeded weights and saved
# JSON are only reproducible under the same library versions, hence the guard in the test.
QWEN2_VERSIONS = {"transformers": "5.25.0", "torch": "2.13"}
QWEN2_SHA256 = {
    "chat_template.jinja": "2eefca287a0f008b170ce31bc2c4dabb398a64eb74716bf64db5d9a21da50da9",
    "config.json": "14fca3512466b3fcf34031627149b334b5c2aff3b88597af8eb3fb1e52261fe9",
    "generation_config.json": "1cfb0d84da53bbfd45ca0acee4abfd7d2b76c5a80f539043aedbcd577635dc5d",
    "model.safetensors": "6c566a137d0dffedb7854d7e07bce56798876e66b7b1944304f91ecba4903b27",
    "slime_tiny_model.json": "93f0229841de7902665f03aae940ba694eec89e584a2a554ff6a964cbd05b926",
    "tokenizer.json": "4cd5165966b940ffdb952d5869a9ae4cb16704e0dff564950104ef8b447d9a6d",
    "tokenizer_config.json": "18876a4117438a482ba760342f39926a3fab52de78587a35dd0f1798e6087b0d",
}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny VLM, shared by the module (≈ 2 s to build)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl", arch="qwen2_5_vl")


def _red_square() -> object:
    """A 56x56 white image with a red square in the middle: the example task's kind of picture."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).rectangle([14, 14, 41, 41], fill="red")
    return image


MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]


def _process(path: Path, image: object) -> dict[str, torch.Tensor]:
    """What Qwen2_5_VLProcessor does for one image, from the tokenizer and the PIL image processor.

    transformers 5.25 cannot build Qwen2_5_VLProcessor without torchvision (its video processor needs
    it), so the CPU path renders the chat template, patches the image and repeats <|image_pad|> once per
    merged patch (grid t*h*w / merge_size**2) itself, as the processor's replace_image_token does.
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
    vision = image_processor(images=[image], return_tensors="pt")
    n_tokens = int(vision["image_grid_thw"][0].prod()) // image_processor.merge_size**2
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    text = text.replace(IMAGE_PAD, IMAGE_PAD * n_tokens, 1)
    encoded = tokenizer(text, return_tensors="pt")
    return {**encoded, **vision}


def test_files_and_config(vlm_dir: Path) -> None:
    config = json.loads((vlm_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl"
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    preprocessor = json.loads((vlm_dir / "preprocessor_config.json").read_text())
    assert preprocessor["image_processor_type"] == "Qwen2VLImageProcessor"  # as the real checkpoints name it
    assert preprocessor["processor_class"] == "Qwen2_5_VLProcessor"
    assert preprocessor["patch_size"] == config["vision_config"]["patch_size"] == 14
    assert preprocessor["merge_size"] == config["vision_config"]["spatial_merge_size"] == 2
    assert preprocessor["size"] == {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    assert config["vision_config"]["out_hidden_size"] == config["text_config"]["hidden_size"]
    text = config["text_config"]
    # The rotary pairs split into (time, height, width) sections covering the whole head.
    assert (
        sum(text["rope_parameters"]["mrope_section"])
        == text["hidden_size"] // text["num_attention_heads"] // 2
    )
    assert text["rope_scaling"]["mrope_section"] == text["rope_parameters"]["mrope_section"]  # for 4.x
    template = (vlm_dir / "chat_template.jinja").read_text()
    assert template == json.loads((vlm_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_tokenizer_has_the_vision_tokens(vlm_dir: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((vlm_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(vlm_dir, local_files_only=True)
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    for name, token in zip(names, (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD), strict=True):
        assert tok.convert_tokens_to_ids(token) == config[name], name
        assert tok.encode(token, add_special_tokens=False) == [config[name]]  # one special token each
    assert len(tok) <= config["vocab_size"]
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0,
        1,
        2,
    ]

    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Colour?<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = [{"role": "user", "content": "12+3"}]  # string content renders as the text models' ChatML
    assert tok.apply_chat_template(plain, tokenize=False) == "<|im_start|>user\n12+3<|im_end|>\n"


def test_image_forward_and_rope_index(vlm_dir: Path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = json.loads((vlm_dir / "config.json").read_text())
    inputs = _process(vlm_dir, _red_square())
    input_ids, grid = inputs["input_ids"], inputs["image_grid_thw"]
    merge = config["vision_config"]["spatial_merge_size"]
    assert grid.tolist() == [[1, 4, 4]]  # 56x56 -> 4x4 patches of 14 -> 2x2 merged tokens
    n_image = int((input_ids == config["image_token_id"]).sum())
    assert n_image == int(grid.prod()) // merge**2 == 4
    assert inputs["pixel_values"].shape == (16, 3 * 2 * 14 * 14)  # patches x (channels * t * p * p)

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, local_files_only=True).eval()
    assert model.dtype == torch.float32
    mm_token_type_ids = (input_ids == config["image_token_id"]).int()  # text 0, image 1
    with torch.no_grad():
        logits = model(**inputs, mm_token_type_ids=mm_token_type_ids).logits
    assert logits.shape == (1, input_ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()

    positions, _ = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids,
        image_grid_thw=grid,
        attention_mask=inputs["attention_mask"],
    )
    assert positions.shape == (3, 1, input_ids.shape[1])
    image = positions[:, 0, mm_token_type_ids[0].bool()]
    start = int(image[0, 0])
    # One time step; rows and columns of the 2x2 merged grid; text resumes after the largest of them.
    assert image.tolist() == [[start] * 4, [start, start, start + 1, start + 1], [start, start + 1] * 2]
    after = int(torch.nonzero(mm_token_type_ids[0])[-1]) + 1
    assert positions[:, 0, after].tolist() == [start + 2] * 3


def test_auto_processor_matches_or_needs_torchvision(vlm_dir: Path) -> None:
    """With torchvision, AutoProcessor builds Qwen2_5_VLProcessor and agrees with the CPU path; without
    it, transformers 5.25 cannot build the processor at all (its video processor needs torchvision)."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        with pytest.raises((ImportError, AttributeError)):
            AutoProcessor.from_pretrained(vlm_dir, local_files_only=True)
        return
    processor = AutoProcessor.from_pretrained(vlm_dir, local_files_only=True, backend="pil")
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    image = _red_square()
    text = processor.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    got = processor(text=[text], images=[image], return_tensors="pt")
    want = _process(vlm_dir, image)
    assert got["input_ids"].tolist() == want["input_ids"].tolist()
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    assert torch.equal(got["pixel_values"], want["pixel_values"])


def test_remaking_is_a_no_op(vlm_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in vlm_dir.iterdir()}
    assert make_tiny_model(vlm_dir, arch="qwen2_5_vl") == vlm_dir
    assert {p.name: p.stat().st_mtime_ns for p in vlm_dir.iterdir()} == before
    settings = json.loads((vlm_dir / "slime_tiny_model.json").read_text())
    assert settings["vision"] == VISION_TRAITS


def test_head_dim_is_derived(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="derives head_dim"):
        make_tiny_model(tmp_path / "x", arch="qwen2_5_vl", head_dim=64)
    assert not (tmp_path / "x").exists()


def test_text_models_are_unchanged(tmp_path: Path) -> None:
    import transformers

    versions = {"transformers": transformers.__version__, "torch": ".".join(torch.__version__.split(".")[:2])}
    if versions != QWEN2_VERSIONS:
        pytest.skip(f"checksums recorded under {QWEN2_VERSIONS}, running {versions}")
    path = make_tiny_model(tmp_path / "qwen2")
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}
    assert digests == QWEN2_SHA256
