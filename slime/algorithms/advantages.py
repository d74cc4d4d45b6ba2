"""Advantage estimators as pure functions of rewards (and, for token-level ones, per-token tensors)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from slime.algorithms.kl import kl_estimate

Groups = int | Sequence[int] | torch.Tensor
"""Which samples share a prompt: a group size (consecutive blocks of that many samples), or one group
id per sample (``Sample.group_index``), which also holds when groups differ in size."""


def group_ids(groups: Groups, num_samples: int) -> torch.Tensor:
    """One group id per sample, 0-based and dense, from a group size or from per-sample ids."""
    if isinstance(groups, int):
        if groups < 1 or num_samples % groups:
            raise ValueError(f"{num_samples} rewards do not form groups of {groups}")
        return torch.arange(num_samples) // groups
    ids = torch.as_tensor(list(groups) if not torch.is_tensor(groups) else groups, dtype=torch.long)
    if ids.numel() != num_samples:
        raise ValueError(f"{ids.numel()} group ids for {num_samples} rewards")
    return torch.unique(ids, return_inverse=True)[1]


def _group_sums(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per sample, the sum of ``values`` over its group."""
    totals = torch.zeros(int(ids.max()) + 1 if ids.numel() else 0, dtype=values.dtype)
    return totals.index_add_(0, ids, values)[ids]


