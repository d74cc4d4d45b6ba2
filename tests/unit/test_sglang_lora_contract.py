"""Contract tests: how SGLang 0.5.19 and 0.5.23 serve LoRA adapters over HTTP, read from their unpacked
wheels (``.venv/sglang-wheels/<release>/sglang/srt``), which the torch engine's ``lora.py`` and the
weight sync rely on. Each test names the file it reads; an upstream change fails here.

Facts pinned (both releases unless said):
- flags (``server_args.py`` in 0.5.19, ``arg_groups/fields/lora.py`` in 0.5.23): ``enable_lora`` None,
  ``max_lora_rank`` None, ``lora_target_modules`` None (nargs ``*``), ``lora_paths`` None,
  ``max_loaded_loras`` None, ``max_loras_per_batch`` 8 ("include base-only request"), ``lora_backend``
  "csgmv"; ``arg_groups/lora_hook.py``: without ``--lora-paths`` both rank and targets are required.
- endpoints (``entrypoints/http_server.py``): POST /load_lora_adapter, /load_lora_adapter_from_tensors,
  /unload_lora_adapter answer ``LoRAUpdateOutput`` (with BaseReq's ``rid``, ``http_worker_ipc``), 200 on
  success, 400 on failure; the request structs' fields (``managers/io_struct.py``).
- the tensors of /load_lora_adapter_from_tensors are one MultiprocessingSerializer entry per TP rank of a
  dict ``{name: tensor}`` (``managers/tp_worker.py``: ``tensors = data``), or a flattened bucket.
- messages: ``lora/lora_registry.py``, ``lora/lora_manager.py``, ``managers/tokenizer_control_mixin.py``,
  ``managers/tokenizer_manager.py``; ``scaling = lora_alpha / r`` (``lora/lora.py``).
- no distributed (NCCL) path for adapter weights: no LoRA request struct but the three loads/unloads,
  and nothing in ``srt/lora`` or the weight updater that broadcasts adapter weights.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest

from slime.backends.torch_engine import lora
from slime.config.sglang_args import FallbackServerArgs
from tests.unit.test_sglang_wheels import RELEASES, function_source, source, struct_fields


def _flat(text: str) -> str:
    """``text`` with whitespace runs as one space and implicit string concatenation undone."""
    return re.sub(r'"\s+f?"', "", re.sub(r"\s+", " ", text))


FLAGS = {
    "enable_lora": "None",
    "max_lora_rank": "None",
    "lora_target_modules": "None",
    "lora_paths": "None",
    "max_loaded_loras": "None",
    "max_loras_per_batch": "8",
    "lora_backend": '"csgmv"',
}


def _flag_file(release: str) -> Path:
    root = source(release)
    split = root / "arg_groups" / "fields" / "lora.py"
    return split if split.is_file() else root / "server_args.py"


@pytest.mark.parametrize("release", RELEASES)
def test_lora_flags_and_defaults(release: str) -> None:
    """The flags the torch engine honours, with SGLang's defaults, are the ones in its table."""
    text = _flag_file(release).read_text()
    for name, default in FLAGS.items():
        match = re.search(rf"^    {name}: A\[.*?\] = (\S+)$", text, re.MULTILINE | re.DOTALL)
        assert match is not None, name
        assert match.group(1) == default, name
        assert repr(getattr(FallbackServerArgs(), name)).replace("'", '"') == default
    assert "include base-only request" in text
    assert re.search(r'lora_target_modules: A\[.*?nargs="\*"', text, re.DOTALL)
    hook = _flat((source(release) / "arg_groups" / "lora_hook.py").read_text())
    for message in (
        "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
        "--lora-target-modules for LoRA initialization.",
        "max_loaded_loras should be greater than or equal to max_loras_per_batch. ",
        "If 'all' is specified in --lora-target-modules, it should be the only module specified.",
        "max_loras_per_batch must be positive",
    ):
        assert message in hook, message


# What the weight sync sends, by struct; the fields SGLang has must include them.
REQUESTS = {
    "LoadLoRAAdapterReqInput": {"lora_name", "lora_path", "pinned", "lora_id"},
    "UnloadLoRAAdapterReqInput": {"lora_name", "lora_id"},
    "LoadLoRAAdapterFromTensorsReqInput": {
        "lora_name", "config_dict", "serialized_named_tensors", "pinned", "added_tokens_config",
        "lora_id", "load_format", "expected_checksums",
    },
    "LoRAUpdateOutput": {"success", "error_message", "loaded_adapters"},
}  # fmt: skip


@pytest.mark.parametrize("release", RELEASES)
def test_lora_request_and_reply_structs(release: str) -> None:
    fields = struct_fields(source(release) / "managers" / "io_struct.py")
    for name, wanted in REQUESTS.items():
        assert fields[name] == wanted | {"rid", "http_worker_ipc"}, name
    # The reply is LoRAUpdateOutput as msgspec_to_builtins writes it: BaseReq's fields first.
    reply = ["rid", "http_worker_ipc", "success", "error_message", "loaded_adapters"]
    assert list(lora.update_output(True, "", {})) == reply
    io = (source(release) / "managers" / "io_struct.py").read_text()
    assert "serialized_named_tensors: Annotated[List[bytes], Base64Bytes()]" in io
    assert 'lora_path="__tensor__"' in io and lora.TENSOR_PATH == "__tensor__"
    # No other LoRA request: no distributed (NCCL) update of adapter weights.
    lora_structs = sorted(n for n in fields if re.search(r"lora", n, re.IGNORECASE))
    assert lora_structs == sorted(REQUESTS)


