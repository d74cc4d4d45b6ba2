"""A two-turn vision-language rollout: the model names a picture's colour, is shown a second picture as an
observation, and answers whether the two colours are the same.

``generate`` is a ``--custom-generate-function-path`` plugin for ``multi_turn.jsonl`` of
``examples/vlm/make_data.py``. One trajectory is::

    <|im_start|>user\\n[picture 1]colour?<|im_end|>\\n<|im_start|>assistant\\n
    red<|im_end|>                                                    <- model turn 1 (loss mask 1)
    \\n<|im_start|>user\\n[picture 2]same colour?<|im_end|>\\n<|im_start|>assistant\\n
                                                                     <- observation (loss mask 0)
    no<|im_end|>                                                     <- model turn 2 (loss mask 1)

where ``[picture]`` is ``<|vision_start|>``, the picture's image pads, ``<|vision_end|>``. The second
picture is ``metadata["observation_image"]`` and its question ``metadata["observation_question"]``. The
second answer needs both pictures, one of them arriving mid-trajectory: the engine and the trainer must
see every image of the sample in order.

The observation is appended with ``slime.rollout.generate_utils.append_image_observation(args, sample,
text, images)``: ``text`` holds one ``<image>`` per item of ``images``; the helper tokenizes it, expands
each image's pad to its token count, appends the ids with loss mask 0, and adds the images to the
sample's ``multimodal_inputs`` (and processor tensors), so that every later request and the trainer see
all of the sample's images in order; ``generate_turn(..., images=request_images(args, sample))`` sends
a turn's ids with every image so far (its pads collapsed to one per image, as the engine expects).
Everything else is the text multi-turn pattern of ``examples/search-r1``: token ids appended, never
re-tokenized text, and with ``--partial-rollout`` an aborted trajectory resumes where it stopped
(``metadata["observed"]`` records that the observation is in).

The episode ends after the second model turn, or earlier when a turn does not end with the model's
end-of-sequence token (cut by ``TURN_TOKENS`` or by the ``--rollout-max-response-len`` budget, aborted);
``examples/vlm/reward.py:multi_turn_reward`` scores it.
"""

from __future__ import annotations

import argparse
from typing import Any

from slime.rollout.generate_utils import (
    append_image_observation,
    append_model_turn,
    cached_tokenizer,
    generate_turn,
    remaining_tokens,
    request_images,
    route_request,
    start_sample,
)
from slime.rollout.plugin_args import tokenizer_path
from slime.rollout.prompt_files import IMAGE_PLACEHOLDER
from slime.rollout.sample import Sample

TURN_TOKENS = 8
"""Most tokens of one model turn: the longest answer (``yellow``) and the end-of-sequence token fit."""
MODEL_TURNS = 2
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def observation_text(question: str, turn_ended: bool) -> str:
    """The user turn that shows the second picture, in the chat template's format, with the assistant
    turn opened. When the model's turn did not end with ``<|im_end|>`` it is closed here."""
    close = "" if turn_ended else IM_END
    return f"{close}\n{IM_START}user\n{IMAGE_PLACEHOLDER}{question}{IM_END}\n{IM_START}assistant\n"


def _observation(sample: Sample) -> tuple[str, str]:
    image, question = sample.metadata.get("observation_image"), sample.metadata.get("observation_question")
    if not image or not question:
        raise ValueError(
            f"sample {sample.index} has no metadata['observation_image'] / ['observation_question']: each "
            "row of the prompt file needs both (examples/vlm/make_data.py writes them in multi_turn.jsonl)"
        )
    return image, question


async def generate(args: argparse.Namespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """The trajectory of one sample (continues a partial one); see the module docstring."""
    image, question = _observation(sample)
    start_sample(args, sample)
    eos = cached_tokenizer(tokenizer_path(args)).eos_token_id
    while True:
        if len(sample.turn_spans) == 1 and not sample.metadata.get("observed"):
            turn_ended = sample.tokens[-1] == eos
            append_image_observation(args, sample, observation_text(question, turn_ended), [image])
            sample.metadata["observed"] = True
        budget = min(TURN_TOKENS, remaining_tokens(sample, sampling_params))
        params = {**sampling_params, "max_new_tokens": budget}
        images = request_images(args, sample)
        turn = await generate_turn(
            args, sample.tokens, params, sample.index, images=images, routes=route_request(sample)
        )
        append_model_turn(sample, turn)
        done = len(sample.turn_spans) >= MODEL_TURNS
        if done or not turn.output_ids or turn.status is not Sample.Status.COMPLETED:
            return sample
