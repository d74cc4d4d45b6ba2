"""The rule-based rewards upstream slime's ``--rm-type`` names, on slime's own answer checking.

Upstream's launch scripts pass ``--rm-type deepscaler`` (DeepScaleR's rule: only what follows the
reasoning answers) and ``--rm-type dapo`` (DAPO's: the last ``Answer:`` line, an integer, scored
+1 / -1 with ``acc`` and ``pred`` beside it, trained with ``--reward-key score``), and may prefix a
type with ``boxed_`` to score only the response's last ``\\boxed{}``. The rules (what is read, what
scores) follow upstream's ``slime/rollout/rm_hub``; the comparison is ``math_answer``'s.
"""

from __future__ import annotations

import random
import re
from typing import Any

from slime.rollout.rewards.math_answer import answers_match, last_boxed, normalize_answer, reference_answer

_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
DAPO_TAIL_CHARS = 300  # DAPO reads the end of a response only (MATH-500's longest answer: 159 chars)


def deepscaler_score(response: str, label: str) -> float:
    """1.0 when the boxed answer after the reasoning (after the last ``</think>``, or after
    ``###Response``) equals the label; 0.0 when there is no such part, no boxed answer, or no label."""
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[-1]
    elif "###Response" in response:
        solution = response.split("###Response", 2)[1]
    else:
        return 0.0
    predicted = last_boxed(solution)
    if predicted is None or label == "":
        return 0.0
    return 1.0 if answers_match(predicted, reference_answer(label)) else 0.0


def dapo_score(response: str, label: str) -> dict[str, Any]:
    """DAPO's reward: the last ``Answer: ...`` line of the response's last 300 characters against the
    label read as an integer; ``{"score": 1.0 or -1.0, "acc": bool, "pred": str}``."""
    found = _DAPO_ANSWER.findall(response[-DAPO_TAIL_CHARS:])
    predicted = normalize_answer(found[-1]) if found else "[INVALID]"
    try:
        target = str(int(float(normalize_answer(reference_answer(label)))))
    except ValueError:
        target = normalize_answer(reference_answer(label))
    correct = predicted == target
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": predicted}


def boxed_response(response: str) -> str:
    """The response's last ``\\boxed{}`` content (``""`` when it has none): what a ``boxed_<type>``
    reward scores."""
    return last_boxed(response) or ""


def random_score(response: str, label: str) -> float:
    """0 or 1 at random: upstream's ``random`` type, a baseline with no signal."""
    return float(random.randint(0, 1))
