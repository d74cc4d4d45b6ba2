"""A rollout's scored sample groups as the trainer takes them, and the metrics a rollout logs.

``TrainData`` is the one shape of what leaves the rollout side for the trainer (``samples_to_train_data``
builds it); a ``RolloutBatch`` is one rollout's train data with the metrics the rollout measured, as
the rollout manager hands it to the driver's loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from slime.config.settings.rollout import RolloutSettings
from slime.rollout.errors import RolloutError
from slime.rollout.sample import Sample, routes_array

TrainData = dict[str, list[Any]]
"""Per-sample lists, all of one length, in group order: the keys ``samples_to_train_data`` fills, then
the trainer's own (``loss_weights``, ``advantages``, ``old_log_probs``, the critic's ``values`` and
``returns``, ...; see ``slime.backends.megatron.batching``). Plain lists, so it crosses Ray as it is."""


@dataclass
class RolloutBatch:
    """One rollout: what the trainer trains on and what the loop logs of it (``rollout/*``, ``perf/*``).

    The driver's loop adds its timings (``perf/rollout_time``, ...) to ``metrics``; only ``data`` goes
    on to the trainer."""

    data: TrainData
    metrics: dict[str, float]


def samples_to_train_data(
    groups: list[list[Sample]],
    reward_key: str | None = None,
    routing_replay: bool = False,
    distillation: bool = False,
) -> TrainData:
    """The trainer's per-sample lists from scored sample groups, in group order.

    ``rewards`` is the scalar that trains (``--reward-key`` picks it from a dict); ``raw_rewards`` is
    what the reward function returned (a number or a dict), kept for logging; ``weight_versions`` are
    the engine weight versions each sample was generated with (the loops log staleness from them).
    ``prompt_groups`` numbers each sample's group in ``groups``: group-relative advantages normalise
    over it, not over blocks of ``--n-samples-per-prompt`` (a generate function may return several
    samples per prompt, so groups can be larger). ``rollout_log_prob_masks`` are 0 for a response
    without engine log-probs (built by hand, or text tokenized after the fact): TIS, MIS and the
    mismatch metrics leave its tokens out. A
    FAILED sample (its reward could not be computed) keeps its place, so group shapes hold, but its
    loss mask is all zeros and ``valid_rewards`` is False: nothing is learned from a reward that does
    not exist, and its placeholder 0.0 stays out of its group's mean and std. A sample a plugin marked
    ``remove_sample`` (upstream slime's field) keeps its place and reward but its loss mask is zeros.
    ``multimodal_train_inputs`` (present when a sample has images) are the processor's tensors, which
    the trainer feeds to the vision tower; they are made once, on the rollout side.
    ``rollout_routed_experts`` (with ``routing_replay``, or when a generate function set them) are
    each sample's routed experts (``_routed_experts``); ``teacher_log_probs`` (with ``distillation``,
    ``--use-opd``, or when a plugin set them) the teacher's (``_teacher_log_probs``).
    """
    samples = [sample for group in groups for sample in group]
    prompt_groups = [number for number, group in enumerate(groups) for _ in group]
    # Rollouts that sample nothing (SFT) have no engine log-probs: then the keys are left out, so
    # that a present key always means one log-prob per response token.
    with_log_probs = any(sample.rollout_log_probs is not None for sample in samples)
    keys = ["tokens", "response_lengths", "loss_masks", "rewards", "raw_rewards", "sample_indices"]
    keys += ["weight_versions", "valid_rewards", "prompt_groups"]
    if with_log_probs:
        keys += ["rollout_log_probs", "rollout_log_prob_masks"]
    with_teacher = distillation or any(sample.teacher_log_probs is not None for sample in samples)
    if with_teacher:  # --use-opd: the teacher's log-probs of each response token
        keys.append("teacher_log_probs")
    # Images: the processor's tensors of each sample (None for a text sample), only when there are any.
    with_images = any(sample.multimodal_train_inputs is not None for sample in samples)
    if with_images:
        keys.append("multimodal_train_inputs")
    with_routes = routing_replay or any(sample.rollout_routed_experts is not None for sample in samples)
    if with_routes:
        keys.append("rollout_routed_experts")
    data: TrainData = {key: [] for key in keys}
    route_shape = _route_shape(samples) if with_routes else None
    for position, (sample, prompt_group) in enumerate(zip(samples, prompt_groups, strict=True)):
        n = sample.response_length
        mask = list(sample.loss_mask) if sample.loss_mask is not None else [1] * n
        log_probs = sample.rollout_log_probs
        if len(mask) != n or (log_probs is not None and len(log_probs) != n) or len(sample.tokens) <= n:
            raise ValueError(
                f"sample {sample.index} is inconsistent: {len(sample.tokens)} tokens, response_length {n}, "
                f"{len(mask)} loss-mask entries, "
                f"{None if log_probs is None else len(log_probs)} rollout log-probs "
                "(the generate function must fill all of them for the response)"
            )
        if (
            sample.status == Sample.Status.FAILED or sample.remove_sample
        ):  # upstream's flag: keep, do not train
            mask = [0] * n
        data["tokens"].append(list(sample.tokens))
        data["response_lengths"].append(n)
        data["loss_masks"].append(mask)
        data["rewards"].append(sample.reward_value(reward_key))
        data["raw_rewards"].append(sample.reward)
        data["sample_indices"].append(sample.index)
        data["weight_versions"].append(list(sample.weight_versions))
        data["valid_rewards"].append(sample.status != Sample.Status.FAILED)
        data["prompt_groups"].append(prompt_group)
        if with_log_probs:
            known = log_probs is not None
            data["rollout_log_probs"].append(list(log_probs) if log_probs is not None else [0.0] * n)
            data["rollout_log_prob_masks"].append([int(known)] * n)
        if with_images:
            data["multimodal_train_inputs"].append(sample.multimodal_train_inputs)
        if with_teacher:
            data["teacher_log_probs"].append(_teacher_log_probs(sample))
        if with_routes:
            data["rollout_routed_experts"].append(_routed_experts(sample, position, route_shape))
    return data


def _route_shape(samples: list[Sample]) -> tuple[int, ...] | None:
    """``(layers, topk)`` of the rollout's routed experts (None when no sample has any)."""
    for sample in samples:
        routes = routes_array(sample.rollout_routed_experts)
        if routes is not None:
            return routes.shape[1:]
    return None


def _routed_experts(sample: Sample, position: int, shape: tuple[int, ...] | None) -> np.ndarray:
    """The sample's routed experts, int32 ``[len(tokens) - 1, layers, topk]`` (``Sample``'s field in
    any form it accepts, upstream's torch tensor included). A FAILED sample (never trained, maybe a
    two-token stub) gets rows of experts ``0 .. topk - 1``, distinct ids the trainer can replay."""
    routes = routes_array(sample.rollout_routed_experts)
    rows = len(sample.tokens) - 1
    complete = routes is not None and len(routes) == rows
    if not complete and sample.status == Sample.Status.FAILED and shape is not None:
        placeholder = np.empty((rows, *shape), dtype=np.int32)
        placeholder[...] = np.arange(shape[1], dtype=np.int32)
        return placeholder
    if routes is None or not complete:
        held = "no rows" if routes is None else f"{len(routes)} rows"
        raise RolloutError(
            f"--use-rollout-routing-replay: sample {position} (index {sample.index}) has {held} of routed "
            f"experts for its {len(sample.tokens)} tokens (one row per token but the last); its generate "
            "function must request them (slime.rollout.generate_utils.generate_turns does; a custom one "
            "sends return_routed_experts and sets sample.rollout_routed_experts)"
        )
    return routes


def _teacher_log_probs(sample: Sample) -> list[float]:
    """One teacher log-prob per response token (a failed sample, never trained on, may have none)."""
    teacher = sample.teacher_log_probs
    if teacher is None and (sample.status == Sample.Status.FAILED or sample.remove_sample):
        return [0.0] * sample.response_length
    if teacher is None or len(teacher) != sample.response_length:
        raise RolloutError(
            f"--use-opd: sample {sample.index} has {'no' if teacher is None else len(teacher)} teacher "
            f"log-probs for its {sample.response_length} response tokens; pass --opd-teacher-hf-checkpoint "
            "or --opd-teacher-urls, or a --custom-reward-post-process-path that sets "
            "sample.teacher_log_probs, one per response token"
        )
    return [float(value) for value in teacher]


def apply_reward_post_process(
    path: str, args: Any, groups: list[list[Sample]]
) -> tuple[list[float], list[float]]:
    """Upstream's ``--custom-reward-post-process-path`` ``fn(args, samples) -> (raw_rewards, rewards)``
    over the rollout's samples in group order; checks one number of each per sample."""
    from slime.utils.plugins import load_function

    samples = [sample for group in groups for sample in group]
    result = load_function(path)(args, samples)
    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise RolloutError(f"{path} returned {type(result).__name__}; expected (raw_rewards, rewards)")
    raw, rewards = ([float(value) for value in part] for part in result)
    if len(raw) != len(samples) or len(rewards) != len(samples):
        raise RolloutError(
            f"{path} returned {len(raw)} raw rewards and {len(rewards)} rewards for {len(samples)} samples"
        )
    return raw, rewards


def require_rollout_log_probs(rollout: RolloutSettings, groups: list[list[Sample]]) -> None:
    """``--use-rollout-logprobs`` takes the engine's log-probs as the old policy's: a trained sample
    without them (its response built by hand or from text) would be trained against placeholders."""
    samples = [sample for group in groups for sample in group]
    missing = [s.index for s in samples if s.rollout_log_probs is None and s.response_length]
    if rollout.use_rollout_logprobs and missing:
        raise RolloutError(
            f"--use-rollout-logprobs: {len(missing)} samples have no engine log-probs (e.g. sample "
            f"{missing[0]}; --custom-generate-function-path {rollout.custom_generate_function_path} built "
            "its response without slime.rollout.generate_utils.append_model_turn); drop the flag to "
            "recompute the old log-probs in the trainer"
        )


def rollout_metrics(
    groups: list[list[Sample]], seconds: float, reward_key: str | None = None
) -> dict[str, float]:
    """What a rollout log line shows: lengths, how responses ended, speed, mean reward."""
    samples = [sample for group in groups for sample in group]
    n = max(len(samples), 1)
    tokens = sum(sample.response_length for sample in samples)

    def ratio(status: Sample.Status) -> float:
        return sum(sample.status == status for sample in samples) / n

    return {
        "rollout/num_samples": float(len(samples)),
        "rollout/response_length": tokens / n,
        "rollout/truncated_ratio": ratio(Sample.Status.TRUNCATED),
        "rollout/aborted_ratio": ratio(Sample.Status.ABORTED),
        "rollout/failed_ratio": ratio(Sample.Status.FAILED),
        "rollout/context_capped_samples": float(sum(bool(s.metadata.get("context_capped")) for s in samples)),
        "perf/generation_time": seconds,
        "perf/tokens_per_sec": tokens / seconds if seconds > 0 else 0.0,
        "rollout/raw_reward": sum(s.reward_value(reward_key) for s in samples) / n,
    }
