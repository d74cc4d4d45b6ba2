"""PromptDataSource and Sample: reading, slicing, templating, grouping, epoch order, resume, bad input."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from slime.config import build_parser
from slime.config.settings.data import DataSettings
from slime.rollout.data_source import PromptDataSource
from slime.rollout.prompt_files import DataError, PromptFormat, load_prompts, load_sft_pairs, read_records
from slime.rollout.sample import Sample
from tests.support.rollouts import numbered, prompts_of, source, write_jsonl


def test_jsonl_fields_become_samples_and_blank_lines_are_skipped(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"input": "2+2?", "label": 4, "metadata": '{"src": "gsm"}', "tools": '[{"name": "calc"}]'},
            "",
            {"input": [{"role": "user", "content": "hi"}], "label": "x"},
        ],
    )
    first, second = load_prompts(path, PromptFormat(label_key="label", tool_key="tools"))
    assert first.prompt == "2+2?" and first.label == "4"
    assert first.metadata == {"src": "gsm", "tools": [{"name": "calc"}]}
    assert first.status is Sample.Status.PENDING and first.tokens == [] and first.index is None
    assert second.prompt == [{"role": "user", "content": "hi"}] and second.metadata == {}


def test_parquet_reads_like_jsonl_with_slices(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = numbered(6)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "metadata": json.dumps(r["metadata"])} for r in rows]), path)
    samples = load_prompts(f"{path}@[1:4]", PromptFormat(label_key="label"))
    assert [s.prompt for s in samples] == ["q1", "q2", "q3"]
    assert samples[0].metadata == {"i": 1}
    assert [r.where for r in read_records(f"{path}@[-2:]")] == [f"{path}:row 4", f"{path}:row 5"]


def test_jsonl_slices_count_records(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(5))
    assert [s.prompt for s in load_prompts(f"{path}@[3:]")] == ["q3", "q4"]
    assert [s.prompt for s in load_prompts(f"{path}@[:2]")] == ["q0", "q1"]
    assert [s.prompt for s in load_prompts(f"{path}@[-1:]")] == ["q4"]


def test_chat_template_renders_with_the_model_tokenizer(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"input": "sort 321"},
            {"input": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        ],
    )
    args = build_parser().parse_args(
        [
            "--prompt-data",
            path,
            "--hf-checkpoint",
            str(model),
            "--apply-chat-template",
            "--n-samples-per-prompt",
            "2",
        ]
    )
    settings = DataSettings.from_args(args)
    data = PromptDataSource.from_settings(settings, args)
    assert [s.prompt for s in data.prompts] == [
        "<|im_start|>user\nsort 321<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    ]
    # --rollout-max-prompt-len: prompts longer than that many tokens (character-level tokenizer) keep
    # their place in the order (len counts records) but are never served.
    capped = PromptDataSource.from_settings(dataclasses.replace(settings, max_prompt_len=30), args)
    assert len(capped) == 2
    assert prompts_of(capped.get_samples(3)) == [data.prompts[0].prompt] * 3


def test_groups_are_independent_copies_with_increasing_indices(tmp_path):
    data = source(tmp_path, n=3, n_samples_per_prompt=2)
    first = data.get_samples(2)
    second = data.get_samples(2)
    assert [[s.group_index for s in g] for g in first + second] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert [[s.index for s in g] for g in first + second] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert prompts_of(first + second) == ["q0", "q1", "q2", "q0"]  # wrapped into epoch 1
    first[0][0].metadata["seen"] = True
    assert "seen" not in first[0][1].metadata and "seen" not in data.prompts[0].metadata


def test_shuffle_is_seeded_per_epoch_and_every_epoch_covers_the_data(tmp_path):
    def epochs(seed: int) -> list[list[str]]:
        data = source(tmp_path, n=8, shuffle=True, seed=seed)
        return [prompts_of(data.get_samples(8)) for _ in range(3)]

    run = epochs(1)
    assert run == epochs(1)
    assert run != epochs(2)
    assert all(sorted(epoch) == sorted(f"q{i}" for i in range(8)) for epoch in run)
    assert run[0] != run[1]  # a fresh order each epoch
    assert prompts_of(source(tmp_path, n=8).get_samples(8)) == [f"q{i}" for i in range(8)]


def test_save_and_load_continue_exactly_where_the_run_stopped(tmp_path):
    def make() -> PromptDataSource:
        return source(tmp_path, n=5, n_samples_per_prompt=2, shuffle=True, seed=3)

    straight = make()
    expected = [straight.get_samples(3) for _ in range(4)]

    first = make()
    for _ in range(2):
        first.get_samples(3)
    path = first.save(1, tmp_path / "ckpt")
    assert path == tmp_path / "ckpt" / "rollout" / "data_source_1.json"
    saved = json.loads(path.read_text())
    assert saved == {
        "format": 1,
        "num_prompts": 5,
        "epoch": 1,
        "offset": 1,
        "next_group_index": 6,
        "next_sample_index": 12,
        "buffer": [],
    }

    resumed = make()
    assert resumed.load(1, tmp_path / "ckpt")
    rest = [resumed.get_samples(3) for _ in range(2)]
    assert [[s.to_dict() for g in r for s in g] for r in rest] == [
        [s.to_dict() for g in r for s in g] for r in expected[2:]
    ]
    assert not make().load(7, tmp_path / "ckpt")  # nothing saved there: a fresh start


def test_returned_groups_are_served_first_and_survive_a_resume(tmp_path):
    data = source(tmp_path, n=4)
    aborted = data.get_samples(2)
    aborted[1][0].response = "partial"
    data.add_samples([aborted[1]])
    data.save(0, tmp_path)
    resumed = source(tmp_path, n=4)
    resumed.load(0, tmp_path)
    for d in (data, resumed):
        groups = d.get_samples(2)
        assert [g[0].response for g in groups] == ["partial", ""]
        assert [g[0].group_index for g in groups] == [1, 2]
        assert prompts_of(groups) == ["q1", "q2"]


def test_loading_a_position_saved_for_other_data_is_an_error(tmp_path):
    source(tmp_path, n=5).save(0, tmp_path)
    with pytest.raises(DataError, match="saved data source position is for 5 prompts, the data now has 3"):
        source(tmp_path, n=3).load(0, tmp_path)


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "a"}, "", '{"input": "b",}'])
    with pytest.raises(
        DataError, match=rf"^{re.escape(path)}:3: not valid JSON \(.*\); fix or remove the line$"
    ):
        load_prompts(path)
    path = write_jsonl(tmp_path / "e.jsonl", ['["a"]'])
    with pytest.raises(DataError, match=rf"^{re.escape(path)}:1: expected a JSON object per line, got list$"):
        load_prompts(path)


def test_missing_key_names_the_key_the_place_and_the_keys_present(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"question": "a"}, {"question": "b"}, {"prompt": "c", "answer": 1}]
    )
    with pytest.raises(DataError) as error:
        load_prompts(path, PromptFormat(input_key="question"))
    assert (
        error.value.line()
        == f"error: --input-key 'question' not found in {path}:3; keys present: prompt, answer"
    )
    with pytest.raises(
        DataError, match=rf"--label-key 'label' not found in {re.escape(path)}:1; keys present: question"
    ):
        load_prompts(path, PromptFormat(input_key="question", label_key="label"))


def test_bad_field_types_are_errors(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": 3}])
    with pytest.raises(
        DataError, match=rf"--input-key 'input' in {re.escape(path)}:1 must be a string or .* got int"
    ):
        load_prompts(path)
    path = write_jsonl(tmp_path / "e.jsonl", [{"input": "a", "metadata": "{oops"}])
    with pytest.raises(
        DataError, match=rf"--metadata-key 'metadata' in {re.escape(path)}:1 is a string but not valid JSON"
    ):
        load_prompts(path)


def test_empty_data_or_empty_slice_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", "  "])
    with pytest.raises(DataError, match="no records"):
        load_prompts(path)
    path = write_jsonl(tmp_path / "e.jsonl", numbered(3))
    with pytest.raises(DataError, match=r"the slice @\[5:9\] selects no records"):
        load_prompts(f"{path}@[5:9]")
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_sft_pairs_are_read_with_the_same_checks(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "1+1", "a": "2"}, {"q": "2+2", "a": "4"}, {"q": "x"}])
    assert load_sft_pairs(f"{path}@[:2]", "q", "a") == [("1+1", "2"), ("2+2", "4")]
    with pytest.raises(
        DataError, match=rf"response key 'a' not found in {re.escape(path)}:3; keys present: q"
    ):
        load_sft_pairs(path, "q", "a")


def test_sample_round_trips_through_json():
    sample = Sample(
        group_index=1,
        index=3,
        prompt=[{"role": "user", "content": "hi"}],
        tokens=[5, 6, 7, 8],
        response="ok",
        response_length=1,
        reward={"acc": 1.0},
        loss_mask=[1],
        rollout_log_probs=[-0.5],
        status=Sample.Status.TRUNCATED,
        weight_versions=["2"],
    )
    assert sample.prompt_length == 3
    assert Sample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample
    assert sample.reward_value("acc") == 1.0
    with pytest.raises(ValueError, match="pass --reward-key"):
        sample.reward_value()


def test_num_epoch_gives_whole_rollouts_of_the_prompts_and_names_what_to_pass() -> None:
    from slime.config import ConfigError
    from slime.rollout.data_source import rollouts_for_epochs

    assert rollouts_for_epochs(list(range(8)), 1, 4) == 2
    assert rollouts_for_epochs(list(range(10)), 3, 4) == 7  # 30 prompts: 7 whole rollouts, 2 start pass 4
    with pytest.raises(ConfigError, match=r"1 pass\(es\) over 3 prompts do not fill one rollout"):
        rollouts_for_epochs(list(range(3)), 1, 4)
    with pytest.raises(ConfigError, match="has no length"):
        rollouts_for_epochs(object(), 1, 4)


def test_the_position_kept_before_a_rollout_is_what_a_stopped_run_checkpoints(tmp_path):
    """A run that stops in rollout 1 checkpoints rollout 0 with the position after rollout 0's prompts,
    not after what rollout 1 had drawn when it failed; stopped right after rollout 1 (at its push), the
    current position is rollout 1's."""
    from slime.rollout.data_source import KeptPositions

    data = source(tmp_path, n=6)
    kept = KeptPositions(data, tmp_path / "kept")
    assert prompts_of(data.get_samples(2)) == ["q0", "q1"]  # rollout 0
    kept.keep(0)  # rollout 1 begins
    assert prompts_of(data.get_samples(2)) == ["q2", "q3"]
    kept.save_after(0, tmp_path / "ckpt")
    resumed = source(tmp_path, n=6)
    assert resumed.load(0, tmp_path / "ckpt")
    assert prompts_of(resumed.get_samples(2)) == ["q2", "q3"]  # rollout 1 again
    kept.generated = 1
    kept.save_after(1, tmp_path / "ckpt")
    assert resumed.load(1, tmp_path / "ckpt") and prompts_of(resumed.get_samples(2)) == ["q4", "q5"]
    with pytest.raises(RuntimeError, match="no data position after rollout 3"):
        kept.save_after(3, tmp_path / "ckpt")
