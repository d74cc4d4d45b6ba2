"""The torch engine's routed experts (R3) against the HF model's own routing, over SGLang's protocol.

Every reply's ``meta_info["routed_experts"]`` is decoded as SGLang's (base64 int32, ``[len(tokens) - 1
- start, num_hidden_layers, num_experts_per_tok]``) and compared with the top-k a plain transformers
forward of the same tokens picks from its router logits, computed here by each family's rule
(Qwen's softmax top-k; DeepSeek-V3's group-limited top-k over sigmoid scores plus the correction
bias, a bias drawn large enough to change choices). Dense layers hold zeros.
"""

from __future__ import annotations

import base64
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.served_engine import ServedEngine

PROMPT = [3, 17, 42, 5, 99, 23, 8]
GREEDY = {"temperature": 0, "ignore_eos": True}


ARCHS = ("qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3")
# The score correction bias of the sigmoid routers, redrawn so that it decides some choices.
BIAS = torch.tensor([0.3, -0.2, 0.0, 0.25])


def _model(root: Path, arch: str) -> Path:
    """A tiny checkpoint of ``arch`` (GLM-4.5 and DeepSeek-V3: layer 0 dense, layer 1 MoE; DeepSeek-V3
    with 2 expert groups of which each token may use 1), the sigmoid routers' bias redrawn."""
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(root / arch, arch=arch)
    state = load_file(model / "model.safetensors")
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    if name in state:
        state[name] = BIAS
        save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    return model


