"""The reward of the two-turn variant (``multi_turn_generate.py``): half for each right answer.

The single-turn task needs no code of its own (``--rm-type exact``: the response is the colour). A
two-turn response holds both model turns and the observation between them, so exact match on the whole
response never scores. This reward reads the model's own turns (``Sample.turn_spans``) alone: 0.5 when
the first names the first picture's colour (``metadata["colours"][0]``), 0.5 when the second is the
label (``yes`` / ``no``). Why half each: an untrained model rarely gets both, and credit for the first
turn still ranks a group's samples, so GRPO has a direction from the first rollout on.

Use with ``--custom-rm-path examples/vlm/reward.py:multi_turn_reward``.
"""

from __future__ import annotations

import argparse

from slime.rollout.generate_utils import cached_tokenizer
from slime.rollout.plugin_args import tokenizer_path
from slime.rollout.sample import Sample


def model_turns(args: argparse.Namespace, sample: Sample) -> list[str]:
    """The text of each model turn, special tokens (its end-of-sequence token) left out."""
    tokenizer = cached_tokenizer(tokenizer_path(args))
    start = sample.prompt_length
    return [
        tokenizer.decode(sample.tokens[start + a : start + b], skip_special_tokens=True).strip()
        for a, b in sample.turn_spans
    ]


def multi_turn_reward(args: argparse.Namespace, sample: Sample) -> float:
    """0.5 per right answer (the first picture's colour, then yes/no); see the module docstring."""
    colours = sample.metadata.get("colours")
    if sample.label is None or not colours:
        raise ValueError(
            f"sample {sample.index} needs a label and metadata['colours']; pass --label-key label and "
            "examples/vlm/make_data.py's multi_turn.jsonl"
        )
    turns = model_turns(args, sample)
    first = len(turns) >= 1 and turns[0] == colours[0]
    second = len(turns) >= 2 and turns[1] == sample.label
    return 0.5 * first + 0.5 * second
