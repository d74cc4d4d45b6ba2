"""The RL loop end to end on CPU: 2 torch engines behind the router, 2 Megatron trainer ranks, GRPO.

One test drives the session's running stack of its layout (``stack``: the engines can be inspected
while they are up); the others run ``train.py``'s ``train`` in-process on the session's Ray (what
they read is what a run leaves: scalars, checkpoints, dumps, log lines) and resume it from its
checkpoint; Ctrl-C, which is about the process, runs ``train.py`` as a user does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import ray
import torch

from slime.engine_client.calls import EngineCallError
from slime.utils.http import get_json, post_json_sync
from tests.support.engines import engine_state, engine_weights_equal
from tests.support.in_process import train_in_process
from tests.support.paths import REPO
from tests.support.plugins.text_form_generate import write_chat_prompts
from tests.support.train_runs import LOOP, ONE_PER_SIDE, processes_tagged, read_events

pytestmark = pytest.mark.e2e


STREAMING = {"streaming_data": True, "num_data_workers": "2"}


def engine_paused(url: str) -> bool:
    return engine_state(url)["paused"]


def pushed_version(url: str) -> int:
    """The last version pushed to the engine at ``url`` (0 before any push: SGLang's ``"default"``)."""
    version = get_json(f"{url}/model_info")["weight_version"]
    return int(version) if version.isdigit() else 0


# Without weight-update sessions (0.5.19, DP 2) and with them (0.5.23, PP 2: both stages push inside
# the one session each engine has); at the temperature users run, with the trainer's own old log-probs
# and with the engine's (--use-rollout-logprobs). The stack is the session's of its layout
# (tests.support.stacks): this test leaves it as it found it, its weight-update groups rebuilt; that
# no engine or router process outlives it is checked when the stack closes.
@pytest.mark.parametrize("layout", ["dp2-sglang-0.5.19", "pp2-sglang-0.5.23"])
def test_session_pushes_trainer_weights_to_every_engine(stack, layout):
    from slime.engine_client.protocol import probe_engine_api

    session = stack(layout)
    urls = ray.get(session.rollout.engine_urls.remote())
    base = pushed_version(urls[0])
    session.push_weights(base + 1)
    data = ray.get(session.rollout.generate.remote(0)).data
    session.pause_for_push()  # as train.py: the engines pause while the trainer trains
    metrics = session.trainer.train(data)[0]
    assert all(engine_paused(url) for url in urls)
    assert metrics["ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["train_rollout_logprob_abs_diff"] < 1e-3
    session.push_weights(base + 2)
    session.engines_resumed()  # the push returns while the engines resume; generation waits for it
    expected = session.trainer.hf_state_dict()
    assert len(urls) == 2
    for url in urls:
        assert not engine_paused(url)
        assert probe_engine_api(url).weight_update_sessions == layout.endswith("0.5.23")
        assert get_json(f"{url}/model_info")["weight_version"] == str(base + 2)
        engine_weights_equal(url, expected)

    # An engine that lost its weight-update group refuses the next bucket at once, while the
    # other joins the broadcast: the push fails with the engine's own words within seconds
    # (not after --update-weights-timeout), and the next push opens a new group and succeeds.
    groups = {"group_name": "slime-pp0"}
    assert post_json_sync(f"{urls[1]}/destroy_weights_update_group", groups)["success"]
    started = time.monotonic()
    with pytest.raises(EngineCallError) as refused:
        session.push_weights(base + 3)
    assert time.monotonic() - started < 10
    assert f"engine {urls[1]} refused /update_weights_from_distributed" in str(refused.value)
    assert "group 'slime-pp0' does not exist" in str(refused.value)
    session.push_weights(base + 4)
    for url in urls:
        assert get_json(f"{url}/model_info")["weight_version"] == str(base + 4)
        engine_weights_equal(url, expected)


REQUIRED_SCALARS = (
    "rollout/raw_reward", "rollout/response_length", "rollout/truncated_ratio",
    "train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/kl_loss", "train/entropy",
    "train/grad_norm", "train/lr", "train/train_rollout_logprob_abs_diff",
    "perf/rollout_time", "perf/train_time", "perf/update_weights_time", "perf/tokens_per_sec",
)  # fmt: skip


def test_train_py_runs_grpo_logs_every_scalar_and_resumes_exactly(ray_cluster, tiny_run_flags, tmp_path):
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
    train_in_process(flags)
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
    result = train_in_process(flags)
    assert "resumed from" in result.log and "at rollout 2" in result.log
    resumed = read_events(resumed_tb)
    assert [step for step, _ in resumed["train/loss"]] == [2]

    full, again = (torch.load(tmp_path / f"{run}_2.pt", weights_only=False) for run in ("full", "resumed"))
    for key in ("tokens", "response_lengths", "rewards", "loss_masks", "weight_versions"):
        assert full[key] == again[key], key  # weight versions: "3", not restarted at "1"
    for tag in ("train/loss", "train/pg_loss", "train/grad_norm", "rollout/raw_reward"):
        assert resumed[tag][0][1] == pytest.approx(scalars[tag][2][1], rel=1e-6, abs=1e-9), tag


def test_a_text_form_generate_trains_and_evaluates(ray_cluster, tiny_run_flags, tmp_path):
    """The usage guide's custom generate (text to the router, ``sample.response`` set, no tokens) with
    chat prompts and a custom reward: before, its samples never finished and rollout 0 drew prompts
    until killed; now it trains (no engine log-probs, so no mismatch metrics) and evaluates."""
    prompts, tb = write_chat_prompts(tmp_path / "chat.jsonl"), tmp_path / "tb"
    plugins = REPO / "tests/support/plugins/text_form_generate.py"
    flags = tiny_run_flags(
        "--tb-dir", str(tb), "--rollout-temperature", "0.7", "--input-key", "messages",
        "--custom-generate-function-path", f"{plugins}:text_generate",
        "--custom-rm-path", f"{plugins}:first_letter_reward",
        "--eval-prompt-data", "chat", str(prompts), "--eval-input-key", "messages", "--eval-interval", "1",
        **ONE_PER_SIDE, prompt_data=prompts, rm_type=None, num_rollout=1, rollout_batch_size=2,
    )  # fmt: skip
    train_in_process(flags)
    scalars = read_events(tb)
    assert [step for step, _ in scalars["train/loss"]] == [0]
    assert scalars["train/ppo_kl"][0][1] < 1e-6 and scalars["train/grad_norm"][0][1] > 0
    assert "train/train_rollout_logprob_abs_diff" not in scalars
    assert [step for step, _ in scalars["eval/chat"]] == [-1, 0]


def test_num_epoch_alone_sets_the_run_length_before_the_lr_schedule(ray_cluster, tiny_run_flags, tmp_path):
    """One epoch by ``--num-epoch`` alone (8 prompts, 6 per rollout: 1 rollout, the incomplete second
    dropped), known before the trainers build their LR schedule: before, --num-epoch without
    --num-rollout crashed after every process had started, and a wrong count would show in the
    linear decay's LR."""
    tb = tmp_path / "tb"
    flags = tiny_run_flags(
        "--tb-dir", str(tb), **(ONE_PER_SIDE | {"n_samples_per_prompt": 2, "rollout_max_response_len": 2}),
        num_rollout=None, num_epoch=1, lr_decay_style="linear", rollout_batch_size=6,
    )  # fmt: skip
    result = train_in_process(flags)
    assert "--num-epoch 1: 1 rollouts" in result.log
    scalars = read_events(tb)
    assert [step for step, _ in scalars["train/loss"]] == [0]
    assert [value for _, value in scalars["train/lr"]] == [0.0]  # after the one step of a decay over one


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
