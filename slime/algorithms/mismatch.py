"""Train–inference mismatch: how far the engine's log-probs are from the trainer's, and masked
importance sampling (MIS) to correct for it.

``log_ratio = log π_train - log π_rollout`` of tokens sampled by the engine (π_rollout). Truncated IS
(``slime.algorithms.losses.truncated_is_weights``) clamps the ratio; MIS instead drops (masks) the
tokens or whole sequences whose ratio leaves ``[low, high]`` and importance-weights the rest.
"""

from __future__ import annotations

import torch

from slime.algorithms.aggregation import FlatTokens, sample_mean, sample_sum
from slime.algorithms.kl import kl_estimate
from slime.algorithms.losses import truncated_is_weights

MIS_LEVELS = ("token", "sequence", "geometric")
_LOG_RATIO_CLAMP = 20.0


def masked_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    level: str,
    low: float,
    high: float,
    tokens: FlatTokens | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MIS weights of one response (or of the flat ``tokens`` of several) (no gradient) and 1.0 where
    a token is kept.

    ``token``: each token's ratio ``π_old/π_rollout``; ``sequence``: the product of the unmasked tokens'
    ratios (``exp Σ_t m_t log r_t``), shared by every token; ``geometric``: their geometric mean
    (``exp mean_t log r_t``), length-independent. A token (``token``) or a whole response (the other
    two) whose ratio lies outside ``[low, high]`` gets weight 0; the others keep their ratio as weight.
    Log-ratios are clamped to ±20, so a long sequence's product is huge but finite.
    """
    log_ratio = old_log_probs.detach().float() - rollout_log_probs.detach().float()
    mask = loss_mask.float()
    if level == "token":
        level_log_ratio = log_ratio
    elif level == "sequence":
        level_log_ratio = sample_sum(log_ratio, mask, tokens).expand_as(log_ratio)
    elif level == "geometric":
        level_log_ratio = sample_mean(log_ratio, mask, tokens).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown MIS level {level!r}; choose one of {MIS_LEVELS}")
    ratio = level_log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    kept = ((ratio >= low) & (ratio <= high)).float()
    return ratio * kept, kept


def mismatch_token_metrics(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, tis_clip_low: float, tis_clip: float
) -> dict[str, torch.Tensor]:
    """Per-token mismatch diagnostics, to be aggregated like the loss:

    - ``train_rollout_logprob_abs_diff``: ``|log π_train - log π_rollout|``;
    - ``train_rollout_kl``: k3 estimate of KL(π_rollout ‖ π_train), ``r - 1 - log r`` with
      ``r = π_train/π_rollout`` (non-negative, low variance; the tokens were sampled by the engine);
    - ``train_rollout_tis_clipfrac``: 1.0 where the TIS weight ``clamp(r, tis_clip_low, tis_clip)``
      would be clipped (logged whether or not ``--use-tis`` is on).
    """
    train = train_log_probs.detach().float()
    rollout = rollout_log_probs.detach().float()
    _, clipped = truncated_is_weights(train, rollout, tis_clip_low, tis_clip)
    return {
        "train_rollout_logprob_abs_diff": (train - rollout).abs(),
        "train_rollout_kl": kl_estimate(rollout, train, "k3"),
        "train_rollout_tis_clipfrac": clipped,
    }


ROLLOUT_LOGPROB_COVERAGE = "rollout_logprob_coverage"
"""Metric: the (loss-weighted) share of trained tokens whose engine log-prob is known."""
MISMATCH_KEYS = ("train_rollout_logprob_abs_diff", "train_rollout_kl", "train_rollout_tis_clipfrac")


def per_scored_token(metrics: dict[str, float]) -> dict[str, float]:
    """The mismatch metrics as means over the tokens the engine scored rather than over every trained
    token: the loss aggregates them over scored tokens only, so they are divided by the coverage
    after the reduction over micro-batches and ranks; at coverage 0 they are left out (nothing was
    measured). Without a coverage (no rollout log-probs, or a custom loss) ``metrics`` is returned as
    it is."""
    coverage = metrics.get(ROLLOUT_LOGPROB_COVERAGE)
    if coverage is None:
        return metrics
    return {
        key: value / coverage if key in MISMATCH_KEYS else value
        for key, value in metrics.items()
        if coverage > 0 or key not in MISMATCH_KEYS
    }
