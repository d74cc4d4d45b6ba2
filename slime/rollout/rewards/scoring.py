"""Reward dispatch: the registry of built-in reward functions, custom ones by dotted path, and
``score_groups``, which scores a whole rollout concurrently.

Which function scores a sample, first match wins:

0. A reward the generate function already set on the sample (the usage guide's generate scores as it
   goes): kept, nothing else is called for that sample.
1. ``--custom-rm-path module.fn`` (or ``file.py:fn``): ``fn(args, sample) -> float | dict`` (async or
   sync); with ``--group-rm``, ``fn(args, samples) -> list[float | dict]`` once per prompt group, for
   rewards that compare the responses to one prompt (ranking, pairwise judges). Or the usage guide's
   reward-model class ``C(model_path)`` with ``compute_reward(prompts, responses) -> list``: built
   once per process (``model_path`` from ``--custom-rm-model-path``) and called once per prompt group
   (or per ``--rm-batch-size`` samples of it) with their prompts and responses, a sync method on a
   worker thread so that a model's
   forward pass does not stall the rollout's event loop.
2. ``sample.metadata["rm_type"]``: lets one dataset mix tasks (maths next to QA).
3. ``--rm-type``: a name in ``BUILTIN_REWARDS``.

A function may return a dict of several scores; ``--reward-key`` names the one that trains.

``RewardChoice`` carries the three reward flags; each evaluation set has its own (``--eval-config``),
the training rollout takes the flags'.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from slime.config.reward_types import BOXED_PREFIX
from slime.config.settings.rollout import RewardSettings
from slime.rollout.plugin_args import settings_of
from slime.rollout.rewards.errors import RewardError
from slime.rollout.rewards.math_answer import math_score
from slime.rollout.rewards.remote import remote_reward
from slime.rollout.rewards.text import exact_score, f1_score
from slime.rollout.rewards.upstream_rules import boxed_response, dapo_score, deepscaler_score, random_score
from slime.rollout.sample import Sample
from slime.utils.plugins import PluginError, load_function

logger = logging.getLogger(__name__)

RewardValue = float | dict[str, Any]
# Async or sync: reward functions that only compare strings need not be coroutines.
RewardFn = Callable[[argparse.Namespace, Sample], Awaitable[RewardValue] | RewardValue]
GroupRewardFn = Callable[[argparse.Namespace, list[Sample]], Awaitable[list[RewardValue]] | list[RewardValue]]


def _label(sample: Sample) -> str:
    if sample.label is None:
        raise RewardError(f"sample {sample.index} has no label; pass --label-key naming the answer field")
    return str(sample.label)


def _on_text(score: Callable[[str, str], RewardValue]) -> RewardFn:
    """A reward of the response and the label as a ``(args, sample)`` reward function."""
    return lambda args, sample: score(sample.response, _label(sample))


# The built-in reward functions by --rm-type name, in the order of ``BUILTIN_REWARD_TYPES``
# (``slime.config.reward_types``, which validation reads): adding one is one line here and one there.
# ``deepscaler``, ``dapo``, ``random`` and ``remote_rm`` are upstream slime's names (``upstream_rules``).
BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": _on_text(math_score),
    "exact": _on_text(exact_score),
    "f1": _on_text(f1_score),
    "remote": remote_reward,
    "remote_rm": remote_reward,
    "deepscaler": _on_text(deepscaler_score),
    "dapo": _on_text(dapo_score),
    "random": _on_text(random_score),
}


def load_reward_function(path: str) -> Callable[..., Any]:
    """The ``--custom-rm-path`` function (the plugin loader caches it: a rollout asks once per sample)."""
    try:
        return load_function(path)
    except PluginError as e:
        raise RewardError(f"--custom-rm-path {path!r} cannot be loaded ({e})") from e


@dataclass(frozen=True, kw_only=True)
class RewardChoice:
    """Which reward function scores: ``--custom-rm-path`` (per group with ``--group-rm``) or ``--rm-type``."""

    rm_type: str | None = None
    custom_rm_path: str | None = None
    group_rm: bool = False

    @classmethod
    def from_settings(cls, reward: RewardSettings) -> RewardChoice:
        """The reward flags' choice (training, and eval sets that name no reward of their own)."""
        return cls(rm_type=reward.rm_type, custom_rm_path=reward.custom_rm_path, group_rm=reward.group_rm)


