"""A ``--data-source-path`` plugin: arithmetic questions made on the fly, harder as training goes on.

No prompt file: ``ArithmeticSource(args)`` draws ``a OP b`` questions from a seeded generator whose
operands get one digit longer every ``DIGITS_EVERY`` prompts served (a curriculum). Groups the
rollout hands back (aborted, over-sampled, partial) are served again first. The whole state is four
numbers and that buffer, saved next to each checkpoint, so a resumed run continues the same sequence.

    python train.py ... --data-source-path examples/data_plugins/arithmetic_source.py:ArithmeticSource \\
        --rm-type exact --n-samples-per-prompt 4

The contract: ``C(args)`` with ``get_samples(num_groups)``, ``add_samples(groups)``,
``save(rollout_id, directory)`` and ``load(rollout_id, directory) -> bool``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
from pathlib import Path

from slime.rollout.sample import Sample

DIGITS_EVERY = 64


class ArithmeticSource:
    """Seeded, resumable stream of ``--n-samples-per-prompt``-sized groups of arithmetic questions."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.n_samples_per_prompt = args.n_samples_per_prompt
        self.seed = args.rollout_seed
        self.served = self.next_group_index = self.next_sample_index = 0
        self.buffer: list[list[Sample]] = []

    def _question(self) -> Sample:
        # One generator per prompt, seeded by its position: the sequence does not depend on batch sizes.
        rng = random.Random(self.seed * 1_000_003 + self.served)
        digits = 1 + self.served // DIGITS_EVERY
        a, b = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        self.served += 1
        prompt = f"What is {a}{op}{b}? You may write <calc>EXPR</calc> to use a calculator. Answer:"
        return Sample(prompt=prompt, label=str(value), metadata={"digits": digits})

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups, self.buffer = self.buffer[:num_groups], self.buffer[num_groups:]
        while len(groups) < num_groups:
            prompt = self._question()
            group = []
            for _ in range(self.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index, sample.index = self.next_group_index, self.next_sample_index
                self.next_sample_index += 1
                group.append(sample)
            self.next_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.buffer += [list(group) for group in groups]

    def _path(self, rollout_id: int, directory: str | os.PathLike[str]) -> Path:
        return Path(directory) / "rollout" / f"arithmetic_source_{rollout_id}.json"

    def save(self, rollout_id: int, directory: str | os.PathLike[str]) -> Path:
        path = self._path(rollout_id, directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "served": self.served,
            "next_group_index": self.next_group_index,
            "next_sample_index": self.next_sample_index,
            "buffer": [[sample.to_dict() for sample in group] for group in self.buffer],
        }
        path.write_text(json.dumps(state))
        return path

    def load(self, rollout_id: int, directory: str | os.PathLike[str]) -> bool:
        path = self._path(rollout_id, directory)
        if not path.is_file():
            return False
        state = json.loads(path.read_text())
        self.served, self.next_group_index = state["served"], state["next_group_index"]
        self.next_sample_index = state["next_sample_index"]
        self.buffer = [[Sample.from_dict(s) for s in group] for group in state["buffer"]]
        return True
