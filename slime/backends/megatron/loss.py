"""The loss a train step optimises, chosen by ``--loss-type``.

A loss function sees one micro-batch and the per-sample response log-probs (and entropy) the model
produced for it, and returns its share of the global loss plus metric shares aggregated the same
way (so that summing over micro-batches and data-parallel ranks gives global values).

``--loss-type custom_loss --custom-loss-function-path module.fn`` plugs in
``fn(args, batch, log_probs, entropy) -> (loss, metrics)``, loaded once per trainer actor:

* ``batch`` is a :class:`~slime.backends.megatron.batching.MicroBatch`; ``batch.per_sample(key, device)``
  gives one tensor per sample for ``loss_masks``, ``advantages``, ``old_log_probs``, ``ref_log_probs``
  (with ``--use-kl-loss`` or ``--kl-coef``), ``rollout_log_probs`` (when the rollout has them), ``rewards``;
  ``batch.samples["loss_weights"]`` are the per-sample aggregation weights.
* ``log_probs`` / ``entropy``: one 1-D tensor per sample over its response tokens (``entropy`` may be None).
* ``loss`` (a scalar tensor with grad) and every ``metrics`` value (scalar tensors) must be this
  micro-batch's *share* of the global aggregate, i.e. built with
  ``slime.algorithms.aggregation.weighted_token_sum(values, masks, batch.samples["loss_weights"])``,
  so that summing over micro-batches and data-parallel ranks gives the global value under
  ``--loss-agg-mode``. See ``examples/custom_loss/custom_loss.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from slime.algorithms.aggregation import weighted_token_sum
from slime.algorithms.kl import kl_estimate
from slime.algorithms.losses import (
    cispo_loss,
    clipped_value_loss,
    gspo_loss,
    ppo_clip_loss,
    sft_loss,
    truncated_is_weights,
)
from slime.algorithms.mismatch import ROLLOUT_LOGPROB_COVERAGE, masked_is_weights, mismatch_token_metrics
from slime.backends.megatron.batching import MicroBatch

LossFn = Callable[[MicroBatch, list[torch.Tensor], list[torch.Tensor] | None], tuple[torch.Tensor, dict]]


def needs_reference(args: argparse.Namespace) -> bool:
    """A frozen reference policy is kept whenever KL is used: as a loss or as reward shaping."""
    return args.loss_type != "value_loss" and (args.use_kl_loss or args.kl_coef != 0.0)


def with_entropy_bonus(
    loss: torch.Tensor,
    metrics: dict,
    entropy: list[torch.Tensor] | None,
    masks: list[torch.Tensor],
    weights: list[float],
    coef: float,
) -> torch.Tensor:
    """Logs the aggregated entropy as ``metrics["entropy"]`` and subtracts ``coef`` × it from the loss
    (an exploration bonus; ``coef`` 0 only logs). Every loss function shares this one definition."""
    if entropy is None:
        return loss
    entropy_mean = weighted_token_sum(entropy, masks, weights)
    metrics["entropy"] = entropy_mean.detach()
    return loss - coef * entropy_mean if coef else loss


def sft_loss_fn(batch: MicroBatch, log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None):
    device = log_probs[0].device
    masks = batch.per_sample("loss_masks", device)
    weights = batch.samples["loss_weights"]
    metrics: dict = {}
    loss = with_entropy_bonus(sft_loss(log_probs, masks, weights), metrics, entropy, masks, weights, 0.0)
    return loss, metrics


def policy_token_losses(args: argparse.Namespace) -> Callable[..., tuple]:
    """The per-sample policy loss of ``--advantage-estimator``: ``(log_probs, old, advantages, mask)``
    to ``(loss, clipped, approx_kl)`` per token (``slime.algorithms.losses``)."""
    low, high, dual = args.eps_clip, args.eps_clip_high, args.eps_clip_c
    if args.advantage_estimator == "gspo":
        return lambda lp, old, adv, mask: gspo_loss(lp, old, adv, mask, low, high, dual)
    if args.advantage_estimator == "cispo":
        return lambda lp, old, adv, mask: cispo_loss(lp, old, adv, low, high)
    return lambda lp, old, adv, mask: ppo_clip_loss(lp, old, adv, low, high, dual)


def rollout_log_probs_of(
    batch: MicroBatch, device: torch.device
) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """The engine's log-probs per sample and 1.0 where they are known (None, None when the rollout has
    none). A train-data dump from before ``rollout_log_prob_masks`` existed counts as all known."""
    if "rollout_log_probs" not in batch.samples:
        return None, None
    rollout = batch.per_sample("rollout_log_probs", device)
    if "rollout_log_prob_masks" not in batch.samples:
        return rollout, [torch.ones_like(r) for r in rollout]
    return rollout, batch.per_sample("rollout_log_prob_masks", device)


def only_known(
    weights_and_flags: tuple[torch.Tensor, torch.Tensor], known: torch.Tensor, unknown_flag: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weight 1 and ``unknown_flag`` (TIS: 0, not clipped; MIS: 1, kept) where the
    engine's log-prob is unknown: a response built without them is trained as on-policy, not with a
    ratio against a placeholder."""
    weights, flags = weights_and_flags
    return torch.where(known > 0, weights, 1.0), torch.where(known > 0, flags, unknown_flag)


