"""The SGLang ``sampling_params`` of a request, from the rollout's sampling settings or an eval set's."""

from __future__ import annotations

from typing import Any

from slime.config.eval_config import EvalSetSettings
from slime.config.settings.rollout import SamplingSettings


def sampling_params(sampling: SamplingSettings, eval_set: EvalSetSettings | None = None) -> dict[str, Any]:
    """SGLang sampling parameters from the ``--rollout-*`` flags, or an evaluation set's settings: the
    one place a request's temperature comes from.

    Stop strings, stop tokens and special-token skipping are the rollout's for both: they belong to
    the model's chat format, not to a data set. ``no_stop_trim`` keeps a matched stop string in the
    text, so that ``response`` is the text of exactly the tokens trained on (``output_ids`` always
    keep the stop token).
    """
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_response_len,
        "skip_special_tokens": sampling.skip_special_tokens,
        "no_stop_trim": True,
    }
    if eval_set is not None:
        params["temperature"], params["top_p"] = eval_set.temperature, eval_set.top_p
        params["top_k"], params["max_new_tokens"] = eval_set.top_k, eval_set.max_response_len
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    return params
