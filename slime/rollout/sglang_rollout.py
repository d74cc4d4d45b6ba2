"""The default rollout function: prompt groups -> HTTP ``/generate`` through the router -> scored samples.

``generate_rollout`` is what ``--rollout-function-path`` names by default. Per sample it sends the
prompt's token ids (tokenized once per group with the ``--hf-checkpoint`` tokenizer) to the router
and takes the response tokens and their log-probs from the reply: ``output_ids`` and
``meta_info.output_token_logprobs``. The response is never re-tokenized from text, because text ->
ids does not round-trip and the trainer must score exactly the tokens the engine sampled.

A group is scored (``score_groups``) as soon as its last sample is back, so rewards overlap with
generation. All requests share one aiohttp session; at most ``--sglang-server-concurrency`` requests
per engine are in flight, which is also what keeps the router from queueing without bound.

``--custom-generate-function-path`` replaces the per-sample step (multi-turn, tools):
``async def generate(args, sample, sampling_params) -> Sample``. It finds the router at
``http://{args.sglang_router_ip}:{args.sglang_router_port}`` as in slime.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from tqdm import tqdm

from slime.rollout.data_source import PromptDataSource, load_tokenizer, render_chat
from slime.rollout.rewards import score_groups
from slime.rollout.sample import Sample
from slime.utils.http import post_json

GenerateFn = Callable[[argparse.Namespace, Sample, dict[str, Any]], Awaitable[Sample]]

_FINISH_STATUS = {
    "stop": Sample.Status.COMPLETED,
    "length": Sample.Status.TRUNCATED,
    "abort": Sample.Status.ABORTED,
}


def load_function(path: str) -> Callable[..., Any]:
    """``module.attr`` imported (plugin paths were checked by ``slime.config`` at start-up)."""
    module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


@functools.cache
def cached_tokenizer(path: str) -> Any:
    """The ``--hf-checkpoint`` tokenizer, loaded once per process."""
    return load_tokenizer(path)


def sampling_params(args: argparse.Namespace, evaluation: bool = False) -> dict[str, Any]:
    """SGLang sampling parameters from the ``--rollout-*`` flags (``--eval-*`` ones for evaluation).

    ``no_stop_trim`` keeps a matched stop string in the text, so that ``response`` is the text of
    exactly the tokens trained on (``output_ids`` always keep the stop token).
    """
    prefix = "eval" if evaluation else "rollout"
    params: dict[str, Any] = {
        "temperature": getattr(args, f"{prefix}_temperature"),
        "top_p": getattr(args, f"{prefix}_top_p"),
        "top_k": getattr(args, f"{prefix}_top_k"),
        "max_new_tokens": getattr(args, f"{prefix}_max_response_len"),
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
    }
    if args.rollout_stop:
        params["stop"] = list(args.rollout_stop)
    if args.rollout_stop_token_ids:
        params["stop_token_ids"] = list(args.rollout_stop_token_ids)
    return params


def prompt_ids(args: argparse.Namespace, sample: Sample) -> list[int]:
    """The prompt's token ids: chat messages are rendered with the chat template first."""
    tokenizer = cached_tokenizer(args.hf_checkpoint)
    prompt = sample.prompt if isinstance(sample.prompt, str) else render_chat(tokenizer, sample.prompt)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def apply_reply(sample: Sample, prompt: list[int], reply: dict[str, Any]) -> Sample:
    """Fills the response side of ``sample`` from one SGLang ``/generate`` reply (pure)."""
    meta = reply["meta_info"]
    output_ids = list(reply["output_ids"])
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise ValueError("the /generate reply has no meta_info.output_token_logprobs; send return_logprob")
    if [t[1] for t in triples] != output_ids:
        raise ValueError(
            f"sample {sample.index}: output_token_logprobs ids {[t[1] for t in triples]} differ from "
            f"output_ids {output_ids}"
        )
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in _FINISH_STATUS:
        raise ValueError(f"sample {sample.index}: unknown finish_reason {finish!r}")
    sample.tokens = list(prompt) + output_ids
    sample.response = reply.get("text", "")
    sample.response_length = len(output_ids)
    sample.loss_mask = [1] * len(output_ids)
    sample.rollout_log_probs = [float(t[0]) for t in triples]
    sample.status = _FINISH_STATUS[kind]
    sample.weight_versions.append(str(meta.get("weight_version")))
    return sample


