"""--update-weight-transport disk end to end on CPU, with one engine of the run and one from outside it.

The test starts a torch engine itself (as a user would start an SGLang server elsewhere) and passes it
with --rollout-external-engine-addrs. Two rollouts: both engines serve rollouts through the router,
both load each version's safetensors snapshot and then equal the trainer, only the latest snapshot is
kept, and the external engine is still serving after the run stopped everything it started.
"""

from __future__ import annotations

import pytest
import ray
import torch

from slime.backends.engine_server import start_engine_server
from slime.backends.torch_engine.launcher import serving
from slime.cli import check_implemented
from slime.config import parse_args
from slime.utils.http import get_json, is_ok, post_json_sync
from tests.support.engines import engine_state
from tests.support.models import model_args


@pytest.fixture
def external_engine(tiny_models, tmp_path):
    # The oldest supported release, while the run's own engine mirrors the newest: one push reaches both.
    command = serving(tiny_models["qwen2"], "--random-seed", "7", "--sglang-release", "0.5.19")
    env = {"OMP_NUM_THREADS": "1"}
    server = start_engine_server(
        "external engine", command, tmp_path / "external.log", timeout_s=120, env=env
    )
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_disk_transport_updates_own_and_external_engines(
    ray_cluster, tiny_run_flags, tmp_path, external_engine
):
    from slime.config.settings.run import RunSettings
    from slime.ray.session import TrainingSession

    snapshots = tmp_path / "snapshots"
    flags = tiny_run_flags(
        rollout_num_gpus=1,
        update_weight_transport="disk",
        update_weight_disk_dir=snapshots,
        rollout_external_engine_addrs=external_engine.removeprefix("http://"),
    )
    args = parse_args(flags)
    check_implemented(args)
    with TrainingSession(RunSettings.from_args(args)) as session:
        assert session.external_urls == [external_engine]
        urls = session.engine_urls + session.external_urls
        router = ray.get(session.rollout.router_url.remote())
        assert external_engine in [w["url"] for w in get_json(f"{router}/workers")["workers"]]
        session.push_weights(1)
        for rollout_id in range(2):
            served_before = finished(external_engine)
            batch = ray.get(session.rollout.generate.remote(rollout_id))
            assert finished(external_engine) > served_before  # the router sends it rollout requests
            session.trainer.train(batch.data)
            version = str(rollout_id + 2)
            session.push_weights(rollout_id + 2)
            assert sorted(p.name for p in snapshots.iterdir()) == [f"weights_v{version}"]
            expected = session.trainer.hf_state_dict()
            for url in urls:
                info = get_json(f"{url}/get_model_info")
                assert info["weight_version"] == version
                assert info["model_path"] == str((snapshots / f"weights_v{version}").resolve())
                for name, tensor in expected.items():
                    values = post_json_sync(
                        f"{url}/get_weights_by_name", {"name": name, "truncate_size": tensor.numel()}
                    )
                    assert torch.equal(torch.tensor(values).flatten(), tensor.flatten().float()), (url, name)
    assert is_ok(f"{external_engine}/health_generate")  # the run never stops an engine it did not start


def finished(url: str) -> int:
    return engine_state(url)["finished_requests"]


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (("--update-weight-transport", "disk"), "--update-weight-disk-dir"),
        (("--update-weight-disk-dir", "/tmp/x"), "--update-weight-disk-dir"),
        (("--rollout-external-engine-addrs", "nohostport"), "--rollout-external-engine-addrs"),
        (("--colocate", "--rollout-external-engine-addrs", "h:1"), "--rollout-external-engine-addrs"),
    ],
)
def test_disk_and_external_engine_flags_are_checked_before_start(tiny_models, tmp_path, capsys, extra, flag):
    data = tmp_path / "train.jsonl"
    data.write_text('{"input": "abc", "label": "cba"}\n')
    argv = [*model_args(), "--hf-checkpoint", str(tiny_models["qwen2"]), "--prompt-data", str(data)]
    argv += ["--rollout-batch-size", "4", "--lr", "1e-6", "--num-rollout", "1"]
    if "--colocate" not in extra:
        argv += ["--rollout-num-gpus", "1"]
    with pytest.raises(SystemExit) as exc:
        parse_args([*argv, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {flag}: "), err
