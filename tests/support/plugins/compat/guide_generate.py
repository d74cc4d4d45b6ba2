"""The usage guide's custom generate, as a user copies it: a bare file passed as
``--custom-generate-function-path guide_generate.py``, its ``custom_generate`` taking the whole
prompt group, posting each prompt as ``text`` to the router, setting ``sample.response`` (no tokens)
and, where it can tell already, ``sample.reward``; it returns the list."""

from __future__ import annotations

import asyncio

import aiohttp


async def custom_generate(args, samples, evaluation=False):
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sampling_params = {
        "temperature": args.rollout_temperature,
        "max_new_tokens": args.rollout_max_response_len,
    }

    async def one(session, sample):
        payload = {"text": sample.prompt, "sampling_params": sampling_params}
        async with session.post(url, json=payload) as reply:
            reply.raise_for_status()
            sample.response = (await reply.json())["text"]
        if sample.response.strip() == sample.label:  # an exact answer needs no reward model
            sample.reward = 1.0

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, sample) for sample in samples))
    return samples