def resolve_reward_fn(choice: RewardChoice, sample: Sample) -> RewardFn:
    """The per-sample reward function for ``sample`` (see the module docstring for the order)."""
    if choice.custom_rm_path is not None:
        return load_reward_function(choice.custom_rm_path)
    rm_type = sample.metadata.get("rm_type") or choice.rm_type
    if rm_type is None:
        raise RewardError(
            f"no reward function; pass --rm-type ({', '.join(BUILTIN_REWARDS)}) or --custom-rm-path"
        )
    base = rm_type.removeprefix(BOXED_PREFIX)
    if base not in BUILTIN_REWARDS:
        raise RewardError(
            f"unknown --rm-type {rm_type!r}; choose one of {', '.join(BUILTIN_REWARDS)} "
            f"(or {BOXED_PREFIX}<one of them>)"
        )
    if base == rm_type:
        return BUILTIN_REWARDS[rm_type]
    return functools.partial(_score_boxed, BUILTIN_REWARDS[base])


def _score_boxed(
    score: RewardFn, args: argparse.Namespace, sample: Sample
) -> Awaitable[RewardValue] | RewardValue:
    """``score`` of a copy of ``sample`` whose response is its last boxed answer (the sample keeps its
    response for training)."""
    boxed = copy.copy(sample)
    boxed.response = boxed_response(sample.response)
    return score(args, boxed)


@functools.cache
def reward_model(path: str, model_path: str | None) -> Any:
    """The ``--custom-rm-path`` class's instance of this process: a reward model loads weights once."""
    cls = load_reward_function(path)
    return cls() if model_path is None else cls(model_path)


async def _score_with_model(reward: RewardSettings, group: list[Sample], path: str) -> None:
    """One ``compute_reward(prompts, responses)`` call for ``group``; a wrong answer fails the group."""
    name = path.rpartition(":")[2] if ":" in path else path.rpartition(".")[2]
    try:
        model = reward_model(path, reward.custom_rm_model_path)
        prompts, responses = [s.prompt for s in group], [s.response for s in group]
        if inspect.iscoroutinefunction(model.compute_reward):
            rewards = await model.compute_reward(prompts, responses)
        else:
            rewards = await asyncio.to_thread(model.compute_reward, prompts, responses)
        bad = [r for r in _one_per_sample(rewards, group, f"{name}.compute_reward") if not _is_number(r)]
        if bad:
            raise RewardError(f"{name}.compute_reward returned {bad[0]!r}; expected a number per response")
        _assign(reward.reward_key, group, rewards)
    except Exception as e:
        _fail(group, e)


async def _call(fn: Callable[..., Any], *fn_args: Any) -> Any:
    result = fn(*fn_args)
    return await result if inspect.isawaitable(result) else result


async def compute_reward(args: argparse.Namespace, sample: Sample) -> RewardValue:
    """The reward of one sample by the reward flags, as its function returned it (a number or a dict)."""
    choice = RewardChoice.from_settings(settings_of(args, RewardSettings))
    reward: RewardValue = await _call(resolve_reward_fn(choice, sample), args, sample)
    return reward


def _checked(value: Any, reward_key: str | None, sample: Sample) -> RewardValue:
    """``value`` as a reward to store; raises unless it yields one finite number (via --reward-key)."""
    reward: RewardValue
    if isinstance(value, dict):
        reward = value
        number = Sample(index=sample.index, reward=value).reward_value(reward_key)
    elif isinstance(value, (int, float)):
        number = reward = float(value)
    else:
        raise RewardError(f"reward function returned {type(value).__name__}; expected a number or a dict")
    if not math.isfinite(number):
        raise RewardError(f"reward function returned {number} for sample {sample.index}")
    return reward


def _keep_preset(reward_key: str | None, sample: Sample) -> bool:
    """Whether ``sample`` already holds a reward (set by its generate function), checked and kept."""
    if sample.reward is None:
        return False
    try:
        sample.reward = _checked(sample.reward, reward_key, sample)
    except Exception as e:
        _fail([sample], e)
    return True


