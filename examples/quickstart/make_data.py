"""Synthetic task for the CPU quickstart: sort 4-6 digits.

A character-level tiny model can learn it from a short SFT warm start and then measurably improve
with RL (docs/get-started/cpu-quickstart.md gives the numbers measured on it), and the reward is
exact and cheap to check.

Writes three JSONL files into OUT_DIR:
- ``sft.jsonl``: ``{"prompt", "response"}`` pairs for the SFT warm start,
- ``train.jsonl``: ``{"prompt", "label"}`` for RL (reward: exact match),
- ``eval.jsonl``: held-out prompts in the same shape.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def make_example(rng: random.Random) -> dict[str, str]:
    digits = [rng.randrange(10) for _ in range(rng.randint(4, 6))]
    prompt = "sort " + " ".join(map(str, digits)) + "\n"
    return {"prompt": prompt, "label": "".join(map(str, sorted(digits)))}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def make_data(
    out_dir: Path, num_sft: int = 4096, num_train: int = 4096, num_eval: int = 256, seed: int = 0
) -> None:
    """Disjoint splits: no eval prompt appears in the training files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {"eval": [], "train": [], "sft": []}
    sizes = {"eval": num_eval, "train": num_train, "sft": num_sft}
    for name, size in sizes.items():
        while len(splits[name]) < size:
            example = make_example(rng)
            if name == "eval" and example["prompt"] in seen:
                continue
            if name == "eval":
                seen.add(example["prompt"])
            elif example["prompt"] in seen:
                continue
            splits[name].append(example)
    write_jsonl(out_dir / "eval.jsonl", splits["eval"])
    write_jsonl(out_dir / "train.jsonl", splits["train"])
    write_jsonl(
        out_dir / "sft.jsonl", [{"prompt": e["prompt"], "response": e["label"]} for e in splits["sft"]]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_data(args.out, seed=args.seed)
    print(f"wrote sft.jsonl, train.jsonl, eval.jsonl to {args.out}")


if __name__ == "__main__":
    main()
