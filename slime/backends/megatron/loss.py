"""The loss a train step optimises, chosen by ``--loss-type``.

A loss function sees one micro-batch and the per-sample response log-probs (and entropy) the model
produced for it, and returns its share of the global loss plus metric shares aggregated the same
way (so that summing over micro-batches and data-parallel ranks gives global values).

``--loss-type custom_loss --custom-loss-function-path module.fn`` plugs in
``fn(args, batch, log_probs, entropy) -> (loss, metrics)`` (``args``: the run's namespace), loaded once
per trainer actor:

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
import dataclasses
from collections.abc import Callable

import torch

from slime.algorithms.advantages import TOKEN_LEVEL_ESTIMATORS
from slime.algorithms.aggregation import FlatTokens, weighted_token_sum
from slime.algorithms.distillation import reverse_kl_per_token
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
from slime.config.settings.trainer import LossSettings, TrainerSettings

LossFn = Callable[[MicroBatch, list[torch.Tensor], list[torch.Tensor] | None], tuple[torch.Tensor, dict]]


def old_log_probs_are_current(settings: TrainerSettings) -> bool:
    """Whether the old policy's log-probs are exactly the training forward's, detached, so the separate
    old-logprob forward can be skipped (as TRL does with one iteration).

    That holds when the weights the old pass would run with are the ones the (only) optimizer step of
    the rollout trains from and the two forwards compute the same function: one step per rollout, no
    dropout (the old pass runs in eval mode), and nothing else needs the old log-probs before the
    loss: a KL reference (kept in the same pass), token-level estimators and KL-shaped rewards (they
    build advantages from them), a custom loss (it may read them), or the engine's log-probs standing
    in for them (``--use-rollout-logprobs``), or on-policy distillation (the teacher's reverse KL shapes
    the advantages), or R2 routing replay (``--use-routing-replay`` records the routes training
    replays in that pass). ``--force-old-logprob-pass`` keeps the pass.
    """
    loss = settings.loss
    return (
        not loss.force_old_logprob_pass
        and loss.loss_type == "policy_loss"
        and not loss.use_rollout_logprobs
        and settings.batch.num_steps_per_rollout == 1
        and settings.model.hidden_dropout == 0.0
        and settings.model.attention_dropout == 0.0
        and not loss.needs_reference
        and loss.custom_advantage_function_path is None
        and loss.advantage_estimator not in TOKEN_LEVEL_ESTIMATORS
        and not loss.use_opd
        and not (loss.use_routing_replay and not loss.use_rollout_routing_replay)
    )


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
    return _entropy_bonus(loss, metrics, weighted_token_sum(entropy, masks, weights), coef)


def _entropy_bonus(
    loss: torch.Tensor, metrics: dict, entropy_mean: torch.Tensor, coef: float
) -> torch.Tensor:
    metrics["entropy"] = entropy_mean.detach()
    return loss - coef * entropy_mean if coef else loss


def sft_loss_fn(batch: MicroBatch, log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None):
    tokens = FlatTokens.of(batch.per_sample("loss_masks", log_probs[0].device), batch.samples["loss_weights"])
    metrics: dict = {}
    loss = sft_loss(torch.cat(log_probs), tokens)
    if entropy is not None:
        loss = _entropy_bonus(loss, metrics, tokens.aggregate(torch.cat(entropy)), 0.0)
    return loss, metrics


def policy_token_losses(loss: LossSettings) -> Callable[..., tuple]:
    """The policy loss of ``--advantage-estimator`` over the flat tokens of a micro-batch:
    ``(log_probs, old, advantages, tokens)`` to ``(loss, clipped, approx_kl)`` per token
    (``slime.algorithms.losses``)."""
    low, high, dual = loss.eps_clip, loss.eps_clip_high, loss.eps_clip_c
    if loss.advantage_estimator == "gspo":
        return lambda lp, old, adv, tokens: gspo_loss(lp, old, adv, tokens.mask, low, high, dual, tokens)
    if loss.advantage_estimator == "cispo":
        return lambda lp, old, adv, tokens: cispo_loss(lp, old, adv, low, high)
    return lambda lp, old, adv, tokens: ppo_clip_loss(lp, old, adv, low, high, dual)


def flat_samples(batch: MicroBatch, key: str, device: torch.device) -> torch.Tensor:
    """A per-sample key of the micro-batch as one flat per-token tensor (float32); lists of numbers
    (the rollout's) become one tensor at once instead of one per sample and a concatenation."""
    values = batch.samples[key]
    if all(isinstance(value, list) for value in values):
        return torch.tensor([x for value in values for x in value], dtype=torch.float32, device=device)
    return torch.cat(batch.per_sample(key, device))


def rollout_log_probs_of(
    batch: MicroBatch, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The engine's log-probs (flat, per token) and 1.0 where they are known (None, None when the
    rollout has none). A train-data dump from before ``rollout_log_prob_masks`` existed counts as all
    known."""
    if "rollout_log_probs" not in batch.samples:
        return None, None
    rollout = flat_samples(batch, "rollout_log_probs", device)
    if "rollout_log_prob_masks" not in batch.samples:
        return rollout, torch.ones_like(rollout)
    return rollout, flat_samples(batch, "rollout_log_prob_masks", device)


def only_known(
    weights_and_flags: tuple[torch.Tensor, torch.Tensor], known: torch.Tensor, unknown_flag: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weight 1 and ``unknown_flag`` (TIS: 0, not clipped; MIS: 1, kept) where the
    engine's log-prob is unknown: a response built without them is trained as on-policy, not with a
    ratio against a placeholder."""
    weights, flags = weights_and_flags
    return torch.where(known > 0, weights, 1.0), torch.where(known > 0, flags, unknown_flag)


def make_policy_loss_fn(settings: TrainerSettings) -> LossFn:
    """Clipped policy loss (PPO / dual-clip PPO, GSPO or CISPO by ``--advantage-estimator``) with optional
    truncated or masked importance sampling, KL-to-reference and entropy terms. Needs per-sample
    ``advantages`` and ``old_log_probs`` (unless ``old_log_probs_are_current``); ``ref_log_probs``
    with ``--use-kl-loss``; ``rollout_log_probs`` (the engine's) with ``--use-tis`` / ``--use-mis``,
    and otherwise only for the mismatch metrics. Computed over the micro-batch's tokens as one flat
    vector (``FlatTokens``)."""
    opts = settings.loss
    token_losses = policy_token_losses(opts)
    old_is_current = old_log_probs_are_current(settings)

    def policy_loss_fn(batch: MicroBatch, log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None):
        device = log_probs[0].device
        tokens = FlatTokens.of(batch.per_sample("loss_masks", device), batch.samples["loss_weights"])
        current = torch.cat(log_probs)
        advantages = flat_samples(batch, "advantages", device)
        old = current.detach() if old_is_current else flat_samples(batch, "old_log_probs", device)
        token_loss, clipped, approx_kl = token_losses(current, old, advantages, tokens)
        metrics = {}
        rollout, known = rollout_log_probs_of(batch, device)
        if (opts.use_tis or opts.use_mis) and rollout is None:
            flag = "--use-tis" if opts.use_tis else "--use-mis"
            raise KeyError(f"{flag} needs the engine's rollout_log_probs in the train data")
        if opts.use_tis:
            assert rollout is not None and known is not None  # raised above otherwise
            tis, tis_clipped = only_known(
                truncated_is_weights(old, rollout, opts.tis_clip_low, opts.tis_clip), known, 0.0
            )
            token_loss = token_loss * tis
            metrics["tis"] = tokens.aggregate(tis)
            metrics["tis_clipfrac"] = tokens.aggregate(tis_clipped)
        if opts.use_mis:
            assert rollout is not None and known is not None  # raised above otherwise
            low = opts.mis_lower_bound
            assert low is not None  # --use-mis: derived from --mis-upper-bound when not given
            weights = masked_is_weights(
                old, rollout, tokens.mask, opts.mis_level, low, opts.mis_upper_bound, tokens
            )
            mis, kept = only_known(weights, known, 1.0)
            token_loss = token_loss * mis
            metrics["mis"] = tokens.aggregate(mis)
            metrics["mis_masked_frac"] = tokens.aggregate(1.0 - kept)
        pg_loss = tokens.aggregate(token_loss)
        metrics.update(
            pg_loss=pg_loss.detach(),
            pg_clipfrac=tokens.aggregate(clipped),
            ppo_kl=tokens.aggregate(approx_kl),
        )
        loss = pg_loss
        if entropy is not None:
            loss = _entropy_bonus(loss, metrics, tokens.aggregate(torch.cat(entropy)), opts.entropy_coef)
        if opts.use_kl_loss:
            ref = flat_samples(batch, "ref_log_probs", device)
            kl_loss = tokens.aggregate(kl_estimate(current, ref, opts.kl_loss_type))
            metrics["kl_loss"] = kl_loss.detach()
            loss = loss + opts.kl_loss_coef * kl_loss
        if "teacher_log_probs" in batch.samples:
            teacher = flat_samples(batch, "teacher_log_probs", device)
            metrics["opd/reverse_kl"] = tokens.aggregate(reverse_kl_per_token(old, teacher))
            metrics["opd/teacher_logprob"] = tokens.aggregate(teacher)
        if rollout is not None:
            assert known is not None  # given with the rollout's log-probs
            metrics[ROLLOUT_LOGPROB_COVERAGE] = tokens.aggregate(known)
            scored = dataclasses.replace(tokens, mask=tokens.mask * known)
            per_token = mismatch_token_metrics(current, rollout, opts.tis_clip_low, opts.tis_clip)
            metrics.update({key: scored.aggregate(value) for key, value in per_token.items()})
        return loss, metrics

    return policy_loss_fn


def make_value_loss_fn(value_clip: float) -> LossFn:
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
            clipped_value_loss(v, o, r, value_clip) for v, o, r in zip(values, old, returns, strict=True)
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


def make_custom_loss_fn(path: str, plugin_args: argparse.Namespace) -> LossFn:
    """``--custom-loss-function-path`` bound to the run's namespace (see the module docstring for the
    contract)."""
    from slime.utils.plugins import load_function

    fn = load_function(path)

    def custom_loss_fn(batch: MicroBatch, log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None):
        return fn(plugin_args, batch, log_probs, entropy)

    return custom_loss_fn


def build_loss_fn(settings: TrainerSettings, plugin_args: argparse.Namespace) -> LossFn:
    """``plugin_args``: the run's namespace, handed to a ``--custom-loss-function-path`` plugin only."""
    loss_type = settings.loss.loss_type
    if loss_type == "custom_loss":
        path = settings.loss.custom_loss_function_path
        assert path is not None  # the config checks require it with --loss-type custom_loss
        return make_custom_loss_fn(path, plugin_args)
    if loss_type == "value_loss":  # the critic's settings only (``critic_settings``)
        return make_value_loss_fn(settings.loss.value_clip)
    losses = {"sft_loss": sft_loss_fn, "policy_loss": make_policy_loss_fn(settings)}
    try:
        return losses[loss_type]
    except KeyError:
        raise ValueError(
            f"--loss-type {loss_type!r} is not available; choose one of {sorted(losses)}"
        ) from None
