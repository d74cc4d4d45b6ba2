"""The torch engine serves the tiny Qwen2.5-VL over SGLang's /generate: images in SGLang's forms, the
prompt expanded as SGLang expands it, numbers equal to a plain transformers forward, no KV shared
between different pictures, SGLang's error replies, and weight updates by checkpoint name.

One engine runs in this process behind its real aiohttp app (a background event loop), so the tests
speak HTTP to it as the rollout does.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from slime.backends.torch_engine.protocol import UnhandledError
from slime.backends.torch_engine.vision import VisionProcessor
from slime.backends.torch_engine.weights import serialize_named_tensors
from tests.support.served_engine import ServedEngine
from tools.make_tiny_model import IMAGE_PAD, VISION_END, VISION_START, make_tiny_model

PROMPT = f"<|im_start|>user\n{VISION_START}{IMAGE_PAD}{VISION_END}Colour?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
IMAGE_TOKENS = 4  # a 56x56 picture: 4x4 patches of 14, merged 2x2


def _png(color: str, size: int = 56) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).rectangle([size // 4, size // 4, 3 * size // 4, 3 * size // 4], fill=color)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(color: str) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(color)).decode()


class Served(ServedEngine):
    """The engine and its app on a loop thread; ``url`` takes HTTP requests."""

    def generate(self, **body: Any) -> Any:
        response = self.post("/generate", body)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl", arch="qwen2_5_vl")


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Served]:
    server = Served(["--model-path", str(model_dir)])
    yield server
    server.close()


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, local_files_only=True).eval()


@pytest.fixture(scope="module")
def prompt_ids(served: Served) -> list[int]:
    return served.engine.runner.tokenizer(PROMPT)["input_ids"]


def hf_logprobs(model_dir: Path, hf: Any, ids: list[int], colors: list[str]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 from one transformers forward with the pictures' pixels."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True, backend="pil")
    images = [Image.open(io.BytesIO(_png(c))).convert("RGB") for c in colors]
    vision = processor(images=images, return_tensors="pt") if images else {}
    input_ids = torch.tensor([ids])
    types = (input_ids == hf.config.image_token_id).int()
    with torch.no_grad():
        logits = hf(input_ids=input_ids, mm_token_type_ids=types, **vision).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, input_ids[0, 1:, None])[:, 0]


def expanded(ids: list[int], pad: int, per_image: int = IMAGE_TOKENS) -> list[int]:
    out: list[int] = []
    for token in ids:
        out.extend([token] * per_image if token == pad else [token])
    return out


def test_text_and_input_ids_with_an_image_give_the_same_reply(served: Served, prompt_ids: list[int]) -> None:
    image = data_url("red")
    by_text = served.generate(text=PROMPT, image_data=[image], sampling_params=GREEDY)
    by_ids = served.generate(input_ids=prompt_ids, image_data=image, sampling_params=GREEDY)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert len(by_ids["output_ids"]) == 6
    for reply in (by_text, by_ids):
        meta = reply["meta_info"]
        assert meta["prompt_tokens"] == len(prompt_ids) - 1 + IMAGE_TOKENS
        assert meta["image_tokens"] == IMAGE_TOKENS
    text_only = served.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert "image_tokens" not in text_only["meta_info"]
    assert requests.get(f"{served.url}/health", timeout=30).status_code == 200


def test_logprobs_equal_a_transformers_forward(
    served: Served, hf: Any, model_dir: Path, prompt_ids: list[int]
) -> None:
    """Prompt log-probs (prefill with the image features and 3-D positions) and sampled tokens' log-probs
    (decode at position + rope delta) equal one forward of the whole sequence."""
    pad = hf.config.image_token_id
    reply = served.generate(
        input_ids=prompt_ids,
        image_data=[data_url("red")],
        sampling_params={"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3},
        return_logprob=True,
        logprob_start_len=0,
    )
    meta, out = reply["meta_info"], reply["output_ids"]
    full = expanded(prompt_ids, pad)
    assert [t[1] for t in meta["input_token_logprobs"]] == full
    want = hf_logprobs(model_dir, hf, full + out, ["red"])
    prompt = torch.tensor([t[0] for t in meta["input_token_logprobs"][1:]])
    sampled = torch.tensor([t[0] for t in meta["output_token_logprobs"]])
    assert (prompt - want[: len(full) - 1]).abs().max() < 1e-5
    assert (sampled - want[len(full) - 1 :]).abs().max() < 1e-5


def test_greedy_decode_equals_argmax_continuation(
    served: Served, hf: Any, model_dir: Path, prompt_ids: list[int]
) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True, backend="pil")
    vision = processor(images=[Image.open(io.BytesIO(_png("green"))).convert("RGB")], return_tensors="pt")
    ids = expanded(prompt_ids, hf.config.image_token_id)
    want = []
    for _ in range(6):
        input_ids = torch.tensor([ids + want])
        types = (input_ids == hf.config.image_token_id).int()
        with torch.no_grad():
            logits = hf(input_ids=input_ids, mm_token_type_ids=types, **vision).logits[0, -1]
        want.append(int(logits.argmax()))
    reply = served.generate(input_ids=prompt_ids, image_data=[data_url("green")], sampling_params=GREEDY)
    assert reply["output_ids"] == want


def _prompt_logprobs(reply: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([t[0] for t in reply["meta_info"]["input_token_logprobs"][1:]])


def test_batch_of_image_lists_shares_kv_only_between_equal_pictures(
    served: Served, prompt_ids: list[int], hf: Any, model_dir: Path
) -> None:
    """Batch form (input_ids list of lists, image_data list of lists); rows with the same ids and
    different pictures get their own prefill (different numbers), the same picture is shared."""
    red, blue = data_url("red"), data_url("blue")
    body = {
        "input_ids": [prompt_ids] * 3,
        "image_data": [[red], [blue], [red]],
        "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }
    replies = served.generate(**body)
    assert len(replies) == 3
    logprobs = [torch.tensor([t[0] for t in r["meta_info"]["output_token_logprobs"]]) for r in replies]
    first = [r["output_ids"][0] for r in replies]
    full = expanded(prompt_ids, hf.config.image_token_id)
    for reply, color, logprob in zip(replies, ("red", "blue", "red"), logprobs, strict=True):
        want = hf_logprobs(model_dir, hf, full + reply["output_ids"], [color])[len(full) - 1 :]
        assert (logprob - want).abs().max() < 1e-5
        assert reply["meta_info"]["prompt_tokens"] == len(full)
    cached = [r["meta_info"]["cached_tokens"] for r in replies]
    assert cached == [0, 0, len(full) - 1]  # only the second red picture reused the first one's prefill
    red_first = hf_logprobs(model_dir, hf, [*full, first[0]], ["red"])[-1]
    blue_first = hf_logprobs(model_dir, hf, [*full, first[0]], ["blue"])[-1]
    assert (red_first - blue_first).abs() > 1e-6  # the pictures do change the numbers

    # One picture per request as a flat list, the batch's own form for single images.
    flat = served.generate(input_ids=[prompt_ids] * 2, image_data=[red, blue], sampling_params=GREEDY)
    assert [r["meta_info"]["image_tokens"] for r in flat] == [IMAGE_TOKENS] * 2
    # A text row and an image row prefilled together: each gets its own positions and only its pixels.
    text_ids = [1, 33, 31, 17, 30, 2]
    mixed = served.generate(
        input_ids=[text_ids, prompt_ids],
        image_data=[[], [blue]],
        sampling_params={"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True},
        return_logprob=True,
    )
    assert (
        "image_tokens" not in mixed[0]["meta_info"] and mixed[1]["meta_info"]["image_tokens"] == IMAGE_TOKENS
    )
    for reply, ids, colors in zip(mixed, (text_ids, full), ([], ["blue"]), strict=True):
        got = torch.tensor([t[0] for t in reply["meta_info"]["output_token_logprobs"]])
        want = hf_logprobs(model_dir, hf, ids + reply["output_ids"], colors)[len(ids) - 1 :]
        assert (got - want).abs().max() < 1e-5
    wrong = served.post("/generate", {"input_ids": [prompt_ids] * 2, "image_data": [red, blue, red]})
    assert wrong.status_code == 400
    assert wrong.json() == {
        "error": {"message": "The length of image_data should be equal to the batch size."}
    }


def test_same_text_different_images_in_turn_give_different_prompt_logprobs(
    served: Served, prompt_ids: list[int]
) -> None:
    def ask(color: str) -> torch.Tensor:
        return _prompt_logprobs(
            served.generate(
                input_ids=prompt_ids,
                image_data=[data_url(color)],
                sampling_params={"max_new_tokens": 1},
                return_logprob=True,
                logprob_start_len=0,
            )
        )

    red, blue, red_again = ask("red"), ask("blue"), ask("red")
    after_image = prompt_ids.index(served.engine.runner.model.config.vision_end_token_id) + IMAGE_TOKENS - 1
    assert (red[after_image:] - blue[after_image:]).abs().max() > 1e-6
    assert torch.equal(red, red_again)


def test_placeholder_mismatches_are_answered_as_sglang(
    served: Served, prompt_ids: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    red, blue = data_url("red"), data_url("blue")
    # More placeholders than images: SGLang 0.5.23's legacy loader refuses the request.
    text = PROMPT.replace("Colour", VISION_START + IMAGE_PAD + VISION_END)
    two = served.post("/generate", {"text": text, "image_data": [red]})
    assert two.status_code == 400
    assert two.json() == {
        "error": {"message": "Prompt has 2 image placeholders but 1 image inputs were provided"}
    }
    # SGLang 0.5.19 (whose legacy loader raises a RuntimeError there) answers a plain 500.
    engine = served.engine
    older = VisionProcessor(engine.runner.model_path, engine.runner.model, engine.runner.tokenizer, False)
    with pytest.raises(UnhandledError, match="An exception occurred while loading multimodal data: "):
        older.prepare(text, None, [red])
    # Fewer placeholders than images: the images past the last placeholder are dropped.
    dropped = served.generate(input_ids=prompt_ids, image_data=[red, blue], sampling_params=GREEDY)
    assert dropped["meta_info"]["image_tokens"] == IMAGE_TOKENS
    assert (
        dropped["output_ids"]
        == served.generate(input_ids=prompt_ids, image_data=[red], sampling_params=GREEDY)["output_ids"]
    )
    # Two pad ids in one placeholder with two images: one placeholder, so one image is loaded; the
    # caller's ids then have 2 pad ids for 1 image, SGLang logs _expand_input_ids' error and answers
    # from the decoded and retokenized prompt (one pad, expanded).
    tokenizer = served.engine.runner.tokenizer
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    at = prompt_ids.index(pad)
    double = [*prompt_ids[:at], pad, pad, *prompt_ids[at + 1 :]]
    with caplog.at_level(logging.WARNING, logger="slime.backends.torch_engine.vision"):
        reply = served.generate(input_ids=double, image_data=[red, blue], sampling_params=GREEDY)
    assert (
        "Due to prompt has 2 image placeholder token(s) but 1 image(s) were provided, falling back to "
        "decode+retokenize, which may change prompt length (token drift)."
    ) in caplog.text
    assert reply["meta_info"]["prompt_tokens"] == len(prompt_ids) - 1 + IMAGE_TOKENS
    assert reply["output_ids"] == dropped["output_ids"]


def test_undecodable_images_are_400_and_the_engine_keeps_serving(
    served: Served, prompt_ids: list[int], tmp_path: Path
) -> None:
    junk = "data:image/png;base64," + base64.b64encode(b"this is not a picture").decode()
    response = served.post("/generate", {"input_ids": prompt_ids, "image_data": [junk]})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith(
        f"An exception occurred while loading IMAGE data at index 0: Error while loading data {junk}: "
        "Could not decode image: cannot identify image file"
    )
    not_base64 = served.post("/generate", {"input_ids": prompt_ids, "image_data": ["@@@"]})
    assert not_base64.status_code == 400
    assert not_base64.json()["error"]["message"].startswith("An exception occurred while loading IMAGE data")
    # A missing file is no client error in SGLang: its server's unhandled RuntimeError, a plain 500.
    missing = served.post("/generate", {"input_ids": prompt_ids, "image_data": [str(tmp_path / "none.png")]})
    assert (missing.status_code, missing.text) == (500, "Internal Server Error")
    # A file path and bare base64 are images too, and the engine still answers.
    path = tmp_path / "red.png"
    path.write_bytes(_png("red"))
    bare = base64.b64encode(_png("red")).decode()
    replies = [
        served.generate(input_ids=prompt_ids, image_data=[item], sampling_params=GREEDY)
        for item in (str(path), bare, data_url("red"))
    ]
    assert replies[0]["output_ids"] == replies[1]["output_ids"] == replies[2]["output_ids"]


def test_weight_update_by_checkpoint_name_changes_the_output(
    served: Served, prompt_ids: list[int], model_dir: Path
) -> None:
    name = "visual.merger.mlp.2.bias"  # the checkpoint's name; the module holds model.visual.merger...
    before = served.post("/get_weights_by_name", {"name": name, "truncate_size": 10_000}).json()
    body = {
        "input_ids": prompt_ids,
        "image_data": [data_url("red")],
        "sampling_params": {"max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    old_logprobs = _prompt_logprobs(served.generate(**body))
    new = torch.linspace(-2.0, 2.0, len(before))

    def push(tensors: list[tuple[str, torch.Tensor]]) -> requests.Response:
        assert served.post("/begin_weight_update", {}).status_code == 200
        try:
            entry = serialize_named_tensors(tensors)
            return served.post("/update_weights_from_tensor", {"serialized_named_tensors": [entry]})
        finally:
            assert served.post("/end_weight_update", {}).status_code == 200

    assert push([(name, new)]).status_code == 200
    try:
        got = served.post("/get_weights_by_name", {"name": name, "truncate_size": len(before)}).json()
        assert torch.allclose(torch.tensor(got), new)
        new_logprobs = _prompt_logprobs(served.generate(**body))
        assert (new_logprobs - old_logprobs).abs().max() > 1e-4
        # Language-model names map too, and unknown ones still fail as for a text model.
        embed = served.post("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 1})
        assert embed.status_code == 200 and len(embed.json()[0]) > 0
        unknown = push([("visual.no_such.weight", new)])
        assert unknown.status_code == 400
        assert (
            "unknown parameter names (HF names expected): ['visual.no_such.weight']"
            in unknown.json()["message"]
        )
    finally:  # the checkpoint's own names, all of them, from disk
        restored = served.post("/update_weights_from_disk", {"model_path": str(model_dir)})
        assert restored.json()["message"] == "Succeeded to update model weights (56 tensors)."
    assert served.post("/get_weights_by_name", {"name": name, "truncate_size": len(before)}).json() == before


def _running(served: Served) -> int:
    return served.engine.scheduler.internal_state()["num_running_reqs"]


def test_retracted_and_aborted_image_requests_keep_their_images(
    served: Served, prompt_ids: list[int]
) -> None:
    """A retraction drops the KV cache; the request is prefilled again with its pictures and the
    positions past the prompt (index + rope delta), so its numbers are those of an uninterrupted run."""
    body = {
        "input_ids": prompt_ids,
        "image_data": [data_url("red")],
        "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    reference = served.generate(**body)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(served.generate, **body)
        while _running(served) == 0:
            time.sleep(0.001)
        served.post("/pause_generation", {"mode": "retract"})
        served.post("/continue_generation", {})
        reply = future.result(60)
    assert reply["meta_info"]["num_retractions"] == 1
    assert reply["output_ids"] == reference["output_ids"]
    got = torch.tensor([t[0] for t in reply["meta_info"]["output_token_logprobs"]])
    want = torch.tensor([t[0] for t in reference["meta_info"]["output_token_logprobs"]])
    assert (got - want).abs().max() < 1e-5

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(served.generate, rid="picture", **body)
        while _running(served) == 0:
            time.sleep(0.001)
        served.post("/abort_request", {"rid": "picture"})
        aborted = future.result(60)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted["output_ids"] == reference["output_ids"][: len(aborted["output_ids"])]
    again = served.generate(**{**body, "sampling_params": GREEDY})
    assert again["output_ids"] == reference["output_ids"][:6]


def test_a_multi_turn_sample_holds_exactly_the_ids_the_engine_saw(served: Served, model_dir: Path) -> None:
    """Two model turns with a picture shown in between, through the rollout's own helpers: the sample's
    ids are the engine's expanded input (read back as its input_token_logprobs), and the log-probs
    recorded at sampling time are the engine's log-probs of those tokens in the whole sequence."""
    import argparse

    from slime.rollout.generate_utils import (
        append_image_observation,
        append_model_turn,
        generate_turn,
        prompt_ids,
        request_images,
    )
    from slime.rollout.sample import Sample
    from slime.rollout.vision import vision_processor

    args = argparse.Namespace(
        hf_checkpoint=str(model_dir), sglang_router_ip="127.0.0.1", sglang_router_port=served.port
    )
    sample = Sample(index=0, prompt=PROMPT.replace(f"{VISION_START}{IMAGE_PAD}{VISION_END}", "<image>"))
    sample.multimodal_inputs = {"image": [data_url("red")]}
    sample.tokens = prompt_ids(args, sample)

    async def two_turns() -> None:
        for observation in (True, False):
            turn = await generate_turn(args, sample.tokens, dict(GREEDY), images=request_images(args, sample))
            append_model_turn(sample, turn)
            if observation:
                append_image_observation(
                    args, sample, "<|im_start|>user\n<image>same?<|im_end|>\n", [data_url("blue")]
                )

    asyncio.run(two_turns())
    assert sample.status is Sample.Status.TRUNCATED and len(sample.multimodal_inputs["image"]) == 2
    processor = vision_processor(str(model_dir))
    reply = served.generate(
        input_ids=processor.collapse(sample.tokens, 2),
        image_data=request_images(args, sample),
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
    )
    seen = reply["meta_info"]["input_token_logprobs"]
    assert [entry[1] for entry in seen] == sample.tokens
    trained = [i for i, m in enumerate(sample.loss_mask) if m]
    assert len(trained) == 2 * GREEDY["max_new_tokens"]
    start = sample.prompt_length
    whole = [seen[start + i][0] for i in trained]
    assert whole == pytest.approx([sample.rollout_log_probs[i] for i in trained], abs=1e-5)


def test_an_opd_teacher_scores_a_sample_with_its_picture(
    served: Served, hf: Any, model_dir: Path, prompt_ids: list[int]
) -> None:
    """On-policy distillation of a vision-language sample: the teacher request carries the sample's
    picture and one pad per picture, and the teacher's log-probs of the response are those of one
    transformers forward over the expanded ids with the picture's pixels."""
    import argparse

    from slime.rollout.sample import Sample
    from slime.rollout.teacher import response_log_probs, teacher_request

    response = [5, 9, 12]
    full = expanded(prompt_ids, hf.config.image_token_id)
    sample = Sample(
        index=0, tokens=full + response, response_length=3, multimodal_inputs={"image": [data_url("red")]}
    )
    payload = teacher_request(argparse.Namespace(hf_checkpoint=str(model_dir)), sample, 1.0)
    assert payload["input_ids"] == prompt_ids + response and len(payload["image_data"]) == 1
    teacher = torch.tensor(response_log_probs(served.generate(**payload), sample, "vlm teacher"))
    want = hf_logprobs(model_dir, hf, full + response, ["red"])[-3:]
    assert (teacher - want).abs().max() < 1e-5
