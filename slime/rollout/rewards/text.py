"""Text-match rewards: exact match and SQuAD's token-level F1, for QA-style data without maths."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def exact_score(response: str, label: str) -> float:
    """1.0 when the response equals the label up to surrounding whitespace, else 0.0."""
    return float(response.strip() == label.strip())


def squad_tokens(text: str) -> list[str]:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, split on whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    return _ARTICLES.sub(" ", text).split()


def f1_score(response: str, label: str) -> float:
    """Token-level F1 between response and label, as the SQuAD evaluation script computes it.

    Partial credit gives a denser signal than exact match for free-form answers. When either side has no
    tokens left after normalisation the score is 1.0 only if both are empty.
    """
    predicted, reference = squad_tokens(response), squad_tokens(label)
    if not predicted or not reference:
        return float(predicted == reference)
    same = sum((Counter(predicted) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(reference)
    return 2 * precision * recall / (precision + recall)