class RolloutClient:
    """The per-rollout HTTP state: one session, one concurrency bound, the router's ``/generate``."""

    def __init__(self, args: argparse.Namespace, router_url: str, concurrency: int) -> None:
        self.args = args
        self.generate_url = f"{router_url}/generate"
        self.semaphore = asyncio.Semaphore(concurrency)
        # No total timeout: a long generation is not an error; a dead engine is the router's to report.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        )

    async def close(self) -> None:
        await self.session.close()

    async def generate(self, args: argparse.Namespace, sample: Sample, params: dict[str, Any]) -> Sample:
        """The default per-sample generate: one ``/generate`` call with the prompt's token ids."""
        prompt = sample.tokens or prompt_ids(args, sample)
        payload = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
        reply = await post_json(self.session, self.generate_url, payload)
        return apply_reply(sample, prompt, reply)


async def _generate_group(
    args: argparse.Namespace,
    group: list[Sample],
    generate: GenerateFn,
    client: RolloutClient,
    params: dict[str, Any],
    progress: tqdm,
) -> list[Sample]:
    if not group[0].tokens and generate == client.generate:
        shared = prompt_ids(args, group[0])  # once per group: the samples share the prompt
        for sample in group:
            sample.tokens = list(shared)

    async def one(sample: Sample) -> Sample:
        async with client.semaphore:
            result = await generate(args, sample, dict(params))
        progress.update(1)
        return result

    done = list(await asyncio.gather(*(one(sample) for sample in group)))
    await score_groups(args, [done])
    return done


async def _gather_or_cancel(coros: list[Awaitable[Any]]) -> list[Any]:
    """``gather`` that cancels the rest on the first error, so a failed rollout stops sending requests."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def generate_groups(
    args: argparse.Namespace,
    groups: list[list[Sample]],
    router_url: str,
    desc: str = "rollout",
    evaluation: bool = False,
) -> list[list[Sample]]:
    """Generates and scores ``groups`` through the router; returns them in the same order."""
    num_engines = max(1, (args.rollout_num_gpus or 1) // args.rollout_num_gpus_per_engine)
    client = RolloutClient(args, router_url, args.sglang_server_concurrency * num_engines)
    custom = args.custom_generate_function_path
    generate: GenerateFn = load_function(custom) if custom else client.generate
    if custom and not inspect.iscoroutinefunction(generate):
        raise TypeError(f"--custom-generate-function-path {custom} must be an async function")
    params = sampling_params(args, evaluation)
    total = sum(len(group) for group in groups)
    try:
        with tqdm(total=total, desc=desc, unit="sample", mininterval=1.0) as progress:
            return await _gather_or_cancel(
                [_generate_group(args, group, generate, client, params, progress) for group in groups]
            )
    finally:
        await client.close()


def generate_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: PromptDataSource, router_url: str
) -> list[list[Sample]]:
    """One rollout: ``--rollout-batch-size`` groups of ``--n-samples-per-prompt`` samples, scored."""
    groups = data_source.get_samples(args.rollout_batch_size)
    return asyncio.run(generate_groups(args, groups, router_url, desc=f"rollout {rollout_id}"))


def _eval_copy(prompt: Sample, group_index: int, index: int) -> Sample:
    sample = copy.deepcopy(prompt)
    sample.group_index, sample.index = group_index, index
    return sample


def eval_rollout(
    args: argparse.Namespace, rollout_id: int, datasets: dict[str, list[Sample]], router_url: str
) -> dict[str, float]:
    """Scores every evaluation set; per set the mean reward (``eval/<name>``), length and truncation.

    ``--n-samples-per-eval-prompt`` responses per prompt, sampled with the ``--eval-*`` settings.
    """
    n_per_prompt = args.n_samples_per_eval_prompt
    metrics: dict[str, float] = {}
    for name, prompts in datasets.items():
        groups = [
            [_eval_copy(prompt, i, i * n_per_prompt + k) for k in range(n_per_prompt)]
            for i, prompt in enumerate(prompts)
        ]
        desc = f"eval {name} @ rollout {rollout_id}"
        done = asyncio.run(generate_groups(args, groups, router_url, desc=desc, evaluation=True))
        samples = [sample for group in done for sample in group]
        n = len(samples)
        truncated = sum(s.status == Sample.Status.TRUNCATED for s in samples)
        metrics[f"eval/{name}"] = sum(s.reward_value(args.reward_key) for s in samples) / n
        metrics[f"eval/{name}/response_length"] = sum(s.response_length for s in samples) / n
        metrics[f"eval/{name}/truncated_ratio"] = truncated / n
    return metrics
