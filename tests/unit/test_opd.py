"""On-policy distillation without Ray: the advantage shaping by hand-computed values, the teacher request
and its reply as SGLang 0.5.19 / 0.5.23 shape them, the routing of samples to teachers, upstream slime's
reward + post-process form, and the one-line refusals."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from slime.algorithms.distillation import opd_advantages
from slime.backends.megatron.policy_inputs import DataParallel, PolicyInputs
from slime.config import parse_args
from slime.config.settings.distillation import OpdSettings, parse_teacher_urls
from slime.config.settings.trainer import LossSettings
from slime.rollout import on_policy_distillation
from slime.rollout.errors import RolloutError
from slime.rollout.sample import Sample
from slime.rollout.teacher import TeacherPool, response_log_probs, teacher_request
from slime.rollout.train_data import apply_reward_post_process, samples_to_train_data
from tests.support.configs import base, expect_error, make_hf
from tests.support.served_engine import ServedEngine
from tests.support.trainers import bare_settings
from tests.unit.test_sglang_wheels import RELEASES, source


def test_advantage_loses_coef_times_reverse_kl_on_policy_tokens_only() -> None:
    shaped = opd_advantages(
        advantages=[[1.0, 1.0, 1.0], torch.tensor([-0.5])],
        student_log_probs=[torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0])],
        teacher_log_probs=[[-1.5, -1.0, -0.5], [-1.0]],
        loss_masks=[[1, 0, 1], [1]],
        coef=0.5,
    )
    # reverse KL per token: 0.5, -1.0 (masked: a tool token keeps its advantage), 0.0; and -2.0
    assert shaped[0].tolist() == [0.75, 1.0, 1.0]
    assert shaped[1].tolist() == [0.5]


def test_opd_shapes_grpo_advantages_after_the_estimator() -> None:
    """Two prompts × two samples, GRPO: the group-normalised advantages first, then the teacher's term
    against the old policy's log-probs."""
    settings = bare_settings(n_samples_per_prompt=2, num_steps_per_rollout=1, use_opd=True, opd_kl_coef=2.0)
    inputs = PolicyInputs(settings, DataParallel.single(), argparse.Namespace())
    data = {
        "tokens": [[1, 2], [1, 3], [5, 6], [5, 7]],
        "response_lengths": [1, 1, 1, 1],
        "loss_masks": [[1], [1], [1], [1]],
        "rewards": [1.0, 0.0, 1.0, 1.0],
        "teacher_log_probs": [[-1.0], [-1.0], [-0.5], [-2.0]],
    }
    shards = inputs.shards(data)
    grpo = [float(a[0]) for a in shards[0]["advantages"]]
    shards[0]["old_log_probs"] = [
        torch.tensor([-1.5]),
        torch.tensor([-1.0]),
        torch.tensor([-0.5]),
        torch.tensor([-1.0]),
    ]
    inputs.complete(data, shards)
    got = [float(a[0]) for a in shards[0]["advantages"]]
    expected = [
        g - 2.0 * (s - t)
        for g, s, t in zip(grpo, [-1.5, -1.0, -0.5, -1.0], [-1.0, -1.0, -0.5, -2.0], strict=True)
    ]
    assert got == pytest.approx(expected)
    assert got[3] == pytest.approx(grpo[3] - 2.0)  # the student is surer than the teacher: pushed down


def sample(prompt: list[int], response: list[int], **fields: object) -> Sample:
    return Sample(index=7, tokens=[*prompt, *response], response_length=len(response), **fields)


def test_teacher_request_is_a_prefill_from_the_last_prompt_token() -> None:
    payload = teacher_request(argparse.Namespace(), sample([3, 4, 5], [6, 7]), 0.7)
    assert payload == {
        "input_ids": [3, 4, 5, 6, 7],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.7, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 2,
    }


def test_reply_entries_after_the_first_are_the_response_log_probs() -> None:
    reply = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-0.25, 6, None], [-1.5, 7, None]]}}
    assert response_log_probs(reply, sample([3, 4, 5], [6, 7]), "t") == [-0.25, -1.5]
    with pytest.raises(RolloutError, match=r"teacher t answered sample 7 with 1 prompt log-probs for its 2"):
        response_log_probs({"meta_info": {"input_token_logprobs": [[None, 5, None], [-0.25, 6, None]]}},
                           sample([3, 4, 5], [6, 7]), "t")  # fmt: skip


def test_samples_go_to_the_teacher_their_metadata_names_else_default() -> None:
    teachers = parse_teacher_urls(["default=127.0.0.1:1", "math=http://m:2"])
    pool = TeacherPool(
        OpdSettings(enabled=True, teacher_urls={**teachers, "default": "http://a:1 http://b:1"}), 1.0
    )
    assert pool.url_for(Sample(metadata={"teacher": "math"})) == ("math", "http://m:2/generate")
    assert [pool.url_for(Sample())[1] for _ in range(3)] == [
        "http://a:1/generate", "http://b:1/generate", "http://a:1/generate",
    ]  # fmt: skip
    with pytest.raises(
        RolloutError, match="teacher='code' names no teacher; --opd-teacher-urls has default, math"
    ):
        pool.url_for(Sample(metadata={"teacher": "code"}))
    assert teachers == {"default": "http://127.0.0.1:1", "math": "http://m:2"}


@pytest.fixture(scope="module")
def teacher(tiny_models) -> ServedEngine:
    served = ServedEngine(["--model-path", str(tiny_models["qwen2"])])
    yield served
    served.close()


