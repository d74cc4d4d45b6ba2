"""A VLM's micro-batches: Qwen2.5-VL's 3-D RoPE positions, and the images that go with each row.

The positions must be the ones transformers' ``get_rope_index`` gives (the engine samples with the
same), and every sequence of a micro-batch must keep the positions it has alone, packed, padded or
behind a shared prompt; the images must come in the order of their pad tokens in the row, a shared
prompt's once. Hand-made ids on the tiny VLM's vocabulary: no Megatron, no image processing.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from slime.backends.megatron.batching import MicroBatch, make_micro_batches, pad_to_shape
from slime.backends.megatron.mrope_positions import (
    MropeConfig,
    image_spans,
    mrope_config,
    mrope_positions,
    read_mrope_config,
)
from tools.make_tiny_model import IMAGE_PAD, make_tiny_model

VS, VE, PAD, VIDEO = 99, 100, 101, 102  # the tiny VLM's <|vision_start|>, <|vision_end|>, pads
MROPE = MropeConfig(image_token_id=PAD, vision_start_token_id=VS, spatial_merge_size=2)
CPU = torch.device("cpu")

# Images by (grid, tag): the tag fills every patch row, so the order of pixel_values can be read back.
A, B, C, D = ((1, 4, 4), 1.0), ((1, 2, 4), 2.0), ((1, 4, 2), 3.0), ((1, 2, 6), 4.0)


def img(image: tuple) -> list[int]:
    """An image's tokens: <|vision_start|>, one pad per merged patch, <|vision_end|>."""
    (t, h, w), _ = image
    return [VS, *[PAD] * (t * h * w // 4), VE]


def positions(tokens: list[int], images: list[tuple]) -> torch.Tensor:
    grids = torch.tensor([grid for grid, _ in images]) if images else None
    return mrope_positions(tokens, grids, **asdict(MROPE))


# ---- positions against transformers -------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl", arch="qwen2_5_vl")


@pytest.fixture(scope="module")
def hf_model(vlm_dir: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, local_files_only=True)


CASES = {
    "one image": ([5, 6, *img(A), 7], [A]),
    "two images, text before, between and after": ([5, *img(A), 6, 7, 8, *img(D), 9], [A, D]),
    "no image": (list(range(5, 15)), []),
    "image first, then adjacent images of other sizes": ([*img(B), *img(D), *img(C), 6, 7], [B, D, C]),
    "wide and tall": (
        [5, *img(((1, 4, 8), 0.0)), 6, *img(((1, 8, 2), 0.0))],
        [((1, 4, 8), 0.0), ((1, 8, 2), 0.0)],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_positions_equal_transformers_get_rope_index(hf_model, case: str) -> None:
    tokens, images = CASES[case]
    ids = torch.tensor([tokens])
    grids = torch.tensor([grid for grid, _ in images]) if images else None
    expected, _ = hf_model.model.get_rope_index(ids, (ids == PAD).int(), image_grid_thw=grids)
    got = positions(tokens, images)
    assert got.dtype == torch.long and got.shape == (3, len(tokens))
    assert torch.equal(got, expected[:, 0])
    if not images:
        assert torch.equal(got, torch.arange(len(tokens)).expand(3, -1))


def test_positions_of_a_processed_chat_equal_transformers(vlm_dir: Path, hf_model) -> None:
    """Two real images of other shapes in a chat prompt, ids as the rollout makes them (template, image
    processor, one pad per merged patch), the ids read from the checkpoint's config."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir, local_files_only=True)
    processor = AutoImageProcessor.from_pretrained(vlm_dir, local_files_only=True, backend="pil")
    images = [Image.new("RGB", (56, 56), "red"), Image.new("RGB", (112, 56), "blue")]
    grids = processor(images=images, return_tensors="pt")["image_grid_thw"]
    assert grids.tolist() == [[1, 4, 4], [1, 4, 8]]
    parts = [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    for count in (grids.prod(-1) // 4).tolist():
        text = text.replace(IMAGE_PAD, "<|placeholder|>" * count, 1)
    ids = tokenizer(text.replace("<|placeholder|>", IMAGE_PAD), return_tensors="pt")["input_ids"]
    config = read_mrope_config(vlm_dir)
    assert int((ids == config.image_token_id).sum()) == 4 + 8
    expected, _ = hf_model.model.get_rope_index(
        ids, (ids == config.image_token_id).int(), image_grid_thw=grids
    )
    assert torch.equal(mrope_positions(ids[0], grids, **asdict(config)), expected[:, 0])


def test_positions_by_hand() -> None:
    """Text advances all rows; image A (2x2 merged patches) sits at offset 3, after <|vision_start|>,
    as t/h/w grid positions; the text after it continues from its largest position + 1."""
    got = positions([5, 6, *img(A), 7], [A])
    assert got.tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 3, 4, 4, 5, 6],
        [0, 1, 2, 3, 4, 3, 4, 5, 6],
    ]


def test_config_is_read_from_the_hf_checkpoint(vlm_dir: Path) -> None:
    assert read_mrope_config(vlm_dir) == MROPE
    config = json.loads((vlm_dir / "config.json").read_text())
    assert mrope_config({"model_type": "qwen2", "vocab_size": 112}) is None  # a text model
    with pytest.raises(ValueError, match="model_type 'llava'"):
        mrope_config({**config, "model_type": "llava"})
    with pytest.raises(ValueError, match="vision_start_token_id"):
        mrope_config({k: v for k, v in config.items() if k != "vision_start_token_id"})


def test_videos_and_mismatched_pads_are_refused() -> None:
    with pytest.raises(ValueError, match="video"):
        positions([5, *img(A), 6], [((2, 4, 4), 0.0)])  # t > 1: a video grid
    # a video pad the policy sampled (no data holds videos) is a token with a text position
    assert positions([5, VS, VIDEO, VE, 6], []).tolist() == [list(range(5))] * 3
    with pytest.raises(ValueError, match="2 images but 1 image blocks"):
        positions([5, *img(A), 6], [A, B])
    with pytest.raises(ValueError, match="image 0 has 4 tokens by its grid but 3 pads"):
        positions([5, VS, PAD, PAD, PAD, VE], [A])


def test_pads_after_the_images_are_text_as_the_engine_samples_them() -> None:
    """A response that samples <|image_pad|> (the tiny model does) advances by one, like any token."""
    tokens = [5, *img(A), 6, PAD, VS, PAD, 7]
    got = positions(tokens, [A])
    assert got[:, -5:].tolist() == [[5, 6, 7, 8, 9]] * 3
    assert image_spans(tokens, torch.tensor([A[0]]), **asdict(MROPE)) == [(2, 6)]


# ---- micro-batches ------------------------------------------------------------------------------

P1 = [5, *img(A), 6, 7]
SAMPLES = [  # (prompt, prompt images, response, response images)
    (P1, [A], [20, 21], []),
    (P1, [A], [22, 23, 24], []),
    (P1, [A], [25, *img(D), 26, 27], [D]),  # an image observation inside the response (multi-turn)
    ([8, 9, 10], [], [28, 29], []),  # text only
    ([5, *img(B), 6, *img(C), 7], [B, C], [30, 31], []),
    ([5, *img(C), 6, *img(B), 7], [C, B], [32, 33], []),  # the same ids as the last: other pictures
]


def vlm_data() -> dict[str, list]:
    data: dict[str, list] = {"tokens": [], "response_lengths": [], "loss_masks": [], "loss_weights": []}
    data["multimodal_train_inputs"] = []
    for prompt, prompt_images, response, response_images in SAMPLES:
        data["tokens"].append(prompt + response)
        data["response_lengths"].append(len(response))
        data["loss_masks"].append([1] * len(response))
        data["loss_weights"].append(1.0)
        images = prompt_images + response_images
        data["multimodal_train_inputs"].append(
            {
                "pixel_values": torch.cat([torch.full((t * h * w, 6), tag) for (t, h, w), tag in images]),
                "image_grid_thw": torch.tensor([grid for grid, _ in images]),
            }
            if images
            else None
        )
    return data


def sample_images(k: int) -> list[tuple]:
    return SAMPLES[k][1] + SAMPLES[k][3]


def tags(batch: MicroBatch) -> list[float]:
    """The tag of each image of ``pixel_values``, in order (one per image, via the grids)."""
    sizes = batch.image_grid_thw.prod(-1).tolist()
    return [float(chunk[0, 0]) for chunk in batch.pixel_values.split(sizes)]


def assert_images_follow_the_pads(batch: MicroBatch) -> None:
    """Row by row, the image blocks of ``tokens`` are ``image_grid_thw``'s images, in order."""
    grids = batch.image_grid_thw
    assert batch.pixel_values.shape[0] == int(grids.prod(-1).sum())
    blocks = []
    for row in batch.tokens.tolist():
        starts = [i + 1 for i in range(len(row) - 1) if row[i] == VS and row[i + 1] == PAD]
        blocks += [next(j for j in range(s, len(row)) if row[j] != PAD) - s for s in starts]
    assert blocks == (grids.prod(-1) // 4).tolist()
    assert sum(row.count(PAD) for row in batch.tokens.tolist()) == int(grids.prod(-1).sum()) // 4
    assert torch.equal(batch.image_mask, batch.tokens == PAD)  # (no sampled pad in these samples)


def packed_sequences(batch: MicroBatch) -> list[tuple[list[int], torch.Tensor]]:
    """Each sample's tokens and positions read back from a packed row: its segment's prompt (up to the
    position that predicts its first response token), then its own response."""
    row, pos = batch.tokens[0], batch.position_ids[:, 0]
    out = []
    for columns, n in zip(
        batch.split_responses(batch.predictor_columns), batch.response_lengths, strict=True
    ):
        prompt_end, at = int(columns[0]), int(columns[1])  # every test response has >= 2 tokens
        start = int(batch.cu_seqlens[batch.cu_seqlens <= prompt_end].max())
        picked = torch.cat([torch.arange(start, prompt_end + 1), torch.arange(at, at + n)])
        out.append((row[picked].tolist(), pos[:, picked]))
    return out


@pytest.mark.parametrize("share", [False, True])
def test_packed_sequences_keep_their_own_positions_and_images(share: bool) -> None:
    data = vlm_data()
    (batch,) = make_micro_batches(
        data, [list(range(6))], CPU, pad_to_multiple=8, share_prompts=share, mrope=MROPE
    )
    total = batch.tokens.shape[1]
    assert batch.position_ids.shape == (3, 1, total) and total % 8 == 0
    for k, (tokens, got) in enumerate(packed_sequences(batch)):
        assert tokens == data["tokens"][k]
        assert torch.equal(got, positions(data["tokens"][k], sample_images(k)))
    pad = total - int(batch.cu_seqlens[-2])
    assert 0 < pad < 8  # the data leaves a padding segment in both layouts
    assert batch.position_ids[:, 0, total - pad :].tolist() == [list(range(pad))] * 3
    # s0..s2 share P1 (image A once); s4 and s5 have the same ids but other pictures: not shared
    expected = [1.0, 4.0, 2.0, 3.0, 3.0, 2.0] if share else [1.0, 1.0, 1.0, 4.0, 2.0, 3.0, 3.0, 2.0]
    assert tags(batch) == expected
    assert_images_follow_the_pads(batch)
    assert (batch.response_blocks is not None) == share
    if share:
        assert len(batch.cu_seqlens) - 1 == 5  # P1's segment, three alone, the padding
    responses = [tokens[-n:] for tokens, n in zip(data["tokens"], data["response_lengths"], strict=True)]
    assert [t.tolist() for t in batch.split_responses(batch.targets)] == responses


def test_mixed_and_text_only_micro_batches() -> None:
    data = vlm_data()
    text, mixed = make_micro_batches(data, [[3], [3, 4]], CPU, mrope=MROPE)
    n = len(data["tokens"][3])
    assert text.position_ids.tolist() == [[list(range(n))]] * 3  # 3-D for a VLM even without images
    assert text.pixel_values is None and text.image_grid_thw is None
    assert tags(mixed) == [2.0, 3.0] and mixed.image_grid_thw.tolist() == [[1, 2, 4], [1, 4, 2]]
    assert torch.equal(mixed.position_ids[:, 0, n:], positions(data["tokens"][4], sample_images(4)))


def test_padded_rows_hold_each_sequence_at_its_own_positions() -> None:
    data = vlm_data()
    (batch,) = make_micro_batches(data, [[2, 3, 5]], CPU, packed=False, mrope=MROPE)
    width = batch.tokens.shape[1]
    assert batch.position_ids.shape == (3, 3, width) and not batch.packed
    for row, k in enumerate([2, 3, 5]):
        n = len(data["tokens"][k])
        alone = positions(data["tokens"][k], sample_images(k))
        assert torch.equal(batch.position_ids[:, row, :n], alone)
        after = alone.max() + 1 + torch.arange(width - n)  # the padding continues the row
        assert torch.equal(batch.position_ids[:, row, n:], after.expand(3, -1))
    assert tags(batch) == [1.0, 4.0, 3.0, 2.0]
    assert_images_follow_the_pads(batch)
    # one shape for virtual pipeline stages: rows and columns added, the real positions kept
    wide = pad_to_shape(batch, 4, width + 2)
    assert wide.position_ids.shape == (3, 4, width + 2)
    assert torch.equal(wide.position_ids[:, :3, :width], batch.position_ids)
    assert wide.position_ids[:, 3].tolist() == [list(range(width + 2))] * 3
    assert wide.pixel_values is batch.pixel_values


def test_packed_padding_to_one_shape_keeps_three_rows() -> None:
    (batch,) = make_micro_batches(vlm_data(), [[0, 1]], CPU, mrope=MROPE)
    wide = pad_to_shape(batch, 1, batch.tokens.shape[1] + 3)
    assert wide.position_ids.shape == (3, 1, batch.tokens.shape[1] + 3)
    assert wide.position_ids[:, 0, -3:].tolist() == [[0, 1, 2]] * 3


def test_text_models_keep_the_one_row_layout_and_refuse_images() -> None:
    data = vlm_data()
    text_only = {key: [values[3]] for key, values in data.items()}
    (packed,) = make_micro_batches(text_only, [[0]], CPU)
    (padded,) = make_micro_batches(text_only, [[0]], CPU, packed=False)
    assert packed.position_ids.tolist() == padded.position_ids.tolist() == [list(range(5))]
    assert packed.pixel_values is None and padded.image_grid_thw is None
    with pytest.raises(ValueError, match="not a vision-language model"):
        make_micro_batches(data, [[0]], CPU)
    video = {
        **text_only,
        "multimodal_train_inputs": [
            {"pixel_values_videos": torch.zeros(1), "video_grid_thw": torch.zeros(1)}
        ],
    }
    with pytest.raises(ValueError, match="only images"):
        make_micro_batches(video, [[0]], CPU, mrope=MROPE)


@pytest.mark.parametrize("packed", [True, False])
def test_a_sampled_pad_in_a_response_is_not_an_image_token(packed: bool) -> None:
    """The model's features go where the image mask says: a pad the policy sampled is a token."""
    tokens = [5, *img(A), 6, PAD, 7]
    image = {"pixel_values": torch.ones(16, 6), "image_grid_thw": torch.tensor([A[0]])}
    data = {
        "tokens": [tokens], "response_lengths": [3], "loss_masks": [[1, 1, 1]], "loss_weights": [1.0],
        "multimodal_train_inputs": [image],
    }  # fmt: skip
    (batch,) = make_micro_batches(data, [[0]], CPU, packed=packed, pad_to_multiple=4, mrope=MROPE)
    assert batch.image_mask[0, : len(tokens)].tolist() == [
        False,
        False,
        *[True] * 4,
        False,
        False,
        False,
        False,
    ]
    assert int(batch.image_mask.sum()) == 4 and batch.tokens[0, len(tokens) - 2] == PAD
