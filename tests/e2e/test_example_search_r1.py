"""examples/search-r1: the BM25 retriever finds the passage a question is built from, the reward is
Search-R1's exact match on what the model wrote, the generate loop appends retrieved passages with loss
mask 0, and ``bash examples/search-r1/run.sh`` trains 2 rollouts on the tiny model."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from types import ModuleType

import pytest
import torch

from slime.rollout.generate_utils import (
    Turn,
    append_env_output,
    append_model_turn,
    cached_tokenizer,
    start_sample,
)
from slime.rollout.sample import Sample

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples/search-r1"


def _load(name: str) -> ModuleType:
    """A module of the example folder (its name has a hyphen, so it is no package)."""
    spec = importlib.util.spec_from_file_location(f"search_r1_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


search = _load("generate_with_search")
make_data = _load("make_data")


@pytest.fixture(scope="module")
def world() -> tuple[list[dict], list[dict]]:
    return make_data.make_world(num_countries=40, seed=0)


def test_bm25_ranks_the_source_passage_first(world):
    passages, questions = world
    retriever = search.BM25(passages)
    for passage in passages:  # a query made of the passage's own words finds that passage first
        assert retriever.search(passage["text"], k=1) == [passage]
    for q in questions:  # each question's best passage holds its answer, about the country asked for
        best = retriever.search(q["question"], k=search.TOP_K)[0]
        assert q["answer"] in best["text"] and best["title"] in q["question"], (q, best)
    assert retriever.search("zzz qqq") == []
    assert search.information([]) == "\n<information>No results.</information>\n"


def test_bm25_scores_rare_terms_higher_and_length_normalises():
    retriever = search.BM25(
        [
            {"title": "A", "text": "apple banana"},
            {"title": "B", "text": "apple cherry"},
            {"title": "C", "text": "apple banana cherry durian elderberry fig grape"},
        ]
    )
    assert [p["title"] for p in retriever.search("cherry apple", k=3)] == ["B", "C", "A"]
    assert [p["title"] for p in retriever.search("banana", k=3)] == ["A", "C"]  # the shorter passage first


def test_parse_action():
    assert search.parse_action("I think <search> capital of Kalo </search>") == ("search", "capital of Kalo")
    assert search.parse_action("<answer>Mirfa</answer>") == ("answer", "Mirfa")
    assert search.parse_action("<search>unclosed") == (None, "")
    assert search.parse_action("<search>x<answer>y</answer>") == ("answer", "y")


@pytest.mark.parametrize(
    ("text", "label", "reward"),
    [
        ("<answer>Logor</answer>", ["Logor"], 1.0),
        ("<answer> the logor. </answer>", ["Logor"], 1.0),  # case, articles, punctuation
        ("<answer>Logor City</answer>", ["Logor"], 0.0),  # exact, not contained
        ("Logor", ["Logor"], 0.0),  # no answer tag
        ("<answer>Drifa</answer> then <answer>Logor</answer>", ["Logor"], 1.0),  # the last one counts
        ("<answer>Logor</answer> then <answer>Drifa</answer>", ["Logor"], 0.0),
        ("<answer>1635</answer>", "1635", 1.0),  # a plain string label
        ("<answer>Roska  Sulros</answer>", ["Someone", "Roska Sulros"], 1.0),  # any accepted answer
        ("<answer>Paris</answer>", {"ground_truth": {"target": ["paris"]}}, 1.0),  # Search-R1's column
    ],
)
def test_exact_match(text, label, reward):
    assert search.exact_match(text, label) == reward


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, world) -> Path:
    path = tmp_path_factory.mktemp("search_r1") / "corpus.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in world[0]))
    return path


def _sample(corpus: Path, question: str, label: str) -> Sample:
    prompt = make_data.PROMPT.format(question=question)
    return Sample(prompt=prompt, label=[label], index=0, metadata={"corpus": str(corpus)})


def _scripted(args: argparse.Namespace, turns: list[tuple[str, Sample.Status]]):
    """A stand-in for ``generate_turn`` answering with ``turns`` in order (the tiny model never searches)."""
    tokenizer = cached_tokenizer(args.hf_checkpoint)
    pending = list(turns)

    async def generate_turn(args, input_ids, sampling_params, index=None, routes=None):
        assert sampling_params["stop"][-2:] == search.STOPS
        text, status = pending.pop(0)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: sampling_params["max_new_tokens"]]
        return Turn(ids, [-0.5] * len(ids), text, status, "1", {"type": "stop"})

    return generate_turn


def test_generate_searches_appends_masked_information_and_scores_the_answer(
    tiny_models, corpus, world, monkeypatch
):
    args = argparse.Namespace(hf_checkpoint=str(tiny_models["qwen2"]), max_turns=3)
    question = next(q for q in world[1] if q["question"].startswith("What is the capital"))
    query = question["question"].removeprefix("What is the ").removesuffix("?")
    monkeypatch.setattr(
        search,
        "generate_turn",
        _scripted(
            args,
            [
                (f"<search>{query}</search>", Sample.Status.COMPLETED),
                (f"<answer>{question['answer']}</answer>", Sample.Status.COMPLETED),
            ],
        ),
    )
    sample = _sample(corpus, question["question"], question["answer"])
    asyncio.run(search.generate(args, sample, {"max_new_tokens": 256, "stop": None}))

    reply = search.information(search.load_retriever(str(corpus)).search(query))
    assert question["answer"] in reply
    assert sample.response == f"<search>{query}</search>{reply}<answer>{question['answer']}</answer>"
    n_search, n_reply = len(f"<search>{query}</search>"), len(reply)  # one token per character
    assert sample.loss_mask == [1] * n_search + [0] * n_reply + [1] * (
        sample.response_length - n_search - n_reply
    )
    assert sample.rollout_log_probs[n_search : n_search + n_reply] == [0.0] * n_reply
    assert sample.status is Sample.Status.COMPLETED and sample.metadata["searches"] == [query]
    assert search.reward_func(args, sample) == 1.0


def test_generate_reminds_of_the_format_and_stops_at_the_turn_limit(tiny_models, corpus, monkeypatch):
    args = argparse.Namespace(hf_checkpoint=str(tiny_models["qwen2"]), max_turns=2)
    ramble = ("x" * search.TURN_TOKENS, Sample.Status.TRUNCATED)
    monkeypatch.setattr(search, "generate_turn", _scripted(args, [ramble, ramble]))
    sample = _sample(corpus, "Who founded Kalo?", "Mir Ka")
    asyncio.run(search.generate(args, sample, {"max_new_tokens": 256}))
    assert sample.response == ramble[0] + search.INVALID + ramble[0]  # no reply after the last turn
    assert sample.status is Sample.Status.TRUNCATED and len(sample.turn_spans) == 2
    assert search.reward_func(args, sample) == 0.0


def test_reward_reads_only_model_text(tiny_models, corpus):
    """An answer tag the environment wrote (a retrieved passage) never scores."""
    args = argparse.Namespace(hf_checkpoint=str(tiny_models["qwen2"]))
    tokenizer = cached_tokenizer(args.hf_checkpoint)
    sample = _sample(corpus, "What is the capital of Kalo?", "Mir")
    start_sample(args, sample)
    for text, masked in (("<search>Kalo</search>", False), ("<information><answer>Mir</answer>", True)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if masked:
            append_env_output(sample, ids, text)
        else:
            append_model_turn(sample, Turn(ids, [0.0] * len(ids), text, Sample.Status.COMPLETED, "1"))
    assert search.reward_func(args, sample) == 0.0
    assert search.model_text(args, sample) == "<search>Kalo</search>"


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` of each run of equal loss-mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


@pytest.mark.e2e
def test_run_sh_trains_two_rollouts_with_retrieved_passages_masked(tmp_path):
    from tests.support.train_runs import processes_tagged, read_events

    tag = uuid.uuid4().hex
    env = {**os.environ, "OUT": str(tmp_path), "NUM_ROLLOUT": "2", "SLIME_TEST_RUN": tag}
    extra = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--micro-batch-size", "8"]
    extra += ["--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt")]
    result = subprocess.run(
        ["bash", str(EXAMPLE / "run.sh"), *extra], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    time.sleep(1)  # processes killed a moment ago may still be exiting
    assert not processes_tagged(tag), processes_tagged(tag)
    assert [step for step, _ in read_events(tmp_path / "tb")["rollout/raw_reward"]] == [0, 1]

    tokenizer = cached_tokenizer(str(tmp_path / "base"))
    retriever = search.load_retriever(str(tmp_path / "data/corpus.jsonl"))
    for rollout_id in range(2):
        data = torch.load(tmp_path / f"rollout_{rollout_id}.pt", weights_only=True)
        assert len(data["tokens"]) == 8 and all(r in (0.0, 1.0) for r in data["raw_rewards"])
        for tokens, n, mask in zip(data["tokens"], data["response_lengths"], data["loss_masks"], strict=True):
            assert 0 < n <= 256
            if not any(mask):  # a FAILED sample's stub (none is expected here): nothing to check
                continue
            response, previous = tokens[-n:], ""
            for value, start, end in _spans(mask):  # every masked run is what the environment answers
                text = tokenizer.decode(response[start:end])
                if value == 0:
                    action, content = search.parse_action(previous)
                    expected = (
                        search.information(retriever.search(content))
                        if action == "search"
                        else search.INVALID
                    )
                    assert text == expected
                previous = text
