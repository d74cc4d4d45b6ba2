"""A custom policy loss and a custom advantage function for ``train.py``.

Use them with (from the repository root, so that ``examples`` is importable)::

    --loss-type custom_loss \\
    --custom-loss-function-path examples.custom_loss.custom_loss.reinforce_loss \\
    --custom-advantage-function-path examples.custom_loss.custom_loss.length_penalized_advantages

Both are loaded once per trainer actor.

``reinforce_loss(args, batch, log_probs, entropy) -> (loss, metrics)`` is called once per micro-batch:

* ``batch`` is a ``slime.backends.megatron.batching.MicroBatch``. ``batch.per_sample(key, device)``
  gives one tensor per sample of a per-sample key: ``loss_masks``, ``advantages`` (from the advantage
  function), ``old_log_probs`` (the policy before this rollout's first step), ``ref_log_probs`` (with
  ``--use-kl-loss``), ``rollout_log_probs`` (when the engine returned them). ``batch.samples`` holds the
  raw lists, including ``loss_weights``.
* ``log_probs`` and ``entropy`` (``None`` when not computed) are one 1-D tensor per sample over its
  response tokens, with gradient.
* ``loss`` (a scalar tensor) and each ``metrics`` value (scalar tensors) must be this micro-batch's
  *share* of the global aggregate: build them with ``weighted_token_sum(values, masks,
  batch.samples["loss_weights"])`` so that the trainer's sum over micro-batches and data-parallel
  ranks gives the global value (averaged as ``--loss-agg-mode`` says). The trainer adds ``loss`` and
  ``grad_norm`` to the step metrics; the ones returned here appear under their own names.

``length_penalized_advantages(args, data) -> list[list[float]]`` is called once per rollout on the
whole rollout, before it is split into steps and data-parallel shards. ``data`` is a dict of
per-sample lists (``tokens``, ``response_lengths``, ``loss_masks``, ``rewards``, ``raw_rewards``,
``sample_indices``, and ``rollout_log_probs`` when present); samples of one prompt are
``--n-samples-per-prompt`` consecutive entries. It returns one float per response token of every
sample (``len(loss_masks[i])`` of them), used instead of ``--advantage-estimator``.
"""

from __future__ import annotations

import argparse

import torch

from slime.algorithms.advantages import group_normalized_rewards
from slime.algorithms.aggregation import weighted_token_sum
from slime.backends.megatron.batching import MicroBatch
from slime.backends.megatron.loss import with_entropy_bonus

LENGTH_PENALTY = 0.01
"""Reward subtracted per response token, so that among equally correct answers shorter ones win."""


def length_penalized_advantages(args: argparse.Namespace, data: dict[str, list]) -> list[list[float]]:
    """REINFORCE with a group-mean baseline on a length-penalised reward.

    ``r'_i = r_i - LENGTH_PENALTY * n_i`` (``n_i`` the sample's response length), ``A_i = r'_i - mean of
    r'`` over the sample's prompt group, broadcast to every response token. The groups are the
    rollout's (``data["prompt_groups"]``; blocks of ``--n-samples-per-prompt`` in data without them).
    """
    shaped = torch.tensor(
        [
            float(r) - LENGTH_PENALTY * n
            for r, n in zip(data["rewards"], data["response_lengths"], strict=True)
        ]
    )
    groups = data.get("prompt_groups") or args.n_samples_per_prompt
    advantages = group_normalized_rewards(shaped, groups, normalize_std=False).tolist()
    return [[a] * len(mask) for a, mask in zip(advantages, data["loss_masks"], strict=True)]


def reinforce_loss(
    args: argparse.Namespace,
    batch: MicroBatch,
    log_probs: list[torch.Tensor],
    entropy: list[torch.Tensor] | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Vanilla REINFORCE, ``-A_t * log pi(y_t)``, aggregated by ``--loss-agg-mode``, minus
    ``--entropy-coef`` times the entropy. No ratio and no clipping: meant for one step per rollout."""
    device = log_probs[0].device
    masks = batch.per_sample("loss_masks", device)
    weights = batch.samples["loss_weights"]
    advantages = batch.per_sample("advantages", device)
    pg_loss = weighted_token_sum(
        [-a * lp for a, lp in zip(advantages, log_probs, strict=True)], masks, weights
    )
    metrics = {
        "reinforce_pg_loss": pg_loss.detach(),
        "advantage_mean": weighted_token_sum(advantages, masks, weights),
    }
    loss = with_entropy_bonus(pg_loss, metrics, entropy, masks, weights, args.entropy_coef)
    return loss, metrics
