"""Synthetic image task for the CPU vision-language example: name the colour of the one shape.

Each picture is a circle, square or triangle of one of four colours (``COLOURS``) at a random place and
size on a light background, with a little colour jitter. The tiny Qwen2.5-VL
(``tools/make_tiny_model.py --arch qwen2_5_vl``) sees a 56x56 picture as 4 image tokens (2x2 merged
patches of 28x28 pixels) and can learn the task in minutes on a CPU: the answer is in the image alone,
every answer is a short word of its character-level vocabulary, and exact match is a cheap, exact reward.
Sides are multiples of 28 inside the processor's pixel range, so Qwen2.5-VL's resize is the identity.

Writes into OUT_DIR the pictures as PNG files under ``images/`` and, one JSON object per line (paths
relative to the JSONL file, read with ``--multimodal-keys '{"image": "images"}'``):

- ``sft.jsonl``: ``{"prompt", "images", "response"}`` for the SFT warm start,
- ``train.jsonl``: ``{"prompt", "images", "label"}`` for RL (reward: exact match),
- ``eval.jsonl``: held-out pictures in the same shape (no scene of it is in the training files),
- ``multi_turn.jsonl``: the two-image variant for ``multi_turn_generate.py``: the prompt shows the first
  picture and asks its colour; ``metadata["observation_image"]`` (absolute path, as the generate function
  may run in any directory) is the second picture, shown after the model's answer with the question
  ``metadata["observation_question"]`` (``SAME_QUESTION``); the label is ``yes`` or ``no`` (half of
  each) and ``metadata["colours"]`` the two pictures' colours.

The prompt is a chat message list whose image part (``{"type": "image"}``) the checkpoint's chat template
renders as one ``<|vision_start|><|image_pad|><|vision_end|>`` block, so the rollout, the SFT rollout and
a plain ``tokenizer.apply_chat_template`` all see the same prompt.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 165, 60),
    "blue": (45, 80, 215),
    "yellow": (230, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
QUESTION = "colour?"
SAME_QUESTION = "same colour?"
PATCH_FACTOR = 28
"""Qwen2.5-VL's patch (14 px) times its spatial merge (2): image sides that are multiples of it are kept."""
SIZES = (56, 84, 112)
"""Sides inside the tiny model's processor range (min 56x56, max 112x112 pixels), so none is resized."""
JITTER = 20
"""Largest change of each colour channel, so that a colour is a region of RGB space, not one value."""


@dataclass(frozen=True)
class Scene:
    """One picture: everything drawn, so that equal scenes are equal pictures."""

    colour: str
    shape: str
    centre: tuple[int, int]
    radius: int
    rgb: tuple[int, int, int]
    background: int


def random_scene(rng: random.Random, size: int, colour: str | None = None) -> Scene:
    """A shape of ``colour`` (random if None) that lies wholly inside a ``size`` x ``size`` picture."""
    colour = rng.choice(sorted(COLOURS)) if colour is None else colour
    radius = rng.randint(size // 7, size // 3)
    centre = (rng.randint(radius, size - 1 - radius), rng.randint(radius, size - 1 - radius))
    red, green, blue = (min(255, max(0, c + rng.randint(-JITTER, JITTER))) for c in COLOURS[colour])
    return Scene(colour, rng.choice(SHAPES), centre, radius, (red, green, blue), rng.randint(225, 255))


def draw(scene: Scene, size: int) -> Image.Image:
    """The picture of ``scene``: RGB, ``size`` x ``size`` pixels."""
    image = Image.new("RGB", (size, size), (scene.background,) * 3)
    pen = ImageDraw.Draw(image)
    (x, y), r = scene.centre, scene.radius
    if scene.shape == "circle":
        pen.ellipse([x - r, y - r, x + r, y + r], fill=scene.rgb)
    elif scene.shape == "square":
        pen.rectangle([x - r, y - r, x + r, y + r], fill=scene.rgb)
    else:
        pen.polygon([(x, y - r), (x + r, y + r), (x - r, y + r)], fill=scene.rgb)
    return image


def user_turn(text: str) -> list[dict[str, Any]]:
    """A one-message chat prompt: the picture, then ``text``."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def make_data(
    out_dir: Path,
    seed: int = 0,
    size: int = 56,
    num_sft: int = 2048,
    num_train: int = 2048,
    num_eval: int = 128,
    num_multi_turn: int = 512,
) -> None:
    """Writes the files the module docstring lists; the same ``seed`` and sizes give the same bytes.

    The eval scenes are drawn first and no later scene equal to one of them is kept, so the splits are
    disjoint (a repeated training scene is harmless and kept).
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES} (a multiple of {PATCH_FACTOR} the processor keeps)")
    out_dir.mkdir(parents=True, exist_ok=True)
    images = out_dir / "images"
    images.mkdir(exist_ok=True)
    rng = random.Random(seed)
    held_out: set[Scene] = set()

    def picture(name: str, scene: Scene) -> str:
        draw(scene, size).save(images / f"{name}.png", format="PNG")
        return f"images/{name}.png"

    def fresh_scene(colour: str | None = None) -> Scene:
        while (scene := random_scene(rng, size, colour)) in held_out:
            pass
        return scene

    rows: dict[str, list[dict[str, Any]]] = {}
    for split, count, answer_key in (
        ("eval", num_eval, "label"),
        ("train", num_train, "label"),
        ("sft", num_sft, "response"),
    ):
        rows[split] = []
        for i in range(count):
            scene = fresh_scene()
            if split == "eval":
                held_out.add(scene)
            path = picture(f"{split}_{i:05d}", scene)
            rows[split].append({"prompt": user_turn(QUESTION), "images": [path], answer_key: scene.colour})
    rows["multi_turn"] = []
    for i in range(num_multi_turn):
        first = fresh_scene()
        same = i % 2 == 0
        other = rng.choice(sorted(set(COLOURS) - {first.colour}))
        second = fresh_scene(first.colour if same else other)
        path = picture(f"mt_{i:05d}_a", first)
        observation = (out_dir / picture(f"mt_{i:05d}_b", second)).resolve()
        rows["multi_turn"].append(
            {
                "prompt": user_turn(QUESTION),
                "images": [path],
                "label": "yes" if same else "no",
                "metadata": {
                    "observation_image": str(observation),
                    "observation_question": SAME_QUESTION,
                    "colours": [first.colour, second.colour],
                },
            }
        )
    for split, split_rows in rows.items():
        write_jsonl(out_dir / f"{split}.jsonl", split_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=56, choices=SIZES, help="image side in pixels")
    args = parser.parse_args()
    make_data(args.out, seed=args.seed, size=args.size)
    print(f"wrote sft.jsonl, train.jsonl, eval.jsonl, multi_turn.jsonl and images/ to {args.out}")


if __name__ == "__main__":
    main()