def _valid_counts(
    values: torch.Tensor, groups: Groups, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(group ids, 1.0 where the reward is valid, valid samples in the sample's group)``."""
    ids = group_ids(groups, values.numel())
    mask = torch.ones_like(values) if valid is None else valid.reshape(-1).float()
    return ids, mask, _group_sums(mask, ids)


def group_normalized_rewards(
    rewards: torch.Tensor,
    groups: Groups,
    normalize_std: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO's advantage: each reward minus its group's mean, divided by the group's std (optional).

    ``groups`` says which samples share a prompt (see ``Groups``). The std is the unbiased one, as in
    the GRPO paper and slime; a group whose rewards are all equal gets advantage 0 (its std is 0 and
    ``eps`` keeps the division finite). ``valid`` (bool, like ``rewards``) leaves samples whose
    reward does not exist (the reward function raised) out of their group's mean and std; they get
    advantage 0.
    """
    values = rewards.float().reshape(-1)
    ids, mask, count = _valid_counts(values, groups, valid)
    mean = _group_sums(values * mask, ids) / count.clamp(min=1)
    centered = (values - mean) * mask
    if normalize_std:
        variance = _group_sums(centered**2, ids) / (count - 1).clamp(min=1)
        centered = centered / (variance.sqrt() + eps)
    return centered


def broadcast_to_tokens(per_sample: torch.Tensor, response_lengths: list[int]) -> list[torch.Tensor]:
    """One advantage per response token: outcome rewards credit every token of the response alike."""
    return [
        torch.full((n,), float(value)) for value, n in zip(per_sample.tolist(), response_lengths, strict=True)
    ]


def rloo_advantages(rewards: torch.Tensor, groups: Groups, valid: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each reward minus the mean of the *other* rewards of its group.

    ``r_i - mean_{j≠i} r_j = n/(n-1) · (r_i - mean_j r_j)`` over the ``n`` valid samples of the group
    (see ``group_normalized_rewards``); a group with fewer than two valid samples gets 0.
    """
    if isinstance(groups, int) and groups < 2:
        raise ValueError("rloo needs --n-samples-per-prompt >= 2 (a leave-one-out baseline)")
    values = rewards.float().reshape(-1)
    centered = group_normalized_rewards(values, groups, normalize_std=False, valid=valid)
    _, _, count = _valid_counts(values, groups, valid)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return centered * scale


Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over every holder of a share of the batch (identity when one process holds it all)."""


def _no_reduce(value: torch.Tensor) -> torch.Tensor:
    return value


def masked_whiten(
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    reduce: Reduce = _no_reduce,
    eps: float = 1e-8,
) -> list[torch.Tensor]:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased variance over every unmasked token.

    ``reduce`` sums the moments ``(Σ m·x, Σ m·x², Σ m)`` over data-parallel ranks, so that every rank
    whitens its share with the statistics of the whole batch.
    """
    moments = torch.zeros(3, dtype=torch.float64)
    for value, mask in zip(values, masks, strict=True):
        value, mask = value.double(), mask.double()
        moments += torch.stack([(value * mask).sum(), (value.square() * mask).sum(), mask.sum()])
    total, square_total, count = reduce(moments).tolist()
    if count < 2:
        raise ValueError(f"whitening needs at least 2 unmasked tokens, got {int(count)}")
    mean = total / count
    var = (square_total - count * mean * mean) / (count - 1)
    scale = 1.0 / math.sqrt(max(var, 0.0) + eps)
    return [((value.float() - mean) * scale).float() for value in values]


def kl_shaped_token_rewards(
    reward: float,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    loss_mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """Per-token rewards of one response: ``-kl_coef · k1(log π - log π_ref)`` on unmasked tokens, plus
    the outcome reward on the last unmasked token (the last token when none is unmasked).

    REINFORCE++ and PPO's GAE both start from these; ``ref_log_probs`` may be None only with
    ``kl_coef == 0``.
    """
    mask = loss_mask.float()
    if kl_coef:
        if ref_log_probs is None:
            raise ValueError("--kl-coef shapes the reward with KL to the reference: ref_log_probs are needed")
        token_rewards = -kl_coef * kl_estimate(log_probs, ref_log_probs, "k1") * mask
    else:
        token_rewards = torch.zeros_like(mask)
    unmasked = mask.nonzero()
    last = int(unmasked[-1]) if len(unmasked) else len(mask) - 1
    token_rewards[last] += reward
    return token_rewards


def kl_shaped_rewards(
    rewards: Sequence[float],
    log_probs: Sequence[torch.Tensor],
    ref_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[Sequence[int]],
    kl_coef: float,
) -> list[float]:
    """Outcome rewards with the KL penalty folded in: ``r_i - kl_coef · Σ_t m_t k1_t`` (the sum of the
    token rewards above), for the estimators that see one scalar per sample (as verl does)."""
    shaped = []
    for r, lp, ref, m in zip(rewards, log_probs, ref_log_probs, loss_masks, strict=True):
        kl = kl_estimate(lp, ref, "k1") * torch.as_tensor(m, dtype=torch.float32)
        shaped.append(float(r) - kl_coef * float(kl.sum()))
    return shaped


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over one response: ``(advantages, returns)``.

    ``δ_t = r_t + γ V_{t+1} - V_t``, ``A_t = δ_t + γλ A_{t+1}``, ``R_t = A_t + V_t``, with ``V = 0`` after
    the last token. Masked tokens (e.g. tool output inside a multi-turn response) are not steps of the
    trajectory: they are skipped (the recursion links the unmasked tokens around them) and get
    advantage 0 and return ``V_t``.
    """
    values = values.float()
    value_list, reward_list = values.tolist(), torch.as_tensor(token_rewards).float().tolist()
    mask_list = torch.as_tensor(loss_mask).tolist()
    advantage_list = [0.0] * len(value_list)
    next_value, running = 0.0, 0.0
    for t in range(len(value_list) - 1, -1, -1):  # plain floats: a tensor read per token costs µs
        if not mask_list[t]:
            continue
        delta = reward_list[t] + gamma * next_value - value_list[t]
        running = delta + gamma * lambd * running
        advantage_list[t] = running
        next_value = value_list[t]
    advantages = torch.tensor(advantage_list, dtype=values.dtype, device=values.device)
    return advantages, advantages + values


def ppo_advantages(
    rewards: Sequence[float],
    values: Sequence[torch.Tensor],
    log_probs: Sequence[torch.Tensor],
    ref_log_probs: Sequence[torch.Tensor] | None,
    loss_masks: Sequence[Sequence[int]],
    kl_coef: float,
    gamma: float,
    lambd: float,
    reduce: Reduce = _no_reduce,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO with a critic: GAE on the KL-shaped token rewards, ``(whitened advantages, returns)``.

    The advantages are whitened over every unmasked token of the batch (``reduce`` sums the moments over
    data-parallel ranks); the returns, the critic's targets, are not.
    """
    masks = [torch.as_tensor(m, dtype=torch.float32) for m in loss_masks]
    refs = ref_log_probs if ref_log_probs is not None else [None] * len(masks)
    results = [
        gae(kl_shaped_token_rewards(float(r), lp.float(), ref, m, kl_coef), v, m, gamma, lambd)
        for r, v, lp, ref, m in zip(rewards, values, log_probs, refs, masks, strict=True)
    ]
    advantages = masked_whiten([a for a, _ in results], masks, reduce)
    return advantages, [ret for _, ret in results]


def reinforce_plus_plus_returns(
    reward: float,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    kl_coef: float,
    gamma: float,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025) discounted returns of one response, before whitening.

    Token reward ``-kl_coef · k1(log π - log π_ref)`` on unmasked tokens, plus the outcome reward on the
    last unmasked token; ``G_t = r_t + γ · G_{t+1}``.
    """
    token_rewards = kl_shaped_token_rewards(reward, log_probs, ref_log_probs, loss_mask, kl_coef)
    return discounted_cumsum(token_rewards, gamma)


def discounted_cumsum(values: torch.Tensor, gamma: float, block: int = 256) -> torch.Tensor:
    """``G_t = Σ_{k >= t} γ^(k-t) v_k`` of a 1-D tensor, without a Python loop over tokens.

    Blocks of ``block`` tokens are summed with a triangular matrix of ``γ^(j-i)``; the return at a
    block's end is carried into the previous block with ``γ^(end-t)``. That keeps every power of γ
    within ``block`` steps: ``γ^t`` over a whole 8k-token response underflows for γ < 1.
    """
    n = values.numel()
    out = torch.empty(n, dtype=torch.float64, device=values.device)
    steps = torch.arange(block, device=values.device)
    offset = (steps[None, :] - steps[:, None]).to(torch.float64)
    g = torch.tensor(gamma, dtype=torch.float64, device=values.device)
    powers = torch.where(offset >= 0, g ** offset.clamp(min=0), 0.0)
    carry = torch.zeros((), dtype=torch.float64, device=values.device)
    for end in range(n, 0, -block):
        start = max(0, end - block)
        m = end - start
        chunk = values[start:end].to(torch.float64)
        tail = g ** (m - steps[:m]).to(torch.float64)
        out[start:end] = powers[:m, :m] @ chunk + carry * tail
        carry = out[start]
    return out.to(values.dtype)


def outcome_advantages(
    rewards: list[float],
    response_lengths: list[int],
    groups: Groups,
    estimator: str,
    normalize_std: bool = True,
    loss_masks: Sequence[Sequence[int]] | None = None,
    valid: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """Per-token advantages for the outcome-reward estimators, one tensor per sample.

    ``grpo`` / ``gspo`` / ``cispo``: group-normalised rewards (std normalisation unless disabled);
    ``dr_grpo``: group-centred rewards without std normalisation (Liu et al. 2025, pair it with
    ``--loss-agg-mode seq_mean_token_sum``); ``rloo``: leave-one-out baseline;
    ``reinforce_plus_plus_baseline``: group-centred rewards whitened over every unmasked token of the
    batch (needs ``loss_masks``). ``groups``: which samples share a prompt (``Groups``). ``valid``:
    False for a sample without a reward, left out of its group's statistics with advantage 0.
    """
    values = torch.tensor(rewards, dtype=torch.float32)
    mask = None if valid is None else torch.tensor(list(valid), dtype=torch.bool)
    if estimator in ("grpo", "gspo", "cispo"):
        per_sample = group_normalized_rewards(values, groups, normalize_std, valid=mask)
    elif estimator == "dr_grpo":
        per_sample = group_normalized_rewards(values, groups, normalize_std=False, valid=mask)
    elif estimator == "rloo":
        per_sample = rloo_advantages(values, groups, valid=mask)
    elif estimator == "reinforce_plus_plus_baseline":
        if loss_masks is None:
            raise ValueError("reinforce_plus_plus_baseline whitens over tokens: pass loss_masks")
        centered = group_normalized_rewards(values, groups, normalize_std=False, valid=mask)
        masks = [torch.as_tensor(m, dtype=torch.float32) for m in loss_masks]
        return masked_whiten(broadcast_to_tokens(centered, response_lengths), masks)
    else:
        raise ValueError(f"--advantage-estimator {estimator} is not an outcome-reward estimator")
    return broadcast_to_tokens(per_sample, response_lengths)


TOKEN_LEVEL_ESTIMATORS = ("reinforce_plus_plus", "ppo")
"""Estimators whose advantages need per-token inputs: the policy's (and reference's) log-probs, and for
``ppo`` the critic's values."""


def reinforce_plus_plus_advantages(
    rewards: Sequence[float],
    log_probs: Sequence[torch.Tensor],
    ref_log_probs: Sequence[torch.Tensor] | None,
    loss_masks: Sequence[Sequence[int]],
    kl_coef: float,
    gamma: float,
    reduce: Reduce = _no_reduce,
) -> list[torch.Tensor]:
    """REINFORCE++ advantages: discounted returns of each response, whitened over every unmasked token
    of the batch (``reduce`` sums the whitening moments over the ranks sharing the batch).

    ``ref_log_probs`` may be None only with ``kl_coef == 0`` (no KL shaping).
    """
    if ref_log_probs is None:
        if kl_coef:
            raise ValueError("--kl-coef shapes the reward with KL to the reference: ref_log_probs are needed")
        ref_log_probs = log_probs
    masks = [torch.as_tensor(m, dtype=torch.float32) for m in loss_masks]
    returns = [
        reinforce_plus_plus_returns(float(r), lp.float(), ref.float(), m, kl_coef, gamma)
        for r, lp, ref, m in zip(rewards, log_probs, ref_log_probs, masks, strict=True)
    ]
    return masked_whiten(returns, masks, reduce)
