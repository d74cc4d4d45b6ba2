"""Supervised fine-tuning through the RL loop: a rollout function that reads responses, not engines.

``--loss-type sft_loss --rollout-function-path slime.rollout.sft_rollout.generate_rollout`` with
``--input-key`` naming the prompt and ``--label-key`` the target response. Each sample is the
prompt's tokens followed by the response's and the end-of-sequence token, which is trained on too so
that the model learns to stop; only the response (and that token) is in the loss mask. Prompts are
rendered with the chat template under ``--apply-chat-template`` exactly as the RL rollout renders
them, so an SFT warm start and the RL run that follows see the same prompt format.
"""

from __future__ import annotations

import argparse

from slime.config.settings.data import DataSettings
from slime.rollout.data_source import DataSource
from slime.rollout.generate_utils import cached_tokenizer, fail_on_image, prompt_ids
from slime.rollout.output import RolloutOutput
from slime.rollout.plugin_args import settings_of, tokenizer_path
from slime.rollout.prompt_files import DataError
from slime.rollout.sample import Sample
from slime.rollout.vision import ImageError


def build_sft_sample(args: argparse.Namespace, sample: Sample) -> Sample:
    """Tokens, response length and loss mask of one prompt/response pair (the label is the response)."""
    if sample.label is None:
        raise DataError(f"sample {sample.index} has no response: set --label-key to the response field")
    tokenizer = cached_tokenizer(tokenizer_path(args))
    try:
        prompt = prompt_ids(args, sample)
    except ImageError as error:  # left out of the loss, named in the log; the other pairs train
        fail_on_image([sample], error)
        return sample
    response = tokenizer(sample.label, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        response.append(tokenizer.eos_token_id)
    sample.tokens = prompt + response
    sample.response = sample.label
    sample.response_length = len(response)
    sample.loss_mask = [1] * len(response)
    sample.reward = 0.0
    sample.status = Sample.Status.COMPLETED
    return sample


def generate_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: DataSource, evaluation: bool = False
) -> RolloutOutput:
    """``--rollout-batch-size`` pairs per rollout (``--n-samples-per-prompt`` should stay 1)."""
    if evaluation:
        raise ValueError("the SFT rollout has no evaluation (it samples nothing); drop --eval-interval")
    groups = data_source.get_samples(settings_of(args, DataSettings).rollout_batch_size)
    return RolloutOutput([[build_sft_sample(args, sample) for sample in group] for group in groups])
