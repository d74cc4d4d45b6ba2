"""Rollout-side arguments, rollout managers and prompt data sources."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from slime.rollout.data_source import PromptDataSource
from slime.rollout.prompt_files import PromptFormat, load_prompts
from slime.rollout.sample import Sample


def write_jsonl(path: Path, rows: list[dict] | list[str]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def numbered(n: int) -> list[dict]:
    return [{"input": f"q{i}", "label": str(i), "metadata": {"i": i}} for i in range(n)]


def rollout_only_args(tiny_models: dict[str, Path], prompts: Path, *extra: str):
    """The parsed flags of a one-rollout ``--debug-rollout-only`` run of the tiny qwen2 on ``prompts``
    (2 prompts x 2 samples, exact-match reward): what the plugin tests build their objects from."""
    from slime.config import parse_args

    return parse_args(
        [
            "--hf-checkpoint", str(tiny_models["qwen2"]),
            "--prompt-data", str(prompts), "--label-key", "label", "--rm-type", "exact",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-num-gpus", "1", "--num-rollout", "1", "--debug-rollout-only",
            "--rollout-max-response-len", "5", *extra,
        ]
    )  # fmt: skip


def manager_parts(args: argparse.Namespace) -> tuple:
    """What a ``RolloutManager`` takes before its placement: its settings parts read from the parsed
    flags, then the plugins' namespace."""
    from slime.config.settings.cluster import ClusterSettings
    from slime.config.settings.data import DataSettings
    from slime.config.settings.eval import EvalSettings
    from slime.config.settings.fault_tolerance import FaultToleranceSettings
    from slime.config.settings.rollout import RolloutSettings

    return (
        DataSettings.from_args(args),
        RolloutSettings.from_args(args),
        EvalSettings.from_args(args),
        ClusterSettings.from_args(args),
        FaultToleranceSettings.from_args(args),
        args,
    )


def prompt_source(args: argparse.Namespace) -> PromptDataSource:
    """The run's prompt source from parsed flags, as the rollout manager builds it."""
    from slime.config.settings.data import DataSettings

    return PromptDataSource.from_settings(DataSettings.from_args(args), args)


def rollout_parts(args: argparse.Namespace) -> tuple:
    """``(RolloutSettings, FaultToleranceSettings)`` of parsed flags: what the default rollout's
    ``generate_groups`` / ``sample_rollout`` / ``RolloutClient`` take after the plugins' namespace."""
    from slime.config.settings.fault_tolerance import FaultToleranceSettings
    from slime.config.settings.rollout import RolloutSettings

    return RolloutSettings.from_args(args), FaultToleranceSettings.from_args(args)


@contextlib.contextmanager
def running_rollout_manager(args, log_dir: Path):
    """A RolloutManager with its engines (one per bundle of ``--rollout-num-gpus``) and router started;
    yields ``(manager, engine urls, router url)`` and stops all of it after."""
    import ray

    from slime.ray.cluster import create_placement_group, release_placement_group
    from slime.ray.rollout_manager import RolloutManager

    pg = create_placement_group(args.rollout_num_gpus)
    bundles = list(range(args.rollout_num_gpus))
    manager = RolloutManager.remote(*manager_parts(args), pg, bundles, log_dir=str(log_dir))
    try:
        urls, router_url = ray.get(manager.start.remote(120))
        yield manager, urls, router_url
    finally:
        ray.get(manager.shutdown.remote())
        ray.kill(manager)
        release_placement_group(pg)


def make(tiny_models, prompts: Path, *extra: str) -> argparse.Namespace:
    args = rollout_only_args(tiny_models, prompts, *extra)
    args.sglang_router_ip, args.sglang_router_port = "127.0.0.1", 9  # never contacted here
    return args


def source(tmp_path: Path, n: int = 5, **kwargs) -> PromptDataSource:
    prompts = load_prompts(write_jsonl(tmp_path / "d.jsonl", numbered(n)), PromptFormat(label_key="label"))
    return PromptDataSource(prompts, **kwargs)


def prompts_of(groups: list[list[Sample]]) -> list[str]:
    return [group[0].prompt for group in groups]
