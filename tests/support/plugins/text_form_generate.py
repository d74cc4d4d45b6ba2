"""Generate plugins in the form a new user first writes (the usage guide's multi-turn shape): a chat
prompt rendered and posted to the router as ``text``, the reply's text kept as ``sample.response``,
no tokens. Also two broken ones: a sample returned untouched, and one always returned aborted."""

from __future__ import annotations

import argparse

import aiohttp

from slime.engine_client.generate import post_json
from slime.rollout.generate_utils import cached_tokenizer
from slime.rollout.sample import Sample


async def text_generate(args: argparse.Namespace, sample: Sample, sampling_params: dict) -> Sample:
    tokenizer = cached_tokenizer(args.hf_checkpoint)
    text = tokenizer.apply_chat_template(sample.prompt, tokenize=False, add_generation_prompt=True)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    async with aiohttp.ClientSession() as session:
        reply = await post_json(session, url, {"text": text, "sampling_params": sampling_params})
    sample.response = reply["text"]
    return sample


async def untouched_generate(args: argparse.Namespace, sample: Sample, sampling_params: dict) -> Sample:
    return sample


async def aborted_generate(args: argparse.Namespace, sample: Sample, sampling_params: dict) -> Sample:
    sample.status = Sample.Status.ABORTED
    return sample


def first_letter_reward(args: argparse.Namespace, sample: Sample) -> float:
    return float(sample.response[:1] == (sample.label or "")[:1])


def write_chat_prompts(path):
    """Three chat-format prompts (``messages``) with reversed-word labels."""
    import json

    rows = [{"messages": [{"role": "user", "content": w}], "label": w[::-1]} for w in ("abc", "dog", "sun")]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
