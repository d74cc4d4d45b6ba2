"""Token sampling for one decode step: pure functions over a `[rows, vocab]` fp32 logits tensor.

Semantics follow SGLang 0.5.x:
- temperature 0 means greedy (SGLang turns it into temperature 1 with top_k 1), so the returned logprob
  of a greedy token is log_softmax(logits) at temperature 1;
- the returned logprob of every sampled token is log_softmax(logits / temperature), taken BEFORE
  top-k / top-p / min-p truncation. That is what SGLang's sampler returns and exactly what slime's
  trainer recomputes, so rollout and training logprobs agree (no renormalised truncated distribution);
- truncation: top-p keeps the smallest prefix of the sorted distribution whose mass reaches p (computed
  on the full distribution), top-k keeps the k most likely tokens, min-p drops tokens with
  p < min_p * max p; the kept probabilities are sampled without renormalisation (multinomial does it);
- `min_new_tokens`: EOS and stop tokens get -inf logits until enough tokens were produced (SGLang's
  min-new-tokens penalizer), before the logprob is taken, as in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """The per-request sampling settings one step needs."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


def ban_tokens(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """Set `logits[row, token] = -inf` for each row's banned tokens (min_new_tokens); in place."""
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    if rows:
        cols = [t for ids in banned for t in ids]
        logits[rows, cols] = float("-inf")
    return logits


def logprobs_for(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) per row; rows with T == 0 (greedy) use T = 1."""
    safe = torch.where(temperatures < 1e-6, torch.ones_like(temperatures), temperatures)
    return torch.log_softmax(logits / safe[:, None], dim=-1)


def truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """Zero the probabilities outside each row's top-k / top-p / min-p set.

    Returns `(sorted_probs, sorted_index)`: the kept probabilities in descending order and the token id
    of each column, so sampling picks a column and maps it back through `sorted_index`.
    """
    sorted_probs, sorted_index = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    sorted_probs = sorted_probs.masked_fill((cumulative - sorted_probs) > top_p[:, None], 0.0)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, probs.shape[-1]))
    sorted_probs = sorted_probs.masked_fill(ranks >= k[:, None], 0.0)
    threshold = sorted_probs[:, :1] * min_p[:, None]
    sorted_probs = sorted_probs.masked_fill(sorted_probs < threshold, 0.0)
    return sorted_probs, sorted_index


def sample(
    logits: torch.Tensor,
    rows: list[RowSampling],
    default_generator: torch.Generator | None,
    want_logprobs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row; return `(token_ids [rows], logprobs [rows] or None)`.

    Rows with their own generator (a request's `sampling_seed`) draw from it alone, so their samples do
    not depend on which other requests share the batch; the others share `default_generator`. Without
    `want_logprobs` an all-greedy batch skips the softmax altogether.
    """
    device = logits.device
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    greedy = [i for i, r in enumerate(rows) if r.greedy]
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    logprobs = None
    if want_logprobs or sampled:
        temperatures = torch.tensor([r.temperature for r in rows], dtype=logits.dtype, device=device)
        logprobs = logprobs_for(logits, temperatures)
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1) if len(greedy) < len(rows) else logits.argmax(dim=-1)
    if sampled:
        assert logprobs is not None  # computed above whenever a row samples
        probs = logprobs[sampled].exp()
        sub = [rows[i] for i in sampled]
        index = None
        if any(r.truncates for r in sub):
            probs, index = truncate(
                probs,
                torch.tensor([r.top_k for r in sub], device=device),
                torch.tensor([r.top_p for r in sub], dtype=probs.dtype, device=device),
                torch.tensor([r.min_p for r in sub], dtype=probs.dtype, device=device),
            )
        picks = torch.empty(len(sub), dtype=torch.long, device=device)
        shared = [j for j, r in enumerate(sub) if r.generator is None]
        if shared:
            picks[shared] = torch.multinomial(probs[shared], 1, generator=default_generator)[:, 0]
        for j, r in enumerate(sub):
            if r.generator is not None:
                picks[j] = torch.multinomial(probs[j], 1, generator=r.generator)[0]
        if index is not None:
            picks = index.gather(1, picks[:, None])[:, 0]
        tokens[sampled] = picks
    if not want_logprobs:
        return tokens, None
    assert logprobs is not None  # computed above when wanted
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