def _served(model: Path, *flags: str) -> Iterator[ServedEngine]:
    served = ServedEngine(["--model-path", str(model), *flags])
    yield served
    served.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("r3")
    return {arch: _model(root, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def qwen3_moe(models) -> Path:
    return models["qwen3_moe"]


@pytest.fixture(scope="module")
def qwen_engine(qwen3_moe) -> Iterator[ServedEngine]:
    yield from _served(qwen3_moe, "--enable-return-routed-experts")


def _hf_routes(model_dir: Path, ids: list[int], bias: bool = True) -> np.ndarray:
    """``[len(ids), layers, topk]``: the experts a plain transformers forward routes each token to,
    each row sorted, zeros at dense layers; computed from its router logits by each family's rule
    (``bias=False``: the sigmoid routers' choice without their correction bias and groups)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    gates = [name for name, _ in model.named_modules() if name.endswith(".mlp.gate")]
    logits: list[torch.Tensor] = []  # each router's logits (its first output), in layer order
    for name in gates:
        model.get_submodule(name).register_forward_hook(lambda _m, _i, out: logits.append(out[0]))
    with torch.no_grad():
        model(torch.tensor([ids]))
    layers = [int(name.split(".")[2]) for name in gates]
    routes = np.zeros((len(ids), config.num_hidden_layers, config.num_experts_per_tok), dtype=np.int32)
    for layer, name, layer_logits in zip(layers, gates, logits, strict=True):
        scores = layer_logits.sigmoid() if config.model_type in ("glm4_moe", "deepseek_v3") else layer_logits
        if config.model_type in ("glm4_moe", "deepseek_v3") and bias:
            choice = _group_limited(scores + model.get_submodule(name).e_score_correction_bias, config)
        else:
            choice = scores.topk(config.num_experts_per_tok, dim=-1).indices
        routes[:, layer] = np.sort(choice.numpy(), axis=-1)
    return routes


def _group_limited(scores: torch.Tensor, config) -> torch.Tensor:
    """DeepSeek-V3's rule: the ``topk_group`` groups with the best sum of their 2 best scores, then
    the top-k experts within them."""
    groups = scores.view(len(scores), config.n_group, -1)
    best = groups.topk(2, dim=-1).values.sum(-1).topk(config.topk_group, dim=-1).indices
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep[torch.arange(len(scores))[:, None], best] = True
    masked = scores.masked_fill(~keep.view_as(scores), float("-inf"))
    return masked.topk(config.num_experts_per_tok, dim=-1).indices


def _routes(reply: dict, layers: int, topk: int) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(reply["meta_info"]["routed_experts"]), dtype=np.int32)
    return np.sort(flat.reshape(-1, layers, topk), axis=-1)


def _generate(served: ServedEngine, **body) -> dict:
    reply = served.post("/generate", body)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("arch", ARCHS)
def test_routes_are_the_hf_models_top_k_over_prompt_and_output(arch, models) -> None:
    model_dir = models[arch]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    for served in _served(model_dir, "--enable-return-routed-experts"):
        full = _generate(served, **body, return_routed_experts=True)
        ids = PROMPT + full["output_ids"]
        want = _hf_routes(model_dir, ids)
        got = _routes(full, *want.shape[1:])
        assert got.shape == (len(ids) - 1, *want.shape[1:])  # the last token is never forwarded
        np.testing.assert_array_equal(got, want[:-1])
        if arch in ("glm4_moe", "deepseek_v3"):
            assert not got[:, 0].any()  # layer 0 is dense: zeros, as SGLang leaves them
            assert (got != _hf_routes(model_dir, ids, bias=False)[:-1]).any()  # the bias decided some

        for start in (3, len(PROMPT)):
            tail = _generate(served, **body, return_routed_experts=True, routed_experts_start_len=start)
            assert tail["output_ids"] == full["output_ids"]
            np.testing.assert_array_equal(_routes(tail, *want.shape[1:]), want[start:-1])
        scored = _generate(
            served, input_ids=ids, sampling_params={"max_new_tokens": 0}, return_routed_experts=True
        )
        np.testing.assert_array_equal(_routes(scored, *want.shape[1:]), want[:-1])


def test_requests_sharing_a_prompt_all_carry_its_routes(qwen_engine, qwen3_moe) -> None:
    """A batch of one prompt is prefilled once and the KV copied to the others (cached_tokens): the
    copies carry the prompt's routes, then each its own output's."""
    replies = _generate(
        qwen_engine,
        input_ids=[PROMPT] * 3,
        sampling_params={"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True},
        return_routed_experts=True,
    )
    assert sorted(r["meta_info"]["cached_tokens"] for r in replies) == [0, len(PROMPT) - 1, len(PROMPT) - 1]
    for reply in replies:
        ids = PROMPT + reply["output_ids"]
        want = _hf_routes(qwen3_moe, ids)
        np.testing.assert_array_equal(_routes(reply, *want.shape[1:]), want[:-1])


def test_a_retracted_request_records_the_routes_it_recomputes(qwen_engine, qwen3_moe) -> None:
    """After a retraction the request is prefilled again with its output so far: those positions'
    rows are written again (overwritten here while it waits, so a stale row would show)."""
    scheduler = qwen_engine.engine.scheduler
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, **GREEDY}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(_generate, qwen_engine, **body, return_routed_experts=True)
        while scheduler.internal_state()["num_running_reqs"] == 0:
            time.sleep(0.001)
        qwen_engine.post("/pause_generation", {"mode": "retract"})

        def spoil() -> int:
            (waiting,) = scheduler.waiting
            assert waiting.routes is not None
            waiting.routes.fill_(-7)
            return len(waiting.output_ids)

        decoded = scheduler.call(spoil).result(10)
        qwen_engine.post("/continue_generation", {})
        reply = future.result(60)
    assert reply["meta_info"]["num_retractions"] == 1 and decoded > 0
    ids = PROMPT + reply["output_ids"]
    want = _hf_routes(qwen3_moe, ids)
    got = _routes(reply, *want.shape[1:])
    assert (got >= 0).all()
    np.testing.assert_array_equal(got, want[:-1])


def test_a_request_aborted_while_running_has_the_routes_of_what_it_computed(qwen_engine) -> None:
    scheduler = qwen_engine.engine.scheduler
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, **GREEDY}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(_generate, qwen_engine, **body, rid="r3-abort", return_routed_experts=True)
        while scheduler.internal_state()["num_running_reqs"] == 0:
            time.sleep(0.001)
        qwen_engine.post("/abort_request", {"rid": "r3-abort"})
        reply = future.result(60)
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert _routes(reply, 2, 2).shape[0] == len(PROMPT) + len(reply["output_ids"]) - 1


def test_start_len_errors_and_the_batch_form_are_sglangs(qwen_engine) -> None:
    base = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
    low = qwen_engine.post("/generate", {**base, "routed_experts_start_len": -1})
    assert low.status_code == 400
    assert low.json()["error"]["message"] == (
        "recv_req.routed_experts_start_len=-1 is lower than 0. "
        "Please use a non-negative routed_experts_start_len."
    )
    high = qwen_engine.post("/generate", {**base, "routed_experts_start_len": 8})
    assert high.status_code == 400
    assert high.json()["error"]["message"] == (
        "recv_req.routed_experts_start_len=8 is higher than the number of input tokens "
        "len(req.origin_input_ids)=7. Please use a smaller routed_experts_start_len."
    )
    # Without return_routed_experts the start is never looked at, as in SGLang.
    assert qwen_engine.post(
        "/generate", {**base, "return_routed_experts": False, "routed_experts_start_len": 99}
    ).ok
    listed = qwen_engine.post("/generate", {**base, "return_routed_experts": [True]})
    assert listed.status_code == 400 and "must be a boolean" in listed.text

    # One start for every request of a batch (GenerateReqInput.__getitem__ hands the scalar on).
    replies = _generate(
        qwen_engine,
        **{**base, "input_ids": [PROMPT, PROMPT[:4]], "routed_experts_start_len": 2},
    )
    assert [_routes(r, 2, 2).shape[0] for r in replies] == [len(PROMPT) + 2 - 1 - 2, 4 + 2 - 1 - 2]


def test_without_the_server_flag_replies_have_no_routes(qwen3_moe) -> None:
    """SGLang without --enable-return-routed-experts has no capturer: the request is answered as
    usual, without the key; a bad start is still refused."""
    for served in _served(qwen3_moe):
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
        reply = _generate(served, **body)
        assert "routed_experts" not in reply["meta_info"] and len(reply["output_ids"]) == 2
        assert served.post("/generate", {**body, "routed_experts_start_len": -1}).status_code == 400


def test_a_dense_model_refuses_the_flag(tmp_path) -> None:
    from slime.backends.torch_engine.engine import TorchEngine
    from slime.backends.torch_engine.server_args import parse_server_args
    from tools.make_tiny_model import make_tiny_model

    dense = make_tiny_model(tmp_path / "qwen2", arch="qwen2")
    args = parse_server_args(["--model-path", str(dense), "--enable-return-routed-experts"])
    with pytest.raises(ValueError, match=r"--enable-return-routed-experts: the model .* has no MoE router"):
        TorchEngine(args)
