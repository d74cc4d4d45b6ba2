"""Upstream slime's on-policy distillation plugins, at upstream's path, so its OPD command runs as it is:

    --use-opd --opd-type sglang --opd-kl-coef 1.0
    --custom-rm-path slime.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards
    --rm-url http://TEACHER:PORT/generate

``reward_func`` asks the teacher at ``--rm-url`` for a prefill of the sample (the same request slime's
own teachers get, ``slime.rollout.teacher``) and keeps its whole reply as the sample's raw reward;
``post_process_rewards`` reads the response tokens' log-probs out of it into ``teacher_log_probs`` and
trains on the teacher alone (every reward 0). slime's own flags (``--opd-teacher-hf-checkpoint``,
``--opd-teacher-urls``) do the same without the reward slot and keep the task reward.
"""

from __future__ import annotations

import argparse
from typing import Any

from slime.config.settings.rollout import RewardSettings, SamplingSettings
from slime.engine_client.generate import one_off_session, post_json
from slime.rollout.plugin_args import settings_of
from slime.rollout.sample import Sample
from slime.rollout.teacher import response_log_probs, teacher_request


async def reward_func(args: argparse.Namespace, sample: Sample, **kwargs: Any) -> dict[str, Any]:
    """The teacher's prefill reply for ``sample`` (``--rm-url``)."""
    url = teacher_url(args)
    temperature = settings_of(args, SamplingSettings).temperature
    async with one_off_session() as session:
        reply: dict[str, Any] = await post_json(session, url, teacher_request(args, sample, temperature))
    return reply


def teacher_url(args: argparse.Namespace) -> str:
    """``--rm-url``: the teacher's ``/generate``."""
    url = settings_of(args, RewardSettings).rm_url
    if url is None:
        raise ValueError("slime.rollout.on_policy_distillation needs --rm-url http://TEACHER:PORT/generate")
    return url


def reply_of(sample: Sample) -> dict[str, Any]:
    """The teacher's reply ``reward_func`` left as the sample's raw reward."""
    return sample.reward if isinstance(sample.reward, dict) else {}


def post_process_rewards(
    args: argparse.Namespace, samples: list[Sample], **kwargs: Any
) -> tuple[list[float], list[float]]:
    """Each sample's ``teacher_log_probs`` from its reply; rewards 0 (pure distillation)."""
    for sample in samples:
        if sample.status != Sample.Status.FAILED:
            sample.teacher_log_probs = response_log_probs(reply_of(sample), sample, teacher_url(args))
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
