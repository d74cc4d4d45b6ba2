"""A prompt at or over the engines' context length: a FAILED sample the trainer carries, not a stopped run.

Such a prompt gets no request (``generate_turns`` caps every ``max_new_tokens`` to what the context
leaves), so before, its samples ended TRUNCATED with 0 response tokens, the trainer refused the whole
rollout (``check_train_data``: a sequence needs a response token) and ``--auto-resume`` replayed the same
stop. Now they are FAILED on a two-token stub: counted in ``rollout/failed_ratio``, loss mask 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
import pytest

from slime.backends.megatron.batching import check_train_data
from slime.rollout.generate_utils import (
    RolloutContext,
    append_model_turn,
    complete_generated,
    generate_turns,
    rollout_context,
)
from slime.rollout.sample import Sample
from slime.rollout.train_data import rollout_metrics, samples_to_train_data
from tests.support.in_process import train_in_process
from tests.support.train_runs import ONE_PER_SIDE, read_events

CONTEXT = 24
"""The engines' context length in these tests: the reverse task's 3-letter prompts fit, with room for
their responses; the long prompt below does not."""

LONG_PROMPT = "abcdefghijklmnopqrstuvwxyz" * 2
"""52 characters, one token each in the tiny model's character-level vocabulary: over ``CONTEXT``."""


def generate_without_engines(inputs: list[list[int]], context_length: int) -> list:
    """``generate_turns`` in a rollout whose engines report ``context_length``; there is no router, so
    any request it sent would fail."""

    async def run() -> list:
        async with aiohttp.ClientSession() as session:
            context = RolloutContext(session, context_length_lookup=lambda: context_length)
            with rollout_context(context):
                return await generate_turns(argparse.Namespace(), inputs, {"max_new_tokens": 4})

    return asyncio.run(run())


def test_a_prompt_that_fills_the_context_makes_a_failed_sample_the_trainer_takes():
    prompt = list(range(1, CONTEXT + 7))  # 30 tokens
    (turn,) = generate_without_engines([prompt], CONTEXT)
    assert turn.status is Sample.Status.TRUNCATED and turn.context_capped and not turn.output_ids
    assert turn.finish_reason["message"] == "its 30 input tokens fill the context length of 24"

    failed = Sample(index=0, tokens=list(prompt), rollout_log_probs=[], loss_mask=[])
    append_model_turn(failed, turn)
    assert failed.status is Sample.Status.FAILED
    assert failed.metadata == {
        "context_capped": True,
        "error": "its 30 input tokens fill the context length of 24",
    }
    assert failed.tokens == [1, 30] and failed.response_length == 1
    assert failed.loss_mask == [0] and failed.rollout_log_probs == [0.0]

    fine = Sample(
        index=1, tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-0.5, -0.7],
        status=Sample.Status.COMPLETED, reward=1.0,
    )  # fmt: skip
    failed.reward = 0.0
    data = samples_to_train_data([[fine, failed]])
    assert (
        check_train_data(data, ("tokens", "response_lengths")) == 2
    )  # before: "sample 1: response of 0 tokens in a sequence of 30"
    assert data["loss_masks"] == [[1, 1], [0]] and data["valid_rewards"] == [True, False]
    assert rollout_metrics([[fine, failed]], 1.0)["rollout/failed_ratio"] == 0.5


def test_a_longer_response_run_into_the_context_stays_truncated():
    """A sample that already has a response (a later turn, a resumed partial one) trains what it has."""
    (turn,) = generate_without_engines([list(range(1, CONTEXT + 1))], CONTEXT)
    sample = Sample(index=0, tokens=list(range(1, CONTEXT + 1)), response_length=3)
    sample.loss_mask, sample.rollout_log_probs = [1, 1, 1], [-0.1, -0.2, -0.3]
    append_model_turn(sample, turn)
    assert sample.status is Sample.Status.TRUNCATED and sample.response_length == 3
    assert len(sample.tokens) == CONTEXT and "error" not in sample.metadata


def test_a_plugin_sample_finished_without_a_response_token_is_carried_failed():
    """``--custom-generate-function-path`` returning a finished sample with no response token (it
    gave up, or marked it FAILED itself): FAILED on the stub, the plugin's own error kept."""
    plugin = "my.generate"
    truncated = Sample(index=0, tokens=[5, 6, 7], status=Sample.Status.TRUNCATED)
    complete_generated(argparse.Namespace(), truncated, plugin)
    assert truncated.status is Sample.Status.FAILED and truncated.tokens == [5, 7]
    assert (
        truncated.response_length == 1 and truncated.loss_mask == [0] and truncated.rollout_log_probs is None
    )
    assert truncated.metadata["error"] == (
        "--custom-generate-function-path my.generate returned it truncated without tokens"
    )

    failed = Sample(
        index=1, tokens=[5, 6, 7], status=Sample.Status.FAILED, metadata={"error": "tool crashed"}
    )
    complete_generated(argparse.Namespace(), failed, plugin)
    assert failed.response_length == 1 and failed.metadata["error"] == "tool crashed"


@pytest.mark.e2e
@pytest.mark.slow
def test_a_rollout_with_a_prompt_over_the_context_trains_on(ray_cluster, tiny_run_flags, tmp_path):
    """One rollout of 4 prompts × 4 samples on engines of context 24, one prompt of 52 tokens: its 4
    samples fail, the other 12 train, and the run ends normally."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [("abc", "cba"), (LONG_PROMPT, LONG_PROMPT[::-1]), ("dog", "god"), ("sun", "nus")]
    prompts.write_text("".join(json.dumps({"input": p, "label": label}) + "\n" for p, label in rows))
    tb, dump = tmp_path / "tb", tmp_path / "rollout_{rollout_id}.pt"
    flags = tiny_run_flags(
        "--tb-dir", str(tb), "--save-debug-rollout-data", str(dump),
        **ONE_PER_SIDE, prompt_data=prompts, sglang_context_length=CONTEXT, num_rollout=1,
    )  # fmt: skip
    train_in_process(flags)
    scalars = read_events(tb)
    assert scalars["rollout/failed_ratio"] == [(0, 0.25)]
    assert scalars["rollout/context_capped_samples"] == [(0, 4.0)]
    assert [step for step, _ in scalars["train/loss"]] == [0]

    import torch

    data = torch.load(str(dump).format(rollout_id=0), weights_only=False)
    failed = [i for i, valid in enumerate(data["valid_rewards"]) if not valid]
    assert len(failed) == 4 and len({data["prompt_groups"][i] for i in failed}) == 1  # the long prompt's
    assert all(data["loss_masks"][i] == [0] and len(data["tokens"][i]) == 2 for i in failed)
    assert all(sum(data["loss_masks"][i]) > 0 for i in range(16) if i not in failed)
