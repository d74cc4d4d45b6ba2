"""A multi-turn generate written as THUDM/slime's examples write them (search-r1, retool): it talks to
the router with ``post``, tokenizes with ``GenerateState``'s tokenizer and fills ``tokens``,
``response_length``, ``loss_mask`` and ``rollout_log_probs`` itself. The "tool" answers every model
turn with a fixed observation, masked out of the loss. Each call is logged (``log_call``)."""

from slime.rollout.rm_hub import async_rm
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample
from tests.support.plugins.compat import log_call

MAX_TURNS = 2
OBSERVATION = "!"


async def generate(args, sample: Sample, sampling_params) -> Sample:
    """Up to two one-token model turns with an observation between; TRUNCATED at the end of the budget."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    response, response_ids, loss_mask, log_probs = "", [], [], []
    finish = "stop"
    for turn in range(MAX_TURNS):
        params = {**sampling_params, "max_new_tokens": 1}
        async with state.semaphore:
            output = await post(
                url,
                {"input_ids": prompt_ids + response_ids, "sampling_params": params, "return_logprob": True},
            )
        finish = output["meta_info"]["finish_reason"]["type"]
        if finish == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        pairs = output["meta_info"]["output_token_logprobs"]
        response += output["text"]
        response_ids += [item[1] for item in pairs]
        log_probs += [item[0] for item in pairs]
        loss_mask += [1] * len(pairs)
        if turn + 1 < MAX_TURNS:
            obs_ids = state.tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
            response += OBSERVATION
            response_ids += obs_ids
            log_probs += [0.0] * len(obs_ids)
            loss_mask += [0] * len(obs_ids)
    sample.tokens = prompt_ids + response_ids
    sample.response_length = len(response_ids)
    sample.response = response
    sample.loss_mask = loss_mask
    sample.rollout_log_probs = log_probs
    sample.status = Sample.Status.TRUNCATED if finish == "length" else Sample.Status.COMPLETED
    sample.reward = await async_rm(args, sample)  # upstream examples score inside generate too
    log_call(
        args,
        {
            "plugin": "generate",
            "status": sample.status.value,
            "loss_mask": loss_mask,
            "semaphore": state.semaphore._value >= 1,
        },
    )
    return sample
