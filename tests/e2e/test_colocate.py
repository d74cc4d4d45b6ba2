"""--colocate end to end on CPU: two torch engines on the trainer's two bundles, taking turns with it.

Per rollout the engines release their memory, the trainer brings its state back, trains and sends it
away again, the engines take their weights' memory back, receive the weights in place (shared-memory
handles through /update_weights_from_tensor) and then their KV cache. Checked after every sync: every
engine tensor equals the trainer's, and both sides' recorded memory events came in that order.
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys

import pytest
import ray
import torch

from slime.cli import check_implemented
from slime.config import parse_args
from slime.utils.http import get_json, post_json_sync
from tests.support.models import model_args


def assert_engines_equal_trainer(session, urls: list[str], version: str) -> dict[str, torch.Tensor]:
    expected = session.trainer.hf_state_dict()
    for url in urls:
        assert get_json(f"{url}/model_info")["weight_version"] == version
        for name, tensor in expected.items():
            values = post_json_sync(
                f"{url}/get_weights_by_name", {"name": name, "truncate_size": tensor.numel()}
            )
            assert torch.equal(torch.tensor(values).flatten(), tensor.flatten().float()), (url, name)
    return expected


def trainer_steps(session, start: int) -> list[tuple[str, str]]:
    return [(e.event, e.tag) for e in session.trainer.memory_events()[start:]]


def engine_events(url: str) -> list[dict]:
    return get_json(f"{url}/get_server_info")["memory_events"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("release", ["0.5.19", "0.5.23"])  # tensor updates without and within sessions
def test_colocated_rollouts_hand_weights_over_in_place(
    ray_cluster, tiny_run_flags, release, tmp_path, monkeypatch
):
    from slime.config.settings.run import RunSettings
    from slime.ray.session import TrainingSession
    from slime.utils.startup import STARTUP_LOG_ENV, read_marks

    flags = tiny_run_flags(
        "--colocate",
        "--torch-engine-sglang-release",
        release,
        actor_num_gpus_per_node=2,
        entropy_coef="0.05",  # a gradient whatever the rewards: every sync carries new weights
        update_weight_buffer_size=64 * 1024,  # several buckets: the version flips with the last
    )
    args = parse_args(flags)
    check_implemented(args)
    assert args.rollout_num_gpus == 2 and args.update_weight_transport == "tensor"
    marks_log = tmp_path / "startup.jsonl"
    monkeypatch.setenv(STARTUP_LOG_ENV, str(marks_log))  # this process's marks (the driver's)
    with TrainingSession(RunSettings.from_args(args)) as session:
        urls = session.engine_urls
        assert len(urls) == 2
        # The engines first, then the trainer on the GPUs they released: both marked, in that order.
        ready = ["driver: engines ready", "driver: trainers ready"]
        assert [m["what"] for m in read_marks(marks_log) if m["what"] in ready] == ready
        # Start-up: the engines gave their memory back before the trainer built its model on the same
        # GPUs, and the trainer has moved nothing yet (before: engines and trainer both held it).
        for url in urls:
            assert [(e["event"], e["tags"]) for e in engine_events(url)] == [
                ("release_memory_occupation", ["weights", "kv_cache"])
            ]
        assert session.trainer.memory_events() == []
        released_at = max(engine_events(url)[0]["at"] for url in urls)
        session.push_weights(1)
        session.hand_gpus_to_engines()  # the trainer's state leaves its GPU; the engines keep theirs
        assert trainer_steps(session, 0) == [("offload", "train_state"), ("offload", "weights")]
        assert released_at < session.trainer.memory_events()[0].at
        previous = assert_engines_equal_trainer(session, urls, "1")
        before = {url: len(engine_events(url)) for url in urls}
        for rollout_id in range(2):
            data = ray.get(session.rollout.generate.remote(rollout_id)).data
            mark = len(session.trainer.memory_events())
            session.hand_gpus_to_trainer()
            refused = post_json_sync_status(urls[0])
            assert refused == 503  # released engines do not generate
            metrics = session.trainer.train(data)[0]
            assert metrics["grad_norm"] > 0
            session.push_weights(rollout_id + 2)
            session.hand_gpus_to_engines()
            # Rank 0 of the trainer: its state back before training, the optimizer state away before
            # the engines resume, the weights away after the handoff.
            assert trainer_steps(session, mark) == [
                ("onload", "weights"),
                ("onload", "train_state"),
                ("offload", "train_state"),
                ("offload", "weights"),
            ]
            onload_w, onload_s, offload_s, offload_w = session.trainer.memory_events()[mark:]
            assert onload_w.bytes == offload_w.bytes > 0 and 0 < onload_s.bytes <= offload_s.bytes
            assert all(e.how == "storage_swap" for e in (onload_w, onload_s, offload_s, offload_w))
            synced = assert_engines_equal_trainer(session, urls, str(rollout_id + 2))
            assert any(not torch.equal(synced[n], previous[n]) for n in synced)  # new weights arrived
            previous = synced

        for url in urls:
            events = engine_events(url)[before[url] :]
            memory = [(e["event"], tuple(e.get("tags") or ())) for e in events if "memory" in e["event"]]
            assert memory == 2 * [
                ("release_memory_occupation", ("weights", "kv_cache")),
                ("resume_memory_occupation", ("weights",)),
                ("resume_memory_occupation", ("kv_cache",)),
            ]
            # Each handoff lands between the two resumes; the last call sets the version.
            per_rollout = [events[i : i + len(events) // 2] for i in (0, len(events) // 2)]
            for rollout_id, part in enumerate(per_rollout):
                names = [e["event"] for e in part]
                first, last = names.index("update_weights_from_tensor"), len(names) - 2
                assert names[:2] == ["release_memory_occupation", "resume_memory_occupation"]
                assert set(names[first : last + 1]) == {"update_weights_from_tensor"} and last > first
                assert names[-1] == "resume_memory_occupation"
                assert part[last]["version"] == str(rollout_id + 2)

        # Cross-process order of the last rollout: optimizer state gone before the engine's weights came
        # back, trainer weights gone only after the engine loaded the last bucket.
        last_events = engine_events(urls[0])
        resume_weights = [e for e in last_events if e.get("tags") == ["weights"]][-1]["at"]
        last_load = [e for e in last_events if e["event"] == "update_weights_from_tensor"][-1]["at"]
        assert offload_s.at <= resume_weights <= last_load <= offload_w.at


def post_json_sync_status(url: str) -> int:
    from slime.utils.http import HttpError

    try:
        post_json_sync(f"{url}/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    except HttpError as exc:
        return exc.status
    return 200


# ---- the pieces, without Ray ---------------------------------------------------------------------


def test_handles_map_the_senders_shared_memory_in_another_process():
    """A packed bucket pickles as SGLang's flattened_bucket payload whose buffer another process maps."""
    from slime.weight_sync import ipc

    named = [("a.weight", torch.arange(6.0).reshape(2, 3)), ("b.bias", torch.full((4,), 7.0))]
    staging = ipc.StagingBuffer()
    bucket = staging.pack(named)
    entry = ipc.serialize(bucket.payload())
    assert len(entry) < 2000  # a handle, not the bytes
    meta = bucket.metadata[1]
    assert (meta.name, tuple(meta.shape), meta.dtype, meta.start_idx, meta.end_idx) == (
        "b.bias",
        (4,),
        torch.float32,
        24,
        40,
    )
    child = (
        "import sys, torch; from slime.weight_sync import ipc\n"
        "pairs = ipc.named_tensors_from_payload(ipc.deserialize(sys.stdin.read()), 'flattened_bucket')\n"
        "print([(n, t.sum().item()) for n, t in pairs]); pairs[0][1][0, 0] = 42.0\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", child], input=entry, capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "[('a.weight', 15.0), ('b.bias', 28.0)]"
    assert bucket.named_tensors()[0][1][0, 0].item() == 42.0  # the child wrote into the same memory
    with pytest.raises(ValueError, match="one dtype"):
        ipc.FlattenedBucket.from_named_tensors(
            [("x", torch.zeros(2)), ("y", torch.zeros(2, dtype=torch.int64))]
        )


