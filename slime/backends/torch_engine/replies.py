"""The reply a finished /generate request gets, in SGLang's shape: text, output ids and meta_info.

Written by the scheduler thread when a request leaves (finished, stopped or aborted); what each
field means and which SGLang file it mirrors is in ``protocol.py``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from slime.backends.torch_engine.request import Request
from slime.backends.torch_engine.routed_experts import encode_routes


def generate_reply(request: Request, tokenizer: Any, weight_version: str) -> dict[str, Any]:
    """The /generate reply of a finished ``request``, in SGLang's shape (see protocol.py).

    A request aborted in the waiting queue gets the tokenizer manager's own reply (SGLang
    0.5.19-0.5.23, ``TokenizerManager._handle_abort_req``): meta_info holds only ``id``,
    ``finish_reason``, ``weight_version``, ``e2e_latency``, the log-probs it had (with
    ``return_logprob``) and ``completion_tokens``; no ``prompt_tokens`` or ``cached_tokens``, and no
    ``routed_experts`` (it never ran). Any other request that asked for routed experts, finished or
    aborted while running, gets the rows of the positions it computed (``Request.routes_reply``).
    """
    params = request.params
    reason = request.finish_reason
    ids = request.output_ids
    matched = reason.get("matched") if reason else None
    text_ids = ids[:-1] if isinstance(matched, int) and not params.no_stop_trim and ids else ids
    text = tokenizer.decode(text_ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[: pos + len(matched)] if params.no_stop_trim else text[:pos]
    meta: dict[str, Any] = {"id": request.rid, "finish_reason": reason}
    if request.aborted_in_queue:
        meta.update(weight_version=weight_version, e2e_latency=time.perf_counter() - request.arrival)
    else:
        meta.update(
            prompt_tokens=len(request.input_ids),
            weight_version=weight_version,
            num_retractions=request.num_retractions,
        )
    if request.return_logprob:
        with_text = request.return_text_in_logprobs

        def triples(values: Sequence[float | None], tokens: list[int]) -> list[list[Any]]:
            texts = [tokenizer.decode([t]) for t in tokens] if with_text else [None] * len(tokens)
            return [[v, t, s] for v, t, s in zip(values, tokens, texts, strict=True)]

        start = request.logprob_start_len
        input_tokens = request.input_ids[start:] if request.input_logprobs else []
        meta["input_token_logprobs"] = triples(request.input_logprobs, input_tokens)
        meta["output_token_logprobs"] = triples(request.output_logprobs, ids)
        meta["output_token_logprobs_length"] = len(ids)
    meta["completion_tokens"] = len(ids)
    if not request.aborted_in_queue:
        meta["cached_tokens"] = request.cached_tokens
        if request.images is not None:  # SGLang adds it only for a request that has image tokens
            meta["image_tokens"] = request.images.image_tokens
        routes = request.routes_reply()
        if routes is not None:
            meta["routed_experts"] = encode_routes(routes)
        meta["e2e_latency"] = time.perf_counter() - request.arrival
    return {"text": text, "output_ids": list(ids), "meta_info": meta}
