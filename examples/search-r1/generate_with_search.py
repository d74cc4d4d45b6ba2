"""Search-R1 on slime: a multi-turn search agent with a local BM25 retriever, and its exact-match reward.

``generate`` (``--custom-generate-function-path``) runs one trajectory per sample. Each model turn stops
at ``</search>`` or ``</answer>`` (or after ``TURN_TOKENS`` tokens); then

- ``<search>QUERY</search>``: the ``TOP_K`` best passages of the corpus for QUERY are appended as
  ``<information>Doc 1 (Title: ...) ...</information>``, with loss mask 0 (never trained on);
- ``<answer>...</answer>``, or a turn ended by the model's end-of-sequence token: the episode is over;
- anything else: a short reminder of the format is appended (loss mask 0), as Search-R1 does.

The loop ends there, after ``--max-turns`` model turns, when the ``--rollout-max-response-len`` budget of
the whole trajectory is spent, or when the rollout aborts. Everything is appended as token ids with
``slime.rollout.generate_utils`` (the engine's tokens and log-probs; the tokenized environment text),
so nothing is re-tokenized, and ``--partial-rollout`` resumes an aborted trajectory where it stopped.

The retriever is BM25 over ``corpus.jsonl`` (``{"title", "text"}`` per line), whose path each prompt
carries in ``metadata["corpus"]`` (``make_data.py`` writes both): the path travels with the data to
whichever process runs the rollout, and no retrieval server or network is needed.

``reward_func`` (``--custom-rm-path``) is Search-R1's exact match: 1.0 when the last
``<answer>...</answer>`` the model wrote equals one of the label's answers after SQuAD normalisation
(lower case, no punctuation, no articles), else 0.0. Only model-written text is read, so an answer tag
inside a retrieved passage never scores.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
from collections import Counter
from typing import Any

from slime.rollout.generate_utils import (
    append_env_output,
    append_model_turn,
    cached_tokenizer,
    env_token_ids,
    generate_turn,
    remaining_tokens,
    route_request,
    start_sample,
)
from slime.rollout.rewards.text import squad_tokens
from slime.rollout.sample import Sample

TOP_K = 2
"""Passages per search (Search-R1 uses 3; two keep a search within the tiny model's 512-token context)."""
TURN_TOKENS = 48
"""Most tokens of one model turn, so that a rambling turn still leaves budget for a search and an answer."""
STOPS = ["</search>", "</answer>"]
ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
INVALID = "\nInvalid action: write <search>query</search> or <answer>answer</answer>.\n"
_WORD = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(
    {"a", "an", "and", "the", "of", "in", "to", "is", "was", "which", "what", "who", "by", "its"}
)


def terms(text: str) -> list[str]:
    """BM25's terms: lower-case words and numbers, without the commonest function words."""
    return [word for word in _WORD.findall(text.lower()) if word not in _STOPWORDS]


class BM25:
    """Okapi BM25 over a list of passages, in plain Python (a few hundred passages need no index)."""

    def __init__(self, passages: list[dict[str, str]], k1: float = 1.2, b: float = 0.75) -> None:
        self.passages = passages
        self.k1, self.b = k1, b
        self.counts = [Counter(terms(f"{p['title']} {p['text']}")) for p in passages]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.mean_length = sum(self.lengths) / max(len(passages), 1)
        df = Counter(term for c in self.counts for term in c)
        n = len(passages)
        self.idf = {term: math.log(1 + (n - d + 0.5) / (d + 0.5)) for term, d in df.items()}

    def score(self, query_terms: list[str], i: int) -> float:
        """BM25 score of passage ``i`` for the query's terms."""
        counts, norm = self.counts[i], self.k1 * (1 - self.b + self.b * self.lengths[i] / self.mean_length)
        return sum(
            self.idf[t] * counts[t] * (self.k1 + 1) / (counts[t] + norm) for t in query_terms if t in counts
        )

    def search(self, query: str, k: int = TOP_K) -> list[dict[str, str]]:
        """The ``k`` best passages for ``query``, best first (ties in corpus order); a passage sharing no
        term with the query is never returned."""
        query_terms = terms(query)
        scored = [(self.score(query_terms, i), i) for i in range(len(self.passages))]
        ranked = sorted((pair for pair in scored if pair[0] > 0), key=lambda pair: (-pair[0], pair[1]))
        return [self.passages[i] for _, i in ranked[:k]]


@functools.cache
def load_retriever(corpus_path: str) -> BM25:
    """The BM25 index of a ``corpus.jsonl``, built once per process."""
    with open(corpus_path) as f:
        return BM25([json.loads(line) for line in f if line.strip()])


def information(passages: list[dict[str, str]]) -> str:
    """The environment's reply to a search, in Search-R1's ``Doc i (Title: ...)`` format."""
    docs = "\n".join(f"Doc {i} (Title: {p['title']}) {p['text']}" for i, p in enumerate(passages, 1))
    return f"\n<information>{docs or 'No results.'}</information>\n"


def parse_action(text: str) -> tuple[str | None, str]:
    """``(action, content)`` of a model turn: ``("search", query)``, ``("answer", text)``, ``(None, "")``."""
    match = ACTION.search(text)
    return (match.group(1), match.group(2).strip()) if match else (None, "")


def env_reply(action: str | None, content: str, corpus_path: str) -> str:
    """What the environment appends after a turn that neither answered nor ended the episode."""
    return information(load_retriever(corpus_path).search(content)) if action == "search" else INVALID


def _corpus(sample: Sample) -> str:
    path = sample.metadata.get("corpus")
    if not path:
        raise ValueError(
            f"sample {sample.index} has no metadata['corpus']: each prompt row needs "
            '"metadata": {"corpus": "path/to/corpus.jsonl"} (examples/search-r1/make_data.py writes it)'
        )
    return path


async def generate(args: argparse.Namespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """The trajectory of one sample (continues a partial one); see the module docstring."""
    corpus = _corpus(sample)
    start_sample(args, sample)
    if sample.response_length == 0:
        sample.metadata["searches"] = []
    stop = sampling_params.get("stop") or []  # the rollout's own stop strings (--rollout-stop) still apply
    stops = [stop, *STOPS] if isinstance(stop, str) else [*stop, *STOPS]
    while len(sample.turn_spans) < args.max_turns:
        budget = min(TURN_TOKENS, remaining_tokens(sample, sampling_params))
        turn = await generate_turn(
            args,
            sample.tokens,
            {**sampling_params, "max_new_tokens": budget, "stop": stops},
            sample.index,
            routes=route_request(sample),
        )
        append_model_turn(sample, turn)
        action, content = parse_action(turn.text)
        # an answer, or a turn the model ended itself (end-of-sequence, a stop string of the rollout)
        ended = action == "answer" or (turn.status is Sample.Status.COMPLETED and action is None)
        if ended or turn.status is Sample.Status.ABORTED or sample.status is Sample.Status.FAILED:
            return sample
        if len(sample.turn_spans) >= args.max_turns:  # no turn left to read a reply
            break
        reply = env_reply(action, content, corpus)
        ids = env_token_ids(args, reply)
        if len(ids) >= remaining_tokens(sample, sampling_params):  # no room for the reply and a next turn
            break
        append_env_output(sample, ids, reply)
        if action == "search":
            sample.metadata["searches"].append(content)
    sample.status = Sample.Status.TRUNCATED  # out of turns or tokens before an answer
    return sample


def golden_answers(label: Any) -> list[str]:
    """The accepted answers of a label: a string, a list of them, or Search-R1's
    ``{"ground_truth": {"target": [...]}}`` (its ``reward_model`` column)."""
    if isinstance(label, dict):
        label = label["ground_truth"]["target"]
    return [label] if isinstance(label, str) else [str(answer) for answer in label]


def normalize(text: str) -> str:
    """SQuAD's answer normalisation, as Search-R1's ``normalize_answer``."""
    return " ".join(squad_tokens(text))


def exact_match(model_text: str, label: Any) -> float:
    """1.0 when the last ``<answer>`` of ``model_text`` matches an accepted answer, else 0.0."""
    answers = ANSWER.findall(model_text)
    if not answers:
        return 0.0
    predicted = normalize(answers[-1])
    return float(any(predicted == normalize(answer) for answer in golden_answers(label)))


def model_text(args: argparse.Namespace, sample: Sample) -> str:
    """The text of the model's own turns (``turn_spans``), without what the environment appended."""
    tokenizer = cached_tokenizer(args.hf_checkpoint)
    start = sample.prompt_length
    return "".join(
        tokenizer.decode(sample.tokens[start + a : start + b], skip_special_tokens=True)
        for a, b in sample.turn_spans
    )


def reward_func(args: argparse.Namespace, sample: Sample) -> float:
    """Search-R1's exact-match reward of one finished trajectory; see ``exact_match``."""
    if sample.label is None:
        raise ValueError(f"sample {sample.index} has no label; pass --label-key")
    return exact_match(model_text(args, sample), sample.label)
