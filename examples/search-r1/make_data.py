"""Writes the Search-R1 example's data: a small corpus of made-up facts and questions about them.

The countries, cities, rivers and people are invented from syllables, so no model can know the
answers beforehand: a correct answer needs the search tool. Every fact sits in exactly one passage,
and each question names its country and the attribute asked for, so BM25 finds the passage that
answers it. Output (under ``--out``):

- ``corpus.jsonl``: ``{"id", "title", "text"}`` per passage (three per country);
- ``train.jsonl``: ``{"prompt", "label", "metadata": {"corpus": <absolute path of corpus.jsonl>}}``,
  the label a list of accepted answers (Search-R1's ``golden_answers``).

Only ASCII letters, digits and basic punctuation are used: the tiny model's tokenizer has one token
per such character and nothing else.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYLLABLES = (
    "ka",
    "lo",
    "mir",
    "zan",
    "to",
    "vel",
    "dri",
    "sul",
    "ne",
    "bar",
    "qui",
    "ros",
    "tem",
    "fa",
    "gor",
)

PROMPT = (
    "Answer the question. To look facts up, write <search>query</search>; results appear in "
    "<information></information>. Write the final answer as <answer>answer</answer>.\nQuestion: {question}"
)
"""Search-R1's instruction, shortened: the tiny model's context is 512 tokens, one per character."""


def _name(rng: random.Random, used: set[str], syllables: int) -> str:
    """A new capitalised made-up word (never one already in ``used``)."""
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()
        if name not in used:
            used.add(name)
            return name


def make_world(num_countries: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``(passages, questions)``: three passages per country and four questions answered by them."""
    rng = random.Random(seed)
    used: set[str] = set()
    passages: list[dict] = []
    questions: list[dict] = []
    for _ in range(num_countries):
        country, capital, river = _name(rng, used, 3), _name(rng, used, 2), _name(rng, used, 2)
        founder = f"{_name(rng, used, 2)} {_name(rng, used, 2)}"
        year = str(rng.randint(1000, 1900))
        for text in (
            f"{country} is a country. Its capital city is {capital}.",
            f"The {river} river flows through {country} to the sea.",
            f"{country} was founded in {year} by {founder}.",
        ):
            passages.append({"id": str(len(passages)), "title": country, "text": text})
        for question, answer in (
            (f"What is the capital of {country}?", capital),
            (f"Which river flows through {country}?", river),
            (f"In which year was {country} founded?", year),
            (f"Who founded {country}?", founder),
        ):
            questions.append({"question": question, "answer": answer})
    return passages, questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-countries", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    passages, questions = make_world(args.num_countries, args.seed)
    corpus = (args.out / "corpus.jsonl").resolve()
    corpus.write_text("".join(json.dumps(p) + "\n" for p in passages))
    rows = [
        {
            "prompt": PROMPT.format(question=q["question"]),
            "label": [q["answer"]],
            "metadata": {"corpus": str(corpus)},
        }
        for q in questions
    ]
    random.Random(args.seed).shuffle(rows)
    (args.out / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{args.out}: {len(passages)} passages, {len(rows)} questions")


if __name__ == "__main__":
    main()