def test_a_torch_engine_teacher_scores_the_response_as_its_own_forward(teacher, tiny_models) -> None:
    """The reply's log-probs are the teacher model's own at the response positions, unscaled by the
    request's temperature (SGLang's prompt log-probs are; logprob_processor.py in 0.5.19 and 0.5.23)."""
    from transformers import AutoModelForCausalLM

    prompt, response = [5, 9, 14, 3], [8, 21, 2]
    reply = teacher.post(
        "/generate", teacher_request(argparse.Namespace(), sample(prompt, response), 0.5)
    ).json()
    got = torch.tensor(response_log_probs(reply, sample(prompt, response), "teacher"))
    assert reply["meta_info"]["completion_tokens"] == 0
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None])[
        :, 0
    ]
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)


def test_upstream_reward_and_post_process_form(teacher, tiny_models) -> None:
    """Upstream's OPD command parses as it is; its reward function keeps the teacher's reply, its
    post-process function turns that into teacher_log_probs and zero rewards, which train as they are."""
    import asyncio

    module = "slime.rollout.on_policy_distillation"
    args = parse_args(
        base(
            str(tiny_models["qwen2"]), "--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0",
            "--custom-rm-path", f"{module}.reward_func",
            "--custom-reward-post-process-path", f"{module}.post_process_rewards",
            "--rm-url", f"{teacher.url}/generate",
        )
    )  # fmt: skip
    assert LossSettings.from_args(args).rewards_post_processed
    samples = [sample([5, 9, 14], [8, 21]), sample([5, 9], [3])]
    for s in samples:
        s.reward = asyncio.run(on_policy_distillation.reward_func(args, s))
        s.status = Sample.Status.COMPLETED
    path = "slime.rollout.on_policy_distillation.post_process_rewards"
    raw, rewards = apply_reward_post_process(path, args, [samples])
    assert raw == rewards == [0.0, 0.0]
    assert [len(s.teacher_log_probs or []) for s in samples] == [2, 1]
    assert all(v < 0 for s in samples for v in s.teacher_log_probs or [])
    for s, value in zip(samples, raw, strict=True):
        s.reward = value
    assert samples_to_train_data([samples])["teacher_log_probs"] == [s.teacher_log_probs for s in samples]


@pytest.mark.parametrize("release", RELEASES)
def test_the_teacher_reply_format_is_sglangs(release: str) -> None:
    """SGLang builds input_token_logprobs as ``[None] + values[:-1]`` with the ids from
    ``logprob_start_len`` on (managers/scheduler_components/logprob_result_processor.py) and computes
    prompt log-probs without the temperature (layers/logprob_processor.py, only the speculative output
    path divides by it), in both releases the project supports."""
    root = source(release)
    processor = (root / "managers/scheduler_components/logprob_result_processor.py").read_text()
    assert "req.logprob.input_token_logprobs_val = [None] + input_token_logprobs[:-1]" in processor
    assert "input_token_logprobs_idx = req.origin_input_ids[req.logprob_start_len :]" in processor
    assert (root / "layers/logprob_processor.py").read_text().count("/ temperatures") == 1


@pytest.mark.parametrize(
    ("extra", "flag", "text"),
    [
        (["--use-opd", "--opd-type", "megatron"], "--opd-type", "not supported; serve the teacher with"),
        (
            ["--use-opd", "--opd-teacher-load", "/t"],
            "--opd-teacher-load",
            "(--opd-type megatron) is not supported",
        ),
        (["--opd-only"], "--opd-only", "has no effect without --use-opd"),
        (["--use-opd"], "--use-opd", "needs a teacher: serve the teacher with --opd-teacher-hf-checkpoint"),
        (
            ["--use-opd", "--opd-teacher-urls", "math=h:1"],
            "--opd-teacher-urls",
            "needs a default=URL teacher",
        ),
        (["--use-opd", "--opd-teacher-urls", "h:1"], "--opd-teacher-urls", "'h:1' is not NAME=URL"),
    ],
)
def test_opd_refusals_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], flag: str, text: str
) -> None:
    assert text in expect_error(capsys, base(make_hf(tmp_path), *extra), flag)


def test_a_teacher_of_another_tokenizer_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_models
) -> None:
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_models["qwen2"], teacher)
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "x"] = vocab.pop(first)
    (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))
    argv = base(str(tiny_models["qwen2"]), "--use-opd", "--opd-teacher-hf-checkpoint", str(teacher))
    assert "tokenizer differs from --hf-checkpoint" in expect_error(
        capsys, argv, "--opd-teacher-hf-checkpoint"
    )
    same = parse_args(
        base(str(tiny_models["qwen2"]), "--use-opd", "--opd-teacher-hf-checkpoint", str(tiny_models["qwen2"]))
    )
    assert OpdSettings.from_args(same).teacher_gpus == 1


def test_under_opd_a_trained_sample_without_teacher_log_probs_is_one_error() -> None:
    scored = sample([3, 4], [5, 6], teacher_log_probs=[-0.5, -1.0], reward=1.0)
    failed = sample([3, 4], [5], status=Sample.Status.FAILED, reward=0.0)
    data = samples_to_train_data([[scored, failed]], distillation=True)
    assert data["teacher_log_probs"] == [[-0.5, -1.0], [0.0]]  # a failed sample is never trained on
    missing = r"sample 7 has no teacher log-probs for its 2 response tokens; pass --opd-teacher"
    with pytest.raises(RolloutError, match=missing):
        samples_to_train_data([[sample([3, 4], [5, 6], reward=1.0)]], distillation=True)
    assert "teacher_log_probs" not in samples_to_train_data([[sample([3, 4], [5, 6], reward=1.0)]])