def test_safe_unpickler_refuses_anything_but_tensor_payloads():
    import base64
    import os

    from slime.weight_sync import ipc

    evil = base64.b64encode(pickle.dumps(os.getcwd)).decode()
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.getcwd"):
        ipc.deserialize(evil)


def test_device_memory_frees_storages_and_restores_them_intact():
    from slime.utils.memory import DeviceMemory

    buffer = torch.arange(12.0)
    params = [buffer[:6].view(2, 3), buffer[6:]]  # views of one storage, as Megatron's parameters are
    state = [torch.ones(5)]
    memory = DeviceMemory()
    assert memory.offload("weights", params) == 48
    assert memory.offload("train_state", state + params, claimed={buffer.untyped_storage().data_ptr()}) == 20
    assert buffer.untyped_storage().nbytes() == 0 and state[0].untyped_storage().nbytes() == 0
    assert memory.offload("weights", params) == 0  # already away
    assert memory.onload("weights") == 48 and memory.onload("train_state") == 20
    assert torch.equal(buffer, torch.arange(12.0)) and torch.equal(params[1], torch.arange(6.0, 12.0))
    assert torch.equal(state[0], torch.ones(5))
    assert [(e.event, e.tag, e.bytes) for e in memory.events] == [
        ("offload", "weights", 48),
        ("offload", "train_state", 20),
        ("onload", "weights", 48),
        ("onload", "train_state", 20),
    ]


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (("--colocate", "--update-weight-transport", "distributed"), "--update-weight-transport"),
        (("--rollout-num-gpus", "1", "--update-weight-transport", "tensor"), "--update-weight-transport"),
        (
            ("--colocate", "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"),
            "--colocate",
        ),
        (("--colocate", "--update-weights-interval", "2"), "--update-weights-interval"),
        # SGLang dies at start on --enable-memory-saver without torch_memory_saver (not installed here).
        (("--colocate", "--rollout-backend", "sglang"), "--colocate"),
    ],
)
def test_colocation_flags_that_cannot_work_are_one_line_errors(
    tiny_models, reverse_task, capsys, extra, flag
):
    argv = [*model_args(), "--hf-checkpoint", str(tiny_models["qwen2"]), "--prompt-data", str(reverse_task)]
    argv += ["--rollout-batch-size", "4", "--lr", "1e-6", "--num-rollout", "1", *extra]
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {flag}: "), err