def _fail(samples: list[Sample], error: Exception) -> None:
    message = f"{type(error).__name__}: {error}"
    for sample in samples:
        sample.status = Sample.Status.FAILED
        sample.reward = 0.0
        sample.metadata["reward_error"] = message
    which = f"sample {samples[0].index}" if len(samples) == 1 else f"samples {[s.index for s in samples]}"
    logger.warning("reward of %s failed, scored 0.0: %s", which, message)


async def _score_sample(
    args: argparse.Namespace, reward_key: str | None, sample: Sample, fn: RewardFn
) -> None:
    try:
        sample.reward = _checked(await _call(fn, args, sample), reward_key, sample)
    except Exception as e:
        _fail([sample], e)


async def _score_raw(args: argparse.Namespace, sample: Sample, fn: RewardFn) -> None:
    """Upstream's ``--custom-reward-post-process-path`` form: the reward function's value is kept as it
    is (upstream's OPD keeps the teacher's whole reply) for the post-process function to read."""
    try:
        sample.reward = await _call(fn, args, sample)
    except Exception as e:
        _fail([sample], e)


async def _score_group(
    args: argparse.Namespace, reward_key: str | None, group: list[Sample], fn: GroupRewardFn
) -> None:
    try:
        rewards = _one_per_sample(await _call(fn, args, group), group, "group reward function")
        _assign(reward_key, group, rewards)
    except Exception as e:
        _fail(group, e)


def _one_per_sample(rewards: Any, group: list[Sample], source: str) -> list[RewardValue]:
    """``rewards`` when it is a list with one entry per sample of ``group``; else ``RewardError``."""
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(group):
        got = f"{len(rewards)} rewards" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        raise RewardError(f"{source} returned {got} for a group of {len(group)}")
    return list(rewards)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _assign(reward_key: str | None, group: list[Sample], rewards: list[RewardValue]) -> None:
    """Sets each sample's reward once every one of them checked out: a group is scored whole or not."""
    checked = [_checked(r, reward_key, s) for r, s in zip(rewards, group, strict=True)]
    for sample, reward in zip(group, checked, strict=True):
        sample.reward = reward


async def score_groups(
    args: argparse.Namespace,
    groups: list[list[Sample]],
    reward: RewardSettings,
    choice: RewardChoice | None = None,
) -> None:
    """Score every sample of ``groups`` concurrently, setting ``sample.reward`` in place.

    ``args`` go to the reward functions (plugins); ``reward``: the reward flags; ``choice``: the
    reward function to use (an eval set's); the reward flags' when None. A reward
    function that raises (or returns no usable number) fails only its own sample (its whole group
    with ``--group-rm``): status FAILED, reward 0.0 so that batch shapes stay intact,
    ``metadata["reward_error"]`` says why, and one warning names the sample index. The rollout decides
    whether to drop FAILED samples. A configuration problem (no or unknown --rm-type, an unloadable
    --custom-rm-path) raises ``RewardError`` before anything is scored. Samples whose generate
    function set a reward keep it and are left out of the calls (a group reward sees the rest).
    """
    choice = RewardChoice.from_settings(reward) if choice is None else choice
    key = reward.reward_key
    groups = [[s for s in group if not _keep_preset(key, s)] for group in groups]
    path = choice.custom_rm_path
    if path is not None and inspect.isclass(load_reward_function(path)):
        size = reward.rm_batch_size
        batches = (
            [group[i : i + size] for group in groups for i in range(0, len(group), size)] if size else groups
        )
        tasks = [_score_with_model(reward, batch, path) for batch in batches if batch]
    elif choice.group_rm:
        if choice.custom_rm_path is None:
            raise RewardError("--group-rm needs --custom-rm-path (a function scoring a whole group)")
        group_fn = load_reward_function(choice.custom_rm_path)
        tasks = [_score_group(args, key, group, group_fn) for group in groups if group]
    elif reward.custom_reward_post_process_path is not None:
        tasks = [_score_raw(args, s, resolve_reward_fn(choice, s)) for group in groups for s in group]
    else:
        tasks = [_score_sample(args, key, s, resolve_reward_fn(choice, s)) for group in groups for s in group]
    await asyncio.gather(*tasks)
