"""--multimodal-keys: image items read with their prompt, checked against its placeholders, kept raw."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import pytest
from PIL import Image

from slime.cli import check_implemented
from slime.config import ConfigError, build_parser, parse_args
from slime.config.settings.data import DataSettings, parse_multimodal_keys
from slime.rollout.data_source import PromptDataSource
from slime.rollout.prompt_files import DataError, PromptFormat, load_prompts
from slime.rollout.sample import Sample
from tests.support.configs import base, expect_error, make_hf
from tests.support.rollouts import write_jsonl

KEYS = {"image": "images"}


def write_png(path: Path, colour: str = "red", size: tuple[int, int] = (8, 6)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, format="PNG")
    return path


def png_base64(colour: str = "blue") -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), colour).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def rows(tmp_path: Path) -> list[dict]:
    """Good records: relative and absolute paths, bare and data: base64, dict items, chat parts."""
    write_png(tmp_path / "img" / "red.png")
    green = write_png(tmp_path / "green.png", "green")
    b64 = png_base64()
    return [
        {"input": "<image> what colour?", "images": ["img/red.png"], "label": "red"},
        {"input": "compare <image> and <image>", "images": [str(green), b64], "label": "x"},
        {"input": "one image, not a list: <image>", "images": f"data:image/png;base64,{b64}", "label": "y"},
        {
            "input": "<image>",
            "images": [{"image": "img/red.png", "min_pixels": 16, "max_pixels": 64}],
            "label": "z",
        },
        {
            "input": [
                {"role": "system", "content": "look"},
                {
                    "role": "user",
                    "content": [
                        {"type": "image"},
                        {"type": "text", "text": "and <image>"},
                        {"type": "image_url", "image_url": {"url": "ignored"}},
                    ],
                },
            ],
            "images": ["img/red.png", "green.png", b64],
            "label": "w",
        },
        {"input": "text only", "label": "t"},
    ]


def fmt() -> PromptFormat:
    return PromptFormat(label_key="label", multimodal_keys=KEYS)


def test_items_are_kept_raw_in_placeholder_order(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", rows(tmp_path))
    samples = load_prompts(path, fmt())
    red, green, b64 = str(tmp_path / "img" / "red.png"), str(tmp_path / "green.png"), png_base64()
    assert [s.multimodal_inputs for s in samples] == [
        {"image": [red]},
        {"image": [green, b64]},
        {"image": [f"data:image/png;base64,{b64}"]},
        {"image": [{"image": red, "min_pixels": 16, "max_pixels": 64}]},
        {"image": [red, green, b64]},
        None,
    ]
    assert all(s.multimodal_train_inputs is None for s in samples)
    assert samples[0].prompt == "<image> what colour?" and samples[0].label == "red"


def test_parquet_reads_like_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    red = write_png(tmp_path / "img" / "red.png")
    b64 = png_base64()
    table = [
        {"input": "<image> and <image>", "images": ["img/red.png", b64], "label": "a"},
        {"input": "no image", "images": None, "label": "b"},
    ]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(table), path)
    samples = load_prompts(str(path), fmt())
    assert [s.multimodal_inputs for s in samples] == [{"image": [str(red), b64]}, None]

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"input": "<image>", "images": [b64, b64], "label": "a"}]), bad)
    with pytest.raises(DataError, match=rf"^{re.escape(str(bad))}:row 0: the prompt has 1 image"):
        load_prompts(str(bad), fmt())


def test_count_mismatch_is_one_line_naming_file_and_line(tmp_path: Path) -> None:
    write_png(tmp_path / "a.png")
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"input": "<image>", "images": ["a.png"]}, "", {"input": "<image> <image>", "images": ["a.png"]}],
    )
    with pytest.raises(DataError) as error:
        load_prompts(path, PromptFormat(multimodal_keys=KEYS))
    assert error.value.line() == (
        f"error: {path}:3: the prompt has 2 image placeholder(s) but the record 'images' holds 1 image(s); "
        "write one <image> (or {'type': 'image'} message part) per item of 'images', in order "
        "(--multimodal-keys)"
    )
    path = write_jsonl(tmp_path / "e.jsonl", [{"input": "<image>"}])
    with pytest.raises(DataError, match=r":1: the prompt has 1 image .* has no 'images' field, so 0 image"):
        load_prompts(path, PromptFormat(multimodal_keys=KEYS))


def test_missing_path_names_it(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "<image>", "images": ["img/nope.png"]}])
    missing = tmp_path / "img" / "nope.png"
    with pytest.raises(DataError) as error:
        load_prompts(path, PromptFormat(multimodal_keys=KEYS))
    assert str(error.value).startswith(f"images[0] in {path}:1: image file {missing} does not exist; ")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("item", "text"),
    [
        ({"image": "a.png", "max_pixel": 4}, "an image dict is"),
        ({"image": "a.png", "max_pixels": 0}, "max_pixels must be a positive integer"),
        ({"image": "a.png", "min_pixels": 9, "max_pixels": 4}, "min_pixels 9 is greater than max_pixels 4"),
        (3, "an image is a path or a base64 string"),
        ("data:image/png;base64,not base64!", "is not a data:image/<format>;base64,<data> URL"),
        ("data:text/plain;base64,AAAA", "is not a data:image/<format>;base64,<data> URL"),
    ],
)
def test_ill_formed_items_are_bad_records(tmp_path: Path, item: object, text: str) -> None:
    write_png(tmp_path / "a.png")
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "<image>", "images": [item]}])
    with pytest.raises(DataError, match=rf"^images\[0\] in {re.escape(path)}:1: .*{re.escape(text)}"):
        load_prompts(path, PromptFormat(multimodal_keys=KEYS))


def data_args(path: str, *extra: str):
    return build_parser().parse_args(
        ["--prompt-data", path, "--label-key", "label", "--multimodal-keys", '{"image": "images"}', *extra]
    )


def served(args, count: int = 4) -> list[Sample]:
    data = PromptDataSource.from_settings(DataSettings.from_args(args), args)
    try:
        return [group[0] for group in data.get_samples(count)]
    finally:
        data.close()


def bad_rows(tmp_path: Path) -> list[dict]:
    good = rows(tmp_path)
    return [good[0], {"input": "<image> <image>", "images": ["img/red.png"], "label": "bad"}, *good[1:4]]


@pytest.mark.parametrize("streaming", [False, True])
def test_on_bad_prompt_stop_and_skip_apply_to_image_records(tmp_path: Path, streaming: bool) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", bad_rows(tmp_path))
    extra = ["--streaming-data"] if streaming else []
    with pytest.raises(DataError, match=rf"^{re.escape(path)}:2: the prompt has 2 image placeholder"):
        served(data_args(path, *extra))
    args = data_args(path, *extra, "--on-bad-prompt", "skip")
    data = PromptDataSource.from_settings(DataSettings.from_args(args), args)
    try:
        samples = [group[0] for group in data.get_samples(4)]
        assert data.skipped == 1
    finally:
        data.close()
    assert [s.label for s in samples] == ["red", "x", "y", "z"]
    assert samples[0].multimodal_inputs == {"image": [str(tmp_path / "img" / "red.png")]}


def test_streaming_serves_the_same_samples_as_in_memory(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = rows(tmp_path)
    jsonl = write_jsonl(tmp_path / "d.jsonl", good[:4])
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(good[:2]), parquet)
    for path in (jsonl, str(parquet)):
        count = 4 if path == jsonl else 2
        in_memory = served(data_args(path), count)
        streamed = served(data_args(path, "--streaming-data"), count)
        assert [s.to_dict() for s in streamed] == [s.to_dict() for s in in_memory]
        assert in_memory[0].multimodal_inputs == {"image": [str(tmp_path / "img" / "red.png")]}


def test_data_workers_read_images_like_the_driver(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", rows(tmp_path)[:4])
    in_process = served(data_args(path, "--streaming-data"))
    in_workers = served(data_args(path, "--streaming-data", "--num-data-workers", "1"))
    assert [s.to_dict() for s in in_workers] == [s.to_dict() for s in in_process]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("{image: images}", "is not valid JSON"),
        ('["images"]', "must be a non-empty JSON object mapping a modality to a column"),
        ("{}", "must be a non-empty JSON object"),
        ('{"video": "videos"}', "unknown modality 'video'; supported: image"),
        ('{"image": 3}', "the column of 'image' must be a non-empty string"),
    ],
)
def test_bad_multimodal_keys_are_one_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, text: str
) -> None:
    hf = make_hf(tmp_path)
    assert text in expect_error(capsys, base(hf, "--multimodal-keys", value), "--multimodal-keys")
    with pytest.raises(ConfigError, match=re.escape(text)):
        parse_multimodal_keys(value)


def test_a_text_checkpoint_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = make_hf(tmp_path)
    line = expect_error(capsys, base(hf, "--multimodal-keys", '{"image": "images"}'), "--multimodal-keys")
    assert f"needs a vision-language --hf-checkpoint; {hf}/config.json has no vision_config" in line
    check_implemented(parse_args(base(hf)))
