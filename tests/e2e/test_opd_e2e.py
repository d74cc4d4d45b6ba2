"""On-policy distillation through the loop ``train.py`` runs, with a teacher engine group the run starts
itself: the teacher is the student's own starting checkpoint, so at rollout 0 the teacher's log-prob of
every sampled token must equal the student's (a teacher reply read one position off would not), and
once the student has moved the reverse KL to the teacher grows. The teacher's engines stop with the run.

At temperature 1, as upstream's OPD example runs: SGLang scores prompts on raw logits, so at another
rollout temperature the teacher's log-probs are at 1 and the student's at it (the run warns)."""

from __future__ import annotations

import pytest
import requests

from slime.config import parse_args


@pytest.mark.e2e
def test_opd_with_a_teacher_engine_group(ray_cluster, tiny_run_flags, tiny_models):
    import ray

    from slime.cli import check_implemented
    from slime.config.settings.run import RunSettings
    from slime.ray.loop import RolloutLoop
    from slime.ray.session import TrainingSession

    flags = tiny_run_flags(
        "--use-opd", "--opd-teacher-hf-checkpoint", str(tiny_models["qwen2"]), "--opd-kl-coef", "0.5",
        num_rollout=2, lr="1e-2", rollout_temperature="1.0", rollout_num_gpus=1,
    )  # fmt: skip
    args = parse_args(flags)
    check_implemented(args)
    seen = []
    with TrainingSession(RunSettings.from_args(args)) as session, RolloutLoop(session) as loop:
        teachers = ray.get(session.rollout.teacher_urls.remote())
        assert len(teachers) == 1 and teachers[0] not in session.engine_urls
        for rollout_id in loop.rollout_ids():
            batch = loop.generate(rollout_id)
            assert len(batch.data["teacher_log_probs"]) == len(batch.data["tokens"])
            session.hand_gpus_to_trainer()
            metrics = loop.train(batch)
            seen.append({k: v for k, v in metrics.items() if k.startswith("train/opd/")})
            loop.push_weights()
            session.hand_gpus_to_engines()
            loop.finish(rollout_id, metrics)
    print(seen)
    first, second = seen
    assert first["train/opd/reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert first["train/opd/teacher_logprob"] < -0.01
    assert abs(second["train/opd/reverse_kl"]) > 1e-3
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{teachers[0]}/health", timeout=5)
