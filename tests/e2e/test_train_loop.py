"""The RL loop end to end on CPU: 2 torch engines behind the router, 2 Megatron trainer ranks, GRPO.

One test drives a TrainingSession in-process (so the engines can be inspected while they are up);
the others run ``train.py`` as a user does, then resume it from its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import ray
import torch

from slime.config import parse_args
from slime.engine_client.calls import EngineCallError
from slime.utils.http import get_json, post_json_sync
from tests.support.engines import engine_state, engine_weights_equal
from tests.support.paths import REPO
from tests.support.plugins.text_form_generate import write_chat_prompts
from tests.support.train_runs import LOOP, ONE_PER_SIDE, processes_tagged, read_events, run_train

pytestmark = pytest.mark.e2e


STREAMING = {"streaming_data": True, "num_data_workers": "2"}


def engine_paused(url: str) -> bool:
    return engine_state(url)["paused"]


# Without weight-update sessions (0.5.19, DP 2) and with them (0.5.23, PP 2: both stages push inside
# the one session each engine has); at the temperature users run, with the trainer's own old log-probs
# and with the engine's (--use-rollout-logprobs).
@pytest.mark.parametrize(
    ("release", "layout"),
    [
        ("0.5.19", ["--rollout-temperature", "0.7"]),
        (
            "0.5.23",
            ["--pipeline-model-parallel-size", "2", "--rollout-temperature", "0.7", "--use-rollout-logprobs"],
        ),
    ],
)
def test_session_pushes_trainer_weights_to_every_engine(ray_cluster, tiny_run_flags, release, layout):
    from slime.config.settings.run import RunSettings
    from slime.engine_client.protocol import probe_engine_api
    from slime.ray.session import TrainingSession

    flags = tiny_run_flags("--torch-engine-sglang-release", release, *layout, **LOOP)
    args = parse_args(flags)
    with TrainingSession(RunSettings.from_args(args)) as session:
        session.push_weights()
        data = ray.get(session.rollout.generate.remote(0))
        data.pop("metrics")
        urls = ray.get(session.rollout.engine_urls.remote())
        session.pause_for_push()  # as train.py: the engines pause while the trainer trains
        metrics = session.trainer.train(data)[0]
        assert all(engine_paused(url) for url in urls)
        assert metrics["ppo_kl"] == pytest.approx(0.0, abs=1e-6)
        assert metrics["train_rollout_logprob_abs_diff"] < 1e-3
        session.push_weights()
        expected = session.trainer.hf_state_dict()
        assert len(urls) == 2
        for url in urls:
            assert not engine_paused(url)
            assert probe_engine_api(url).weight_update_sessions == (release == "0.5.23")
            assert get_json(f"{url}/model_info")["weight_version"] == "2"
            engine_weights_equal(url, expected)

        # An engine that lost its weight-update group refuses the next bucket at once, while the
        # other joins the broadcast: the push fails with the engine's own words within seconds
        # (not after --update-weights-timeout), and the next push opens a new group and succeeds.
        groups = {"group_name": "slime-pp0"}
        assert post_json_sync(f"{urls[1]}/destroy_weights_update_group", groups)["success"]
        started = time.monotonic()
        with pytest.raises(EngineCallError) as refused:
            session.push_weights()
        assert time.monotonic() - started < 10
        assert f"engine {urls[1]} refused /update_weights_from_distributed" in str(refused.value)
        assert "group 'slime-pp0' does not exist" in str(refused.value)
        session.push_weights()
        for url in urls:
            assert get_json(f"{url}/model_info")["weight_version"] == "4"
            engine_weights_equal(url, expected)
        pids = ray.get(session.rollout.pids.remote())
    for pid in [*pids["engines"], pids["router"]]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


REQUIRED_SCALARS = (
    "rollout/raw_reward", "rollout/response_length", "rollout/truncated_ratio",
    "train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/kl_loss", "train/entropy",
    "train/grad_norm", "train/lr", "train/train_rollout_logprob_abs_diff",
    "perf/rollout_time", "perf/train_time", "perf/update_weights_time", "perf/tokens_per_sec",
)  # fmt: skip


def test_train_py_runs_grpo_logs_every_scalar_and_resumes_exactly(tiny_run_flags, tmp_path):
    """A run resumed from its rollout-1 checkpoint repeats rollout 2 of the uninterrupted run exactly:
    the same prompts in the same order, the same sampled tokens (seeded per sample with
    --rollout-seed-per-sample) and the same loss.
    Both runs stream their prompts through two worker processes (--streaming-data --num-data-workers 2)."""
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    flags = tiny_run_flags(
        "--save", str(ckpt), "--save-interval", "2", "--tb-dir", str(tb),
        "--save-debug-rollout-data", str(tmp_path / "full_{rollout_id}.pt"), **LOOP, **STREAMING,
        num_rollout=3, rollout_seed_per_sample=True,
    )  # fmt: skip
    run_train(flags)
    scalars = read_events(tb)
    missing = [tag for tag in REQUIRED_SCALARS if tag not in scalars]
    assert not missing, missing
    assert [step for step, _ in scalars["train/loss"]] == [0, 1, 2]
    assert scalars["train/ppo_kl"][0][1] < 1e-6
    assert all(value < 1e-3 for _, value in scalars["train/train_rollout_logprob_abs_diff"])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"  # saved at rollouts 1 and 2
    saved_position = json.loads((ckpt / "rollout" / "data_source_1.json").read_text())
    assert saved_position["next_group_index"] == 2 * 4  # two rollouts of 4 prompt groups

    resumed_tb = tmp_path / "tb_resumed"
    flags = tiny_run_flags(
        "--load", str(ckpt), "--ckpt-step", "1", "--tb-dir", str(resumed_tb),
        "--save-debug-rollout-data", str(tmp_path / "resumed_{rollout_id}.pt"), **LOOP, **STREAMING,
        num_rollout=3, rollout_seed_per_sample=True,
    )  # fmt: skip
    result = run_train(flags)
    assert "resumed from" in result.stderr and "at rollout 2" in result.stderr
    resumed = read_events(resumed_tb)
    assert [step for step, _ in resumed["train/loss"]] == [2]

    full, again = (torch.load(tmp_path / f"{run}_2.pt", weights_only=False) for run in ("full", "resumed"))
    for key in ("tokens", "response_lengths", "rewards", "loss_masks", "weight_versions"):
        assert full[key] == again[key], key  # weight versions: "3", not restarted at "1"
    for tag in ("train/loss", "train/pg_loss", "train/grad_norm", "rollout/raw_reward"):
        assert resumed[tag][0][1] == pytest.approx(scalars[tag][2][1], rel=1e-6, abs=1e-9), tag


def test_a_text_form_generate_trains_and_evaluates(tiny_run_flags, tmp_path):
    """The usage guide's custom generate (text to the router, ``sample.response`` set, no tokens) with
    chat prompts and a custom reward: before, its samples never finished and rollout 0 drew prompts
    until killed; now it trains (no engine log-probs, so no mismatch metrics) and evaluates.

    The run is also one epoch by ``--num-epoch`` alone (3 prompts, 2 per rollout: 1 rollout), known
    before the trainers build their LR schedule: before, --num-epoch without --num-rollout crashed
    after every process had started, and a wrong count would show in the linear decay's LR."""
    prompts, tb = write_chat_prompts(tmp_path / "chat.jsonl"), tmp_path / "tb"
    plugins = REPO / "tests/support/plugins/text_form_generate.py"
    flags = tiny_run_flags(
        "--tb-dir", str(tb), "--rollout-temperature", "0.7", "--input-key", "messages",
        "--custom-generate-function-path", f"{plugins}:text_generate",
        "--custom-rm-path", f"{plugins}:first_letter_reward",
        "--eval-prompt-data", "chat", str(prompts), "--eval-input-key", "messages", "--eval-interval", "1",
        **ONE_PER_SIDE, prompt_data=prompts, rm_type=None, num_rollout=None, num_epoch=1,
        lr_decay_style="linear", rollout_batch_size=2,
    )  # fmt: skip
    result = run_train(flags)
    assert "--num-epoch 1: 1 rollouts" in result.stderr
    scalars = read_events(tb)
    assert [step for step, _ in scalars["train/loss"]] == [0]
    assert [value for _, value in scalars["train/lr"]] == [0.0]  # after the one step of a decay over one
    assert scalars["train/ppo_kl"][0][1] < 1e-6 and scalars["train/grad_norm"][0][1] > 0
    assert "train/train_rollout_logprob_abs_diff" not in scalars
    assert [step for step, _ in scalars["eval/chat"]] == [-1, 0]


def test_ctrl_c_stops_every_process_of_the_run(tiny_run_flags):
    tag = uuid.uuid4().hex
    flags = tiny_run_flags(**LOOP, num_rollout=100)
    env = {**os.environ, "SLIME_TEST_RUN": tag}
    # As in a terminal: a test runner started in the background inherits SIGINT ignored, and so
    # would train.py (Python installs its KeyboardInterrupt handler only where SIGINT is not ignored).
    proc = subprocess.Popen(
        [sys.executable, "train.py", *flags],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for line in proc.stderr:
            if "rollout 0/100" in line:  # engines, router and trainers are all up and working
                break
        proc.send_signal(signal.SIGINT)
        _, remaining = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, remaining[-2000:]
    assert "interrupted" in remaining
    time.sleep(1)
    assert not processes_tagged(tag), processes_tagged(tag)