@pytest.mark.parametrize("release", RELEASES)
def test_lora_endpoints_answer_200_or_400(release: str) -> None:
    text = (source(release) / "entrypoints" / "http_server.py").read_text()
    for path, handler in (
        ("/load_lora_adapter", "load_lora_adapter"),
        ("/load_lora_adapter_from_tensors", "load_lora_adapter_from_tensors"),
        ("/unload_lora_adapter", "unload_lora_adapter"),
    ):
        assert f'@app.api_route("{path}", methods=["POST"])' in text
        body = function_source(source(release) / "entrypoints" / "http_server.py", handler)
        assert "status_code = HTTPStatus.OK if result.success else HTTPStatus.BAD_REQUEST" in body
        assert "ORJSONResponse(msgspec_to_builtins(result), status_code=status_code)" in body
    assert '{"error": {"message": str(e)}}' in function_source(
        source(release) / "entrypoints" / "http_server.py", "_create_error_response"
    )


@pytest.mark.parametrize("release", RELEASES)
def test_adapter_tensors_are_a_dict_or_a_flattened_bucket(release: str) -> None:
    body = function_source(source(release) / "managers" / "tp_worker.py", "load_lora_adapter_from_tensors")
    assert 'if recv_req.load_format == "flattened_bucket":' in body
    assert "tensors = dict(bucket.reconstruct_tensors())" in body
    assert "tensors = data" in body
    assert "[LORA-CHECK] rank" in body and "adapter sync MISMATCH of" in body


@pytest.mark.parametrize("release", RELEASES)
def test_messages_the_engine_answers_with(release: str) -> None:
    root = source(release)
    registry = _flat((root / "lora" / "lora_registry.py").read_text())
    assert "self._registry: OrderedDict[str, LoRARef] = OrderedDict()" in registry
    assert 'f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {self._registry.keys()}"' in registry
    assert "self._registry.move_to_end(name)" in registry
    manager = _flat((root / "lora" / "lora_manager.py").read_text())
    assert 'f"Failed to load LoRA adapter {lora_ref.lora_name} because it is already loaded"' in manager
    assert "is incompatible with the current LoRA memory pool configuration." in manager
    assert "lora_ref.lora_name: lora_ref.lora_path for lora_ref in self.lora_refs.values()" in manager
    assert "if len(lora_ids) > self.max_loras_per_batch: return False" in manager
    control = _flat((root / "managers" / "tokenizer_control_mixin.py").read_text())
    assert f'"{lora.NOT_ENABLED}"' in control
    tokenizer = _flat((root / "managers" / "tokenizer_manager.py").read_text())
    for message in (
        r'f"Got LoRA adapter that has never been loaded: {lora_path}\nAll loaded adapters: '
        r'{self.lora_ref_cache.keys()}."',
        'f"Failed to implicitly load LoRA adapter {lora_path}: {load_result.error_message}"',
        "f\"LoRA adapter '{first_adapter}' was requested, but LoRA is not enabled. Please launch the server "
        'with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."',
        "self.lora_ref_cache: Dict[str, LoRARef] = {}",
        'and "already loaded" not in load_result.error_message',
    ):
        assert message in tokenizer, message
    assert (
        "self.scaling: float = self.config.lora_alpha / self.config.r"
        in (root / "lora" / "lora.py").read_text()
    )


@pytest.mark.parametrize("release", RELEASES)
def test_target_names_are_normalized_as_sglang_does(release: str) -> None:
    """``lora/utils.py`` ``get_normalized_target_modules``, run against the engine's on the same names."""
    path = source(release) / "lora" / "utils.py"
    namespace: dict[str, Any] = {"Union": typing.Union, "Iterable": typing.Iterable}
    exec(
        function_source(path, "get_normalized_target_modules"), namespace
    )  # SGLang's own code, from the wheel
    theirs = namespace["get_normalized_target_modules"]
    cases: list[Any] = [["q_proj"], ["k_proj", "v_proj", "o_proj"], list(lora.LINEAR_TARGETS), "all-linear"]
    cases += [["gate_proj", "up_proj", "down_proj"], ["self_attn.q_proj"], ["q_a_proj", "kv_b_proj"]]
    for targets in cases:
        assert lora.normalized_targets(targets) == theirs(targets), targets


@pytest.mark.parametrize("release", RELEASES)
def test_stacked_tensor_names_share_a(release: str) -> None:
    """``lora/lora.py``: a stacked ``qkv_proj`` / ``gate_up_proj`` A is repeated per module (one A shared),
    B already holds the modules' rows in q, k, v (gate, up) order: what ``LoraManager._place`` splits."""
    text = _flat((source(release) / "lora" / "lora.py").read_text())
    assert "weights[qkv_name] = weights[qkv_name].repeat(3, 1)" in text
    assert "torch.cat( ( weights[q_name], k_proj_weight, weights[v_name], ), 0, )" in text
    assert "repeat_dims[ndim - 2] = 2" in text
    assert lora.STACKED == {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }


@pytest.mark.parametrize("release", RELEASES)
def test_no_distributed_lora_update(release: str) -> None:
    root = source(release)
    for path in (root / "lora").rglob("*.py"):
        text = path.read_text()
        assert "init_weights_update_group" not in text and "update_weights_from_distributed" not in text, path
    updater = root / "managers" / "scheduler_components" / "weight_updater.py"
    if updater.is_file():
        assert "lora" not in updater.read_text().lower()
