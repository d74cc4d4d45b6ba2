"""Contract tests: what the torch engine does with images is what SGLang 0.5.19 and 0.5.23 do, read from
their unpacked wheels (``.venv/sglang-wheels/<release>/sglang/srt``, see test_sglang_wheels.py).

Where SGLang's code is self-contained (``_expand_input_ids``, ``_normalize_image_data``) it is taken
out with ``ast`` and run against the engine's version on the same inputs; elsewhere the messages and
conditions the engine copies are looked up in the named file, so an upstream change fails here.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest

from slime.backends.torch_engine import protocol, vision
from tests.unit.test_sglang_wheels import RELEASES, function_source, source


def _has(text: str, *lines: str) -> bool:
    """Whether ``lines`` follow each other in ``text``, whatever the whitespace between them."""
    return re.search(r"\s*".join(re.escape(line) for line in lines), text) is not None


def _load(path: Path, name: str) -> Any:
    namespace: dict[str, Any] = {"List": typing.List, "Optional": typing.Optional}  # noqa: UP006
    exec(function_source(path, name), namespace)  # SGLang's own code, from the wheel this test pins
    return namespace[name]


@pytest.mark.parametrize("release", RELEASES)
def test_expand_input_ids_is_sglangs(release: str) -> None:
    """base_processor.py ``_expand_input_ids``: same ids, same error text on a count mismatch."""
    theirs = _load(source(release) / "multimodal/processors/base_processor.py", "_expand_input_ids")
    cases = [([1, 9, 2, 9, 3], [2, 3]), ([9], [4]), ([1, 2], []), ([9, 9], [1]), ([1, 9], [1, 2])]
    for ids, counts in cases:
        try:
            want: Any = theirs(ids, counts, 9)
        except ValueError as exc:
            want = str(exc)
        try:
            got: Any = vision.expand_input_ids(ids, counts, 9)
        except ValueError as exc:
            got = str(exc)
        assert got == want, (ids, counts)


@pytest.mark.parametrize("release", RELEASES)
def test_a_mismatch_falls_back_to_retokenizing(release: str) -> None:
    """The count mismatch is caught, logged, and the processor's retokenized ids are kept; SGLang does
    it by default (``SGLANG_MM_AVOID_RETOKENIZE`` defaults to True)."""
    root = source(release)
    text = (root / "multimodal/processors/base_processor.py").read_text()
    assert (
        'f"Due to {e}, falling back to decode+retokenize, which may change prompt length (token drift)."'
    ) in text
    assert "SGLANG_MM_AVOID_RETOKENIZE = EnvBool(True)" in (root / "environ.py").read_text()


class _Batch:
    """The attributes ``GenerateReqInput._normalize_image_data`` reads and writes."""

    def __init__(self, image_data: Any, batch_size: int) -> None:
        self.image_data = image_data
        self.batch_size = batch_size
        self.parallel_sample_num = 1
        self.modalities: Any = None


@pytest.mark.parametrize("release", RELEASES)
def test_batch_image_data_is_assigned_as_sglang_assigns_it(release: str) -> None:
    normalize = _load(source(release) / "managers/io_struct.py", "_normalize_image_data")
    a, b = "data:image/png;base64,AAAA", "/tmp/b.png"
    cases = [None, [], a, [a, b], [[a], [a, b]], [[a], []], [[a], None], [a, b, a]]
    for image_data in cases:
        batch = _Batch(image_data, 2)
        try:
            normalize(batch, 2)
            want: Any = [items if items and items != [None] else None for items in batch.image_data]
        except ValueError as exc:
            want = str(exc)
        try:
            got: Any = protocol._normalize_image_data(image_data, 2, batched=True)
        except protocol.ProtocolError as exc:
            got = str(exc)
        assert got == want, image_data


@pytest.mark.parametrize("release", RELEASES)
def test_image_loading_messages(release: str) -> None:
    """How an item is read and what a client is told when it cannot be (``utils/common.py``,
    ``multimodal/processors/base_processor.py``, ``entrypoints/http_server.py``)."""
    root = source(release)
    common = (root / "utils/common.py").read_text()
    get_bytes = function_source(root / "utils/common.py", "get_image_bytes")
    assert 'image_file.startswith(("file://", "/"))' in get_bytes
    assert 'image_file.split(",", 1)' in get_bytes
    assert get_bytes.count("pybase64.b64decode(") == 2 and "validate=True" in get_bytes
    assert 'raise ValueError(f"Could not decode image: {e}") from e' in common
    base = (root / "multimodal/processors/base_processor.py").read_text()
    single = function_source(root / "multimodal/processors/base_processor.py", "_load_single_item")
    assert 'data_str = data_str[:100] + "..."' in single
    assert 'raise ValueError(f"Error while loading data {data_str}: {e}") from e' in single
    assert 'raise RuntimeError(f"Error while loading data {data_str}: {e}") from e' in single
    assert 'f"An exception occurred while loading {modality.name} data "\n' in base
    assert 'f"at index {idx}: {e}"' in base
    assert 'f"An exception occurred while loading multimodal data: {e}"' in base
    server = (root / "entrypoints/http_server.py").read_text()
    assert _has(
        server,
        '{"error": {"message": str(e)}},',
        'status_code=getattr(e, "status_code", HTTPStatus.BAD_REQUEST)',
    )
    serve = function_source(
        root / "entrypoints/http_server.py",
        "serve_generate_request" if release != "0.5.19" else "generate_request",
    )
    assert "except ValueError as e:" in serve and "_create_error_response(e)" in serve
    assert vision._short("x" * 101) == "x" * 100 + "..." and vision._short("x" * 100) == "x" * 100


@pytest.mark.parametrize("release", RELEASES)
def test_placeholder_count_rules(release: str) -> None:
    """Which prompt spans are image placeholders, and what more or fewer images than placeholders do."""
    root = source(release)
    qwen = (root / "multimodal/processors/qwen_vl.py").read_text()
    newer = protocol.release(release).multimodal_0_5_23
    regex = vision.PLACEHOLDER_PATTERN + ("|<image>" if newer else "")
    assert f'r"{regex}"' in qwen
    legacy = function_source(root / "multimodal/processors/base_processor.py", "legacy_load_mm_data")
    if newer:
        assert "raise _placeholder_mismatch_error(" in legacy
        error = function_source(
            root / "multimodal/processors/base_processor.py", "_placeholder_mismatch_error"
        )
        assert 'f"Prompt has {num_placeholders} {name} placeholders "' in error
        assert 'f"but {num_items} {name} inputs were provided"' in error
    else:
        assert "except StopIteration as e:" in legacy
        assert _has(
            legacy, "raise RuntimeError(", 'f"An exception occurred while loading multimodal data: {e}"'
        )
    # Extra images are dropped: the loader stops at the last placeholder.
    submit = function_source(root / "multimodal/processors/base_processor.py", "submit_data_loading_tasks")
    assert "More '{modality.name}' tokens found than corresponding data provided." in submit
    # Qwen2.5-VL takes the uncached path: no preprocess cache by default, artifacts for Qwen3-VL only,
    # and images reach the HF processor unresized (smart_resize is for videos).
    assert (
        "    auto_mm_preprocess_cache_size_mb = 0\n"
        in (root / "multimodal/processors/base_processor.py").read_text()
    )
    if "uses_media_artifacts_without_cache = self.model_type in (" in qwen:
        start = qwen.index("uses_media_artifacts_without_cache = self.model_type in (")
        assert '"qwen2_5_vl"' not in qwen[start : qwen.index(")", start)]
    assert "smart_resize(" not in function_source(
        root / "multimodal/processors/qwen_vl.py",
        "_process_mm_data_uncached" if newer else "process_mm_data_async",
    )


@pytest.mark.parametrize("release", RELEASES)
def test_meta_info_image_tokens(release: str) -> None:
    """A request with images gets ``meta_info["image_tokens"]``, a text request does not."""
    text = (source(release) / "managers/tokenizer_manager.py").read_text()
    assert _has(
        text,
        "if image_tokens_list and image_tokens_list[i]:",
        'meta_info["image_tokens"] = image_tokens_list[i]',
    )