def make_policy_loss_fn(args: argparse.Namespace) -> LossFn:
    """Clipped policy loss (PPO / dual-clip PPO, GSPO or CISPO by ``--advantage-estimator``) with optional
    truncated or masked importance sampling, KL-to-reference and entropy terms. Needs per-sample
    ``advantages`` and ``old_log_probs``; ``ref_log_probs`` with ``--use-kl-loss``; ``rollout_log_probs``
    (the engine's) with ``--use-tis`` / ``--use-mis``, and otherwise only for the mismatch metrics."""
    token_losses = policy_token_losses(args)

    def policy_loss_fn(batch: MicroBatch, log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None):
        device = log_probs[0].device
        masks = batch.per_sample("loss_masks", device)
        weights = batch.samples["loss_weights"]
        advantages = batch.per_sample("advantages", device)
        old = batch.per_sample("old_log_probs", device)
        parts = [
            token_losses(lp, o, a, m) for lp, o, a, m in zip(log_probs, old, advantages, masks, strict=True)
        ]
        token_loss = [p[0] for p in parts]
        metrics = {}
        rollout, known = rollout_log_probs_of(batch, device)
        if (args.use_tis or args.use_mis) and rollout is None:
            flag = "--use-tis" if args.use_tis else "--use-mis"
            raise KeyError(f"{flag} needs the engine's rollout_log_probs in the train data")
        if args.use_tis:
            tis = [
                only_known(truncated_is_weights(o, r, args.tis_clip_low, args.tis_clip), k, 0.0)
                for o, r, k in zip(old, rollout, known, strict=True)
            ]
            token_loss = [loss * w for loss, (w, _) in zip(token_loss, tis, strict=True)]
            metrics["tis"] = weighted_token_sum([w for w, _ in tis], masks, weights)
            metrics["tis_clipfrac"] = weighted_token_sum([c for _, c in tis], masks, weights)
        if args.use_mis:
            mis = [
                only_known(
                    masked_is_weights(o, r, m, args.mis_level, args.mis_lower_bound, args.mis_upper_bound),
                    k,
                    1.0,
                )
                for o, r, m, k in zip(old, rollout, masks, known, strict=True)
            ]
            token_loss = [loss * w for loss, (w, _) in zip(token_loss, mis, strict=True)]
            metrics["mis"] = weighted_token_sum([w for w, _ in mis], masks, weights)
            metrics["mis_masked_frac"] = weighted_token_sum([1.0 - k for _, k in mis], masks, weights)
        pg_loss = weighted_token_sum(token_loss, masks, weights)
        metrics.update(
            pg_loss=pg_loss.detach(),
            pg_clipfrac=weighted_token_sum([p[1] for p in parts], masks, weights),
            ppo_kl=weighted_token_sum([p[2] for p in parts], masks, weights),
        )
        loss = with_entropy_bonus(pg_loss, metrics, entropy, masks, weights, args.entropy_coef)
        if args.use_kl_loss:
            ref = batch.per_sample("ref_log_probs", device)
            kl = [kl_estimate(lp, r, args.kl_loss_type) for lp, r in zip(log_probs, ref, strict=True)]
            kl_loss = weighted_token_sum(kl, masks, weights)
            metrics["kl_loss"] = kl_loss.detach()
            loss = loss + args.kl_loss_coef * kl_loss
        if rollout is not None:
            scored = [m * k for m, k in zip(masks, known, strict=True)]
            metrics[ROLLOUT_LOGPROB_COVERAGE] = weighted_token_sum(known, masks, weights)
            per_token = [
                mismatch_token_metrics(lp, r, args.tis_clip_low, args.tis_clip)
                for lp, r in zip(log_probs, rollout, strict=True)
            ]
            for key in per_token[0] if per_token else ():
                metrics[key] = weighted_token_sum([t[key] for t in per_token], scored, weights)
        return loss, metrics

    return policy_loss_fn


def make_value_loss_fn(args: argparse.Namespace) -> LossFn:
    """The critic's loss (``--advantage-estimator ppo``): clipped value loss against the GAE returns.

    ``log_probs`` are the value head's per-token values here (the critic runs the same forward with a
    scalar head). Needs per-sample ``values`` (the critic's values at rollout time, for the clip) and
    ``returns``; metrics ``value_loss``, ``value_clipfrac``, ``values_mean``, ``returns_mean``.
    """

    def value_loss_fn(batch: MicroBatch, values: list[torch.Tensor], _entropy: list[torch.Tensor] | None):
        device = values[0].device
        masks = batch.per_sample("loss_masks", device)
        weights = batch.samples["loss_weights"]
        old = batch.per_sample("values", device)
        returns = batch.per_sample("returns", device)
        parts = [
            clipped_value_loss(v, o, r, args.value_clip) for v, o, r in zip(values, old, returns, strict=True)
        ]
        loss = weighted_token_sum([p[0] for p in parts], masks, weights)
        metrics = {
            "value_loss": loss.detach(),
            "value_clipfrac": weighted_token_sum([p[1] for p in parts], masks, weights),
            "values_mean": weighted_token_sum([v.detach() for v in values], masks, weights),
            "returns_mean": weighted_token_sum(returns, masks, weights),
        }
        return loss, metrics

    return value_loss_fn


def make_custom_loss_fn(args: argparse.Namespace) -> LossFn:
    """``--custom-loss-function-path`` bound to ``args`` (see the module docstring for the contract)."""
    from slime.utils.plugins import load_function

    fn = load_function(args.custom_loss_function_path)

    def custom_loss_fn(batch: MicroBatch, log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None):
        return fn(args, batch, log_probs, entropy)

    return custom_loss_fn


def build_loss_fn(args: argparse.Namespace) -> LossFn:
    if args.loss_type == "custom_loss":
        return make_custom_loss_fn(args)
    if args.loss_type == "value_loss":  # set on the critic's copy of the arguments only
        return make_value_loss_fn(args)
    losses = {"sft_loss": sft_loss_fn, "policy_loss": make_policy_loss_fn(args)}
    try:
        return losses[args.loss_type]
    except KeyError:
        raise ValueError(
            f"--loss-type {args.loss_type!r} is not available; choose one of {sorted(losses)}"
        ) from None