@pytest.mark.skipif(
    importlib.util.find_spec("torch_memory_saver") is not None, reason="SGLang can colocate here"
)
@pytest.mark.parametrize("gpu", [False, True])
def test_colocate_with_sglang_says_it_needs_gpus_where_there_are_none(
    tiny_models, reverse_task, capsys, monkeypatch, gpu
):
    """Without a GPU, installing torch_memory_saver (CUDA only) cannot help: the error says so. The
    torch engine colocates on CPU (the tests above), so only SGLang's case is refused."""
    monkeypatch.setattr("slime.utils.hardware.has_gpu", lambda: gpu)
    argv = [*model_args(), "--hf-checkpoint", str(tiny_models["qwen2"]), "--prompt-data", str(reverse_task)]
    argv += ["--rollout-batch-size", "4", "--lr", "1e-6", "--num-rollout", "1"]
    with pytest.raises(SystemExit):
        parse_args([*argv, "--colocate", "--rollout-backend", "sglang"])
    err = capsys.readouterr().err.strip().splitlines()
    if gpu:
        assert err == [
            "error: --colocate: starts SGLang with --enable-memory-saver, which needs the Python package "
            "torch_memory_saver, not installed here; pip install torch_memory_saver (the Docker image "
            "has it) or drop --colocate"
        ]
    else:
        assert err == [
            "error: --colocate: needs GPUs with SGLang engines (they take turns on them through "
            "--enable-memory-saver, which pauses CUDA memory) and no GPU is visible here; run on GPU "
            "nodes, or use --rollout-backend torch, which colocates on CPU"
        ]
