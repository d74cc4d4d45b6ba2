"""The torch engine serves PEFT LoRA adapters as SGLang does over HTTP (``--enable-lora``): loaded from a
directory or from tensors, named per request by ``lora_path``, each row of a batch with its own adapter,
SGLang's replies and errors; the numbers equal peft's own ``PeftModel`` forward.

One engine runs in this process behind its real aiohttp app (see test_torch_engine_vlm.py's ``Served``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from slime.backends.torch_engine.engine import TorchEngine
from slime.backends.torch_engine.protocol import ProtocolError
from slime.backends.torch_engine.server_args import parse_server_args
from slime.weight_sync import ipc
from tests.support.served_engine import ServedEngine
from tools.make_tiny_model import make_tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 42, 7, 77, 3, 64, 12]
OTHER = [8, 1, 33, 2, 90]


class Served(ServedEngine):
    """An engine with LoRA on and its app on a loop thread."""

    def logprobs(
        self, ids: list[Any], lora_path: Any = None, new_tokens: int = 3, prompt: bool = True
    ) -> list[dict[str, Any]]:
        """Greedy replies with output log-probs, and the prompt's with ``prompt`` (such a request is
        prefilled on its own; without, the prompts of one call share one prefill forward)."""
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": 0 if prompt else -1,
        }
        if lora_path is not None:
            body["lora_path"] = lora_path
        response = self.post("/generate", body)
        assert response.status_code == 200, response.text
        reply = response.json()
        return reply if isinstance(reply, list) else [reply]


def make_adapter(
    model_dir: Path, out: Path, seed: int
) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """A PEFT adapter on every linear layer with random A and B, saved to ``out``: (PeftModel, the saved
    tensors by PEFT name, adapter_config.json)."""
    import json

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    with torch.no_grad():  # B large enough that the adapter moves the numbers well beyond 1e-5
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(str(out))
    return (
        model,
        load_file(str(out / "adapter_model.safetensors")),
        json.loads((out / "adapter_config.json").read_text()),
    )


@torch.no_grad()
def reference(model: Any, ids: list[int]) -> torch.Tensor:
    """Log-prob of each next token of ``ids`` under ``model`` (a PeftModel or the base)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def served_logprobs(reply: dict[str, Any], prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """The whole sequence, and the served log-probs of its last tokens (prompt ones where asked)."""
    meta = reply["meta_info"]
    inputs = [v for v, _, _ in (meta.get("input_token_logprobs") or [])[1:]]
    return prompt + reply["output_ids"], torch.tensor(
        inputs + [v for v, _, _ in meta["output_token_logprobs"]]
    )


def assert_matches(reply: dict[str, Any], prompt: list[int], model: Any) -> None:
    ids, got = served_logprobs(reply, prompt)
    torch.testing.assert_close(got, reference(model, ids)[-len(got) :], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2")


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("adapters")
    first = make_adapter(model_dir, root / "first", seed=1)
    second = make_adapter(model_dir, root / "second", seed=2)
    return {"first": (root / "first", *first), "second": (root / "second", *second)}


@pytest.fixture(scope="module")
def base(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Served]:
    argv = ["--model-path", str(model_dir), "--enable-lora", "--max-lora-rank", "8"]
    server = Served([*argv, "--lora-target-modules", *TARGETS])
    yield server
    server.close()


def tensors_body(name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, Any]:
    """/load_lora_adapter_from_tensors as SGLang's Engine sends it: one serialized dict per TP rank."""
    return {"lora_name": name, "config_dict": config, "serialized_named_tensors": [ipc.serialize(tensors)]}


def test_adapters_from_disk_and_tensors_equal_peft(
    served: Served, adapters: dict[str, Any], base: Any
) -> None:
    directory, peft_first, _, _ = adapters["first"]
    _, peft_second, second_tensors, second_config = adapters["second"]
    reply = served.post("/load_lora_adapter", {"lora_name": "disk", "lora_path": str(directory)})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {
        "rid": None,
        "http_worker_ipc": None,
        "success": True,
        "error_message": "",
        "loaded_adapters": {"disk": str(directory)},
    }
    reply = served.post("/load_lora_adapter_from_tensors", tensors_body("mem", second_tensors, second_config))
    assert reply.status_code == 200, reply.text
    assert reply.json()["loaded_adapters"] == {"disk": str(directory), "mem": "__tensor__"}
    assert_matches(served.logprobs(PROMPT, "disk")[0], PROMPT, peft_first)
    assert_matches(served.logprobs(PROMPT, "mem")[0], PROMPT, peft_second)
    assert_matches(served.logprobs(PROMPT)[0], PROMPT, base)
    # The adapter really moves the numbers.
    assert not torch.allclose(reference(peft_first, PROMPT), reference(base, PROMPT), atol=1e-3)
    # The served adapter reads back as the trainer's tensor (torch-engine-only endpoint).
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    values = served.post(
        "/get_lora_weights_by_name", {"lora_name": "mem", "name": name, "truncate_size": 1000}
    )
    torch.testing.assert_close(torch.tensor(values.json()), second_tensors[name], atol=0, rtol=0)
    models = requests.get(f"{served.url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in models[1:]] == [
        ("disk", str(directory), models[0]["id"]),
        ("mem", "__tensor__", models[0]["id"]),
    ]


def test_a_batch_mixing_base_and_adapters_gives_each_row_its_own_numbers(
    served: Served, adapters: dict[str, Any], base: Any
) -> None:
    """The same prompt under three adapters in one batch: no KV is shared across them, and decode
    applies each row's adapter (the outputs' log-probs match too)."""
    peft_first, peft_second = adapters["first"][1], adapters["second"][1]
    prompts = [PROMPT, PROMPT, PROMPT, OTHER, PROMPT]
    stats = served.engine.scheduler.stats
    batches, copies = stats.prefill_batches, stats.prefill_copied_requests
    replies = served.logprobs(prompts, [None, "disk", "mem", "disk", "disk"], new_tokens=4, prompt=False)
    models = [base, peft_first, peft_second, peft_first, peft_first]
    for reply, ids, model in zip(replies, prompts, models, strict=True):
        assert_matches(reply, ids, model)
    # One prefill forward; only the repeat of (PROMPT, "disk") is a copy of another row's keys/values.
    assert (stats.prefill_batches - batches, stats.prefill_copied_requests - copies) == (1, 1)
    assert replies[1]["output_ids"] == replies[4]["output_ids"] != replies[0]["output_ids"]
    for reply, ids in zip(
        served.logprobs([PROMPT, OTHER], "mem", prompt=False), [PROMPT, OTHER], strict=True
    ):
        assert_matches(reply, ids, peft_second)  # one name for the whole batch


def test_sglang_errors(served: Served, adapters: dict[str, Any]) -> None:
    directory = adapters["first"][0]
    loaded = {"disk": str(directory), "mem": "__tensor__"}
    again = served.post("/load_lora_adapter", {"lora_name": "disk", "lora_path": str(directory)})
    assert again.status_code == 400
    assert again.json()["error_message"] == "Failed to load LoRA adapter disk because it is already loaded"
    assert again.json()["loaded_adapters"] == loaded
    unknown = served.post("/unload_lora_adapter", {"lora_name": "nope"})
    assert unknown.status_code == 400
    assert unknown.json() == {
        "rid": None,
        "http_worker_ipc": None,
        "success": False,
        "error_message": "LoRA with name nope does not exist. Loaded LoRAs: odict_keys(['disk', 'mem'])",
        "loaded_adapters": None,
    }
    never = served.post("/generate", {"input_ids": PROMPT, "lora_path": "nope"})
    assert never.status_code == 400
    assert never.json()["error"]["message"] == (
        "Got LoRA adapter that has never been loaded: nope\nAll loaded adapters: dict_keys(['disk', 'mem'])."
    )
    too_big = dict(adapters["first"][3], r=16)
    reply = served.post("/load_lora_adapter_from_tensors", tensors_body("big", {}, too_big))
    assert reply.status_code == 400 and "with rank 16 is incompatible" in reply.json()["error_message"]


def test_unload_then_generate_and_reload_new_tensors(served: Served, adapters: dict[str, Any]) -> None:
    """What a weight push does: unload the name, load new tensors under it, generate with it."""
    peft_first, config = adapters["first"][1], adapters["first"][3]
    peft_second, second_tensors = adapters["second"][1], adapters["second"][2]
    gone = served.post("/unload_lora_adapter", {"lora_name": "mem"})
    assert gone.status_code == 200 and gone.json()["loaded_adapters"] == {"disk": str(adapters["first"][0])}
    # SGLang reloads a name it had loaded from where it came: tensors cannot be, so the request fails.
    reply = served.post("/generate", {"input_ids": PROMPT, "lora_path": "mem"})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith("Failed to implicitly load LoRA adapter mem: ")
    before = served.logprobs(PROMPT, "disk")[0]
    assert_matches(before, PROMPT, peft_first)
    assert served.post("/unload_lora_adapter", {"lora_name": "disk"}).status_code == 200
    assert_matches(served.logprobs(PROMPT, "disk")[0], PROMPT, peft_first)  # reloaded from its directory
    assert served.post("/unload_lora_adapter", {"lora_name": "disk"}).status_code == 200
    new = served.post("/load_lora_adapter_from_tensors", tensors_body("disk", second_tensors, config))
    assert new.status_code == 200, new.text
    after = served.logprobs(PROMPT, "disk")[0]
    assert_matches(after, PROMPT, peft_second)
    assert not torch.allclose(
        served_logprobs(after, PROMPT)[1], served_logprobs(before, PROMPT)[1], atol=1e-3
    )


def test_max_loras_per_batch_counts_the_base_model(
    model_dir: Path, adapters: dict[str, Any], base: Any
) -> None:
    """With one adapter per batch, a base row and an adapter row are prefilled apart (SGLang's
    ``validate_lora_batch``) and still get their own numbers; ``--lora-paths`` loads at start."""
    directory, peft_first = adapters["first"][0], adapters["first"][1]
    argv = ["--model-path", str(model_dir), "--lora-paths", f"a={directory}", "--max-loras-per-batch", "1"]
    server = Served(argv)
    try:
        assert server.engine.lora is not None and list(server.engine.lora.registry) == ["a"]
        replies = server.logprobs([PROMPT, OTHER], [None, "a"], new_tokens=2, prompt=False)
        assert_matches(replies[0], PROMPT, base)
        assert_matches(replies[1], OTHER, peft_first)
        assert server.engine.scheduler.stats.prefill_batches == 2
    finally:
        server.close()


def test_without_enable_lora_sglang_refuses(model_dir: Path) -> None:
    engine = TorchEngine(parse_server_args(["--model-path", str(model_dir)]))
    assert engine.lora is None and engine.runner.lora is None
    assert engine.load_lora_adapter("a", "/x", False) == {
        "rid": None,
        "http_worker_ipc": None,
        "success": False,
        "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
        "loaded_adapters": None,
    }
    with pytest.raises(
        ProtocolError, match=re.escape("LoRA adapter 'a' was requested, but LoRA is not enabled.")
    ):
        engine.acquire_adapters([None, "a"], True)
    assert engine.acquire_adapters([None], False) == [None]


FUSED = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
)


def stacked_forms(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The adapter with one A per fused layer (q's, gate's) as per-module PEFT tensors, and the same
    adapter under SGLang's stacked names (A once, B with the modules' rows in order)."""
    shared, stacked = dict(tensors), {}
    for layer in (0, 1):
        for block, fused, parts in FUSED:
            prefix = f"base_model.model.model.layers.{layer}.{block}."
            a = tensors[f"{prefix}{parts[0]}.lora_A.weight"]
            for part in parts:
                shared[f"{prefix}{part}.lora_A.weight"] = a
            stacked[f"{prefix}{fused}.lora_A.weight"] = a
            stacked[f"{prefix}{fused}.lora_B.weight"] = torch.cat(
                [tensors[f"{prefix}{part}.lora_B.weight"] for part in parts]
            )
    fused_parts = [part for _, _, parts in FUSED for part in parts]
    stacked.update({n: t for n, t in tensors.items() if not any(f".{part}." in n for part in fused_parts)})
    return shared, stacked


def test_stacked_qkv_and_gate_up_tensors_equal_per_module_ones(
    served: Served, adapters: dict[str, Any]
) -> None:
    """SGLang's stacked names (one A shared by q/k/v or gate/up, B with their rows): Megatron's fused
    layers exported as is give the same numbers as the per-module PEFT tensors with that A."""
    tensors, stacked = stacked_forms(adapters["second"][2])
    config = adapters["second"][3]
    for name, payload in (("per_module", tensors), ("stacked", stacked)):
        reply = served.post("/load_lora_adapter_from_tensors", tensors_body(name, payload, config))
        assert reply.status_code == 200, reply.text
    per_module, fused_reply = (served.logprobs(OTHER, name)[0] for name in ("per_module", "stacked"))
    assert per_module["output_ids"] == fused_reply["output_ids"]
    torch.testing.assert_close(
        served_logprobs(fused_reply, OTHER)[1], served_logprobs(per_module, OTHER)[1], atol=1e-6, rtol=0
    )
    # SGLang's expected_checksums check of a tensor push: a wrong sum is refused before loading.
    body = tensors_body("checked", tensors, config) | {"expected_checksums": dict.fromkeys(tensors, "0" * 64)}
    refused = served.post("/load_lora_adapter_from_tensors", body)
    assert refused.status_code == 400
    assert refused.json()["error_message"].startswith(
        f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(tensors)}"
    )
