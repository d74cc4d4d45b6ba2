"""``train.py`` as a user first meets it: ``--help`` and mistakes, before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slime.config import ConfigError
from slime.config.settings.run import RunSettings
from slime.rollout.errors import RolloutError
from slime.utils.http import free_port
from tests.support.models import model_args
from tests.support.paths import REPO

FAMILY_TITLES = (
    "Megatron: model",
    "Megatron: parallelism",
    "SGLang: --sglang-<flag> pass-through",
    "slime: rollout",
)


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_help_lists_the_three_flag_families():
    result = run("--help")
    assert result.returncode == 0
    for title in FAMILY_TITLES:
        assert title in result.stdout
    assert "--num-query-groups" in result.stdout and "--rollout-batch-size" in result.stdout


def test_a_bad_flag_is_one_line_and_exit_2():
    result = run("--no-such-flag")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: unrecognized arguments: --no-such-flag; see --help"]


def one_rollout_flags(model: Path, data: Path) -> list[str]:
    """A valid one-rollout ``train.py`` run of ``model`` on ``data`` (the data is read first)."""
    argv = [*model_args(), "--hf-checkpoint", str(model), "--prompt-data", str(data), "--lr", "1e-5"]
    return [*argv, "--rollout-batch-size", "1", "--rollout-num-gpus", "1", "--num-rollout", "1"]


def test_a_malformed_data_line_is_one_line_and_nothing_starts(tiny_models, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input": "abc", "label": "cba"}) + "\n" + '{"input": broken\n')
    result = run(*one_rollout_flags(tiny_models["qwen2"], data))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {data}:2: not valid JSON"), lines


def one_rollout_data(tmp_path: Path) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input": "abc", "label": "cba"}) + "\n")
    return data


def one_rollout_argv(tiny_models, tmp_path, monkeypatch, *extra: str) -> None:
    """``sys.argv`` of a valid one-rollout ``train.py`` run on one prompt, for ``run_entry_point``."""
    flags = one_rollout_flags(tiny_models["qwen2"], one_rollout_data(tmp_path))
    monkeypatch.setattr(sys, "argv", ["train.py", *flags, *extra])


def test_an_unreachable_ray_address_is_one_line_and_exit_1(tiny_models, tmp_path):
    """Before, ``ray.init`` retried the address for minutes, a warning every few seconds."""
    address = f"127.0.0.1:{free_port()}"
    result = run(
        *one_rollout_flags(tiny_models["qwen2"], one_rollout_data(tmp_path)), "--ray-address", address
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert f" ERROR slime: --ray-address {address}: no Ray cluster at " in last, result.stderr[-2000:]
    assert last.endswith("or fix --ray-address; every process of the run was stopped")


def test_a_trainer_failure_is_resumed_from_the_checkpoints_as_often_as_auto_resume_says(
    tiny_models, tmp_path, monkeypatch, caplog
):
    """Each resume loads the run's own latest checkpoint with its optimizer state; the failure after
    the last one is the run's one-line error."""
    from slime.cli import run_entry_point
    from slime.ray.errors import TrainerFailure

    ckpt = str(tmp_path / "ckpt")
    one_rollout_argv(
        tiny_models, tmp_path, monkeypatch,
        "--save", ckpt, "--save-interval", "1", "--auto-resume", "2", "--no-load-optim",
    )  # fmt: skip
    message = "trainer rank 1 (node 10.0.0.3) died in TrainerActor.train: killed"
    loads = []

    def fails(settings: RunSettings) -> None:
        checkpoint = settings.trainer.checkpoint
        assert settings.loop.load == settings.data.load == settings.plugin_args.load == checkpoint.load
        loads.append((checkpoint.load, checkpoint.no_load_optim))
        raise TrainerFailure(message)

    with pytest.raises(SystemExit) as exit_info:
        run_entry_point(fails)
    assert exit_info.value.code == 1
    assert loads == [(None, True), (ckpt, False), (ckpt, False)]
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert lines == [
        ("WARNING", f"{message}; resuming from the last checkpoint in {ckpt} (--auto-resume: 1 of 2)"),
        ("WARNING", f"{message}; resuming from the last checkpoint in {ckpt} (--auto-resume: 2 of 2)"),
        ("ERROR", f"{message}; every process of the run was stopped"),
    ]


@pytest.mark.parametrize(
    ("error", "code"),
    [(ConfigError("--x", "bad; fix it"), 2), (RolloutError("plugin broke"), 1), (KeyboardInterrupt(), 130)],
)
def test_only_trainer_failures_are_resumed(tiny_models, tmp_path, monkeypatch, error, code):
    from slime.cli import run_entry_point

    one_rollout_argv(
        tiny_models,
        tmp_path,
        monkeypatch,
        "--save",
        str(tmp_path),
        "--save-interval",
        "1",
        "--auto-resume",
        "1",
    )
    calls = []

    def fails(settings: RunSettings) -> None:
        calls.append(settings.loop.load)
        raise error

    with pytest.raises(SystemExit) as exit_info:
        run_entry_point(fails)
    assert (exit_info.value.code, calls) == (code, [None])


def test_an_engine_refusal_at_run_time_is_one_line_and_exit_1(tiny_models, tmp_path, monkeypatch, caplog):
    """What ``train.py`` prints when an engine refuses a weight push (after the session has stopped
    every process): the engine, the endpoint and the engine's own words, no traceback."""
    from slime.cli import run_entry_point
    from slime.engine_client.calls import EngineCallError

    one_rollout_argv(tiny_models, tmp_path, monkeypatch)
    message = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"

    def refused(settings: RunSettings) -> None:
        raise EngineCallError("http://10.0.0.7:30000", "/update_weights_from_distributed", message, 400)

    with pytest.raises(SystemExit) as exit_info:
        run_entry_point(refused)
    assert exit_info.value.code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        f"engine http://10.0.0.7:30000 refused /update_weights_from_distributed (HTTP 400): {message}; "
        "every process of the run was stopped"
    ]


def test_a_rollout_error_from_the_rollout_actor_is_one_line_and_exit_1(
    tiny_models, tmp_path, monkeypatch, caplog
):
    """A ``RolloutError`` reaches the driver inside Ray's task error (whose text is the actor's
    traceback); the user sees the rollout's own line."""
    import ray

    from slime.cli import run_entry_point
    from slime.rollout.errors import RolloutError

    one_rollout_argv(tiny_models, tmp_path, monkeypatch)
    message = "--custom-generate-function-path my.gen returned sample 3 still pending"

    def failed(settings: RunSettings) -> None:
        cause = RolloutError(message)
        raise ray.exceptions.RayTaskError(
            "generate", "Traceback (most recent call last): ...", cause
        ).as_instanceof_cause()

    with pytest.raises(SystemExit) as exit_info:
        run_entry_point(failed)
    assert exit_info.value.code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"{message}; every process of the run was stopped"]

    def other(settings: RunSettings) -> None:
        raise ray.exceptions.RayTaskError("generate", "Traceback ...", KeyError("x")).as_instanceof_cause()

    with pytest.raises(ray.exceptions.RayTaskError):  # anything else keeps its traceback
        run_entry_point(other)
