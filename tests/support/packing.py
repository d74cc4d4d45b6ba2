"""Train data laid out by hand for the packing tests: which samples share a prompt, and how long."""

from __future__ import annotations


def shared_prompt_data() -> dict:
    """Two prompts ([5, 6, 7] and [8, 9]) with three and two samples, interleaved, and one alone."""
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [5, 6, 7], [8, 9], [4]]
    responses = [[10, 11], [12], [13, 14, 15], [16], [17, 18], [19, 20]]
    return {
        "tokens": [p + r for p, r in zip(prompts, responses, strict=True)],
        "response_lengths": [len(r) for r in responses],
        "loss_masks": [[1] * len(r) for r in responses],
        "loss_weights": [1.0] * len(prompts),
    }
