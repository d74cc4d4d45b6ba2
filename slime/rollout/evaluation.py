"""Evaluation sets: their prompts read with each set's own settings, their metrics, their per-sample file.

An ``EvalSet`` is a set's prompts together with the ``EvalSetSettings`` they are sampled and scored
with (settled by validation from ``--eval-config`` or ``--eval-prompt-data``,
``slime.config.eval_config``), so the rollout function never reads a set's settings from the flags.

``eval_metrics`` summarises one scored set (below, P prompts, values per prompt averaged first):

- ``eval/<name>``: the mean over prompts of each prompt's mean reward, with ``eval/<name>/ci_low``
  and ``/ci_high``, a 95 % Student-t interval over the P per-prompt means (``slime.utils.stats``
  says why); left out for a one-prompt set;
- ``eval/<name>/response_length``, ``eval/<name>/truncated_ratio``: over all samples;
- with ``--log-passrate``: ``eval/<name>-pass@k`` for k = 1, 2, 4, ... up to the set's samples per
  prompt, the unbiased estimator averaged over prompts, a sample being correct when its reward is at
  least ``--eval-pass-threshold``; its interval (``/ci_low``, ``/ci_high``) is over the per-prompt
  estimates, cut to [0, 1].

``write_eval_samples`` keeps every sample of an evaluation as one JSONL line, so that two
checkpoints can be compared prompt by prompt and sample by sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from slime.config.eval_config import EvalSetSettings
from slime.config.settings.eval import EvalSettings
from slime.rollout.prompt_files import PromptFormat, load_prompts
from slime.rollout.sample import Sample
from slime.rollout.tokenizer_cache import load_tokenizer
from slime.utils.stats import mean_interval, pass_at_k, pass_at_k_ks


@dataclass
class EvalSet:
    """One evaluation set: its settings and its prompts (one PENDING ``Sample`` per record)."""

    settings: EvalSetSettings
    prompts: list[Sample]

    @property
    def name(self) -> str:
        return self.settings.name


def eval_metrics(
    name: str,
    groups: list[list[Sample]],
    reward_key: str | None = None,
    pass_threshold: float | None = None,
) -> dict[str, float]:
    """The metrics of one scored set (see the module docstring); ``groups``: one per prompt.

    ``pass_threshold``: log pass@k with this threshold; None: do not. pass@k goes up to the smallest
    group (a custom generate function may return more samples for some prompts).
    """
    samples = [sample for group in groups for sample in group]
    n = len(samples)
    prompt_means = [sum(s.reward_value(reward_key) for s in group) / len(group) for group in groups]
    metrics = _with_interval(f"eval/{name}", prompt_means)
    metrics[f"eval/{name}/response_length"] = sum(s.response_length for s in samples) / n
    metrics[f"eval/{name}/truncated_ratio"] = sum(s.status == Sample.Status.TRUNCATED for s in samples) / n
    if pass_threshold is not None:
        correct = [sum(s.reward_value(reward_key) >= pass_threshold for s in group) for group in groups]
        for k in pass_at_k_ks(min(len(group) for group in groups)):
            values = [pass_at_k(len(g), c, k) for g, c in zip(groups, correct, strict=True)]
            metrics.update(_with_interval(f"eval/{name}-pass@{k}", values, probability=True))
    return metrics


def _with_interval(key: str, values: list[float], probability: bool = False) -> dict[str, float]:
    """``key``: the mean of ``values``; ``key/ci_low``, ``key/ci_high``: its interval, when there is one."""
    interval = mean_interval(values)
    if interval is None:
        return {key: sum(values) / len(values)}
    if probability:
        interval = interval.clipped(0.0, 1.0)
    return {key: interval.mean, f"{key}/ci_low": interval.low, f"{key}/ci_high": interval.high}


def eval_output_dir(settings: EvalSettings, log_dir: str) -> Path:
    """``--eval-output-dir``, else ``<--save>/eval`` (next to the checkpoints it scores), else
    ``<log_dir>/eval`` (the run's engine and router logs)."""
    if settings.output_dir:
        return Path(settings.output_dir)
    return Path(settings.save or log_dir) / "eval"


def load_eval_datasets(settings: EvalSettings) -> list[EvalSet]:
    """Every evaluation set with its prompts, read like the training prompts with the set's own keys
    and chat template (the tokenizer is loaded once, if any set renders with it)."""
    tokenizer = None
    if any(s.apply_chat_template for s in settings.sets):
        assert settings.tokenizer_path is not None  # --hf-checkpoint, which the config checks require
        tokenizer = load_tokenizer(settings.tokenizer_path)
    sets = []
    for s in settings.sets:
        prompt_format = PromptFormat(
            input_key=s.input_key,
            label_key=s.label_key,
            metadata_key=settings.metadata_key,
            tool_key=settings.tool_key,
            multimodal_keys=settings.multimodal_keys,
            tokenizer=tokenizer if s.apply_chat_template else None,
            apply_chat_template=s.apply_chat_template,
        )
        sets.append(EvalSet(s, load_prompts(s.path, prompt_format)))
    return sets


def write_eval_samples(
    path: Path, rollout_id: int, eval_groups: dict[str, list[list[Sample]]], reward_key: str | None = None
) -> int:
    """One JSONL line per sample of an evaluation at ``path``; returns how many.

    A line: ``set``, ``rollout_id`` (the weights of the rollout just trained; -1 before training),
    ``prompt_index`` (the prompt's place in its set), ``sample_index`` (the response's place among that
    prompt's), ``weight_versions`` (the engines' weight version of each generation turn), ``reward``
    (the scalar, via ``--reward-key``), ``raw_reward`` (what the reward function returned),
    ``status``, ``response_length``, ``label`` and ``response``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = 0
    with open(path, "w", encoding="utf-8") as f:
        for name, groups in eval_groups.items():
            for prompt_index, group in enumerate(groups):
                for sample_index, sample in enumerate(group):
                    row = {
                        "set": name,
                        "rollout_id": rollout_id,
                        "prompt_index": prompt_index,
                        "sample_index": sample_index,
                        "weight_versions": list(sample.weight_versions),
                        "reward": sample.reward_value(reward_key),
                        "raw_reward": sample.reward,
                        "status": sample.status.value,
                        "response_length": sample.response_length,
                        "label": sample.label,
                        "response": sample.response,
                    }
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    lines += 1
    return lines
