"""On-policy distillation, rollout side: the teacher's log-probs of every token the student sampled.

A teacher is an engine (SGLang or slime's torch engine) asked for a prefill of the sample's tokens, as
upstream slime and SGLang's own scoring do: ``max_new_tokens: 0``, ``return_logprob: true`` and
``logprob_start_len`` at the last prompt token. SGLang answers ``meta_info.input_token_logprobs`` as
``[None, lp(t[start+1]), ..., lp(t[n-1])]`` (``[None] + input_token_logprobs[:-1]`` with ids
``origin_input_ids[logprob_start_len:]``, ``managers/scheduler_components/logprob_result_processor.py``,
0.5.19 and 0.5.23), so the entries after the first are the response tokens' log-probs. SGLang computes
prompt log-probs from the raw logits (no temperature, ``layers/logprob_processor.py``): the teacher's
are at temperature 1 whatever the request says.

A sample with pictures is sent as the student saw it (one pad per picture plus ``image_data``) from
position 0, and the last ``response_length`` entries are its response's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from typing import Any

from slime.config.settings.distillation import OpdSettings
from slime.engine_client.generate import post_json
from slime.rollout.errors import RolloutError
from slime.rollout.generate_utils import RolloutContext, request_images
from slime.rollout.plugin_args import tokenizer_path
from slime.rollout.sample import Sample
from slime.rollout.vision import vision_processor


def teacher_request(args: argparse.Namespace, sample: Sample, temperature: float) -> dict[str, Any]:
    """The prefill-only ``/generate`` that scores ``sample``'s response on a teacher, with the rollout's
    temperature as upstream sends it (SGLang leaves prompt log-probs unscaled all the same). A sample
    with pictures goes as the student's requests did: one pad per picture, ``image_data``, from 0."""
    images = request_images(args, sample) if sample.multimodal_inputs else []
    ids = sample.tokens
    if images:
        ids = vision_processor(tokenizer_path(args)).collapse(sample.tokens, len(images))
    payload: dict[str, Any] = {
        "input_ids": list(ids),
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0 if images else sample.prompt_length - 1,
    }
    if images:
        payload["image_data"] = images
    return payload


def response_log_probs(reply: dict[str, Any], sample: Sample, teacher: str) -> list[float]:
    """The teacher's log-probs of the response tokens from its prefill reply; a reply that does not
    hold one per response token is a ``RolloutError`` naming the teacher."""
    entries = (reply.get("meta_info") or {}).get("input_token_logprobs") or []
    n = sample.response_length
    values = [entry[0] for entry in entries[1:]][-n:] if n else []
    if len(values) != n or any(v is None for v in values):
        raise RolloutError(
            f"teacher {teacher} answered sample {sample.index} with {max(len(entries) - 1, 0)} prompt "
            f"log-probs for its {n} response tokens; it must be an SGLang-protocol /generate endpoint"
        )
    return [float(v) for v in values]


class TeacherPool:
    """The run's teachers by name; a name served by several engines (the run's own) uses them in turn."""

    def __init__(self, settings: OpdSettings, temperature: float) -> None:
        self.settings, self.temperature = settings, temperature
        self._next = {name: itertools.cycle(urls.split()) for name, urls in settings.teacher_urls.items()}

    def url_for(self, sample: Sample) -> tuple[str, str]:
        """``(teacher name, its /generate URL)`` for ``sample``."""
        try:
            name = self.settings.teacher_of(sample.metadata)
        except KeyError as error:
            raise RolloutError(str(error.args[0])) from None
        return name, f"{next(self._next[name]).rstrip('/')}/generate"

    async def score(self, args: argparse.Namespace, context: RolloutContext, samples: list[Sample]) -> None:
        """Sets ``teacher_log_probs`` of every trainable sample of ``samples`` (one request each, in
        parallel); a failed sample (FAILED, no trained token) gets zeros and no request."""
        await asyncio.gather(*(self._score_one(args, context, s) for s in samples))

    async def _score_one(self, args: argparse.Namespace, context: RolloutContext, sample: Sample) -> None:
        if sample.status == Sample.Status.FAILED or not sample.response_length:
            sample.teacher_log_probs = [0.0] * sample.response_length
            return
        name, url = self.url_for(sample)
        try:
            reply = await post_json(context.session, url, teacher_request(args, sample, self.temperature))
        except Exception as error:
            raise RolloutError(
                f"teacher {name} at {url} failed on sample {sample.index}: {str(error)[:300]}"
            ) from None
        sample.teacher_log_probs = response_log_probs(reply, sample, f"{name} at {url}")
