"""Math answer checking: pull the final answer out of a response and compare it with the label.

Models write the same answer many ways (``\\boxed{\\dfrac{1}{2}}``, ``0.5``, ``$1/2$``, ``The answer is
1/2.``), and a reward that only matches one spelling teaches formatting instead of maths. So the answer
is extracted (last ``\\boxed{}``, else the text after "answer is" / "Answer:", else the last number),
normalised (LaTeX wrappers, ``$``, spaces, thousands commas, trailing ``.0``, ``%``), and compared as
an exact rational number when both sides parse as one, else as normalised text.

Percentages compare by their number: ``50%`` equals ``50``, not ``0.5``.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from fractions import Fraction

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+"
_NUMBER_OR_FRACTION = re.compile(rf"(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?%?")
_ANSWER_PHRASE = re.compile(r"(?:answer\s+is|answer\s*:)\s*:?\s*(.*)", re.IGNORECASE)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_OPERATORS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_MAX_EXPONENT = 400
_BOXED = re.compile(r"\\(?:boxed|fbox)")
_SIMPLE = re.compile(r"^-?[\w.]+$")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included; None if none."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    k = matches[-1].end()
    if text.startswith("{", k):
        end = _closing_brace(text, k)
        return None if end is None else text[k + 1 : end]  # None: cut off inside the box
    word = re.match(r"\s+([^\s$]+)", text[k:])  # "\boxed 5"
    return word.group(1) if word else None


def extract_answer(response: str) -> str | None:
    """The final answer a response states, or None when it states none.

    Reasoning before a closing ``</think>`` is ignored: only the final part answers.
    """
    text = response.rsplit("</think>", 1)[-1].replace("\u2212", "-")
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    phrases = _ANSWER_PHRASE.findall(text)
    if phrases:
        phrase: str = phrases[-1].split("\n", 1)[0].strip()
        if phrase:
            return phrase
    numbers = _NUMBER_OR_FRACTION.findall(text)
    return numbers[-1] if numbers else None


def _replace_all(pattern: re.Pattern[str], repl: str, text: str) -> str:
    # Repeat until nested wrappers (\text{\textbf{..}}) are all unwrapped.
    while True:
        new = pattern.sub(repl, text)
        if new == text:
            return text
        text = new


def _closing_brace(s: str, start: int) -> int | None:
    depth = 0
    for j in range(start, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return None


def _frac_args(s: str, k: int) -> tuple[list[str], int]:
    """The two arguments of a ``\\frac`` whose name ends before ``k``: braced groups or single characters."""
    operands: list[str] = []
    while len(operands) < 2:
        while k < len(s) and s[k] == " ":
            k += 1
        if k < len(s) and s[k] == "{":
            end = _closing_brace(s, k)
            if end is None:
                break
            operands.append(s[k + 1 : end])
            k = end + 1
        elif k < len(s) and s[k].isalnum():
            operands.append(s[k])  # \frac12
            k += 1
        else:
            break
    return operands, k


def _rewrite_fracs(s: str) -> str:
    """``\\frac{a}{b}`` -> ``a/b`` (parenthesised unless simple), nested fractions included."""
    out = []
    i = 0
    while (j := s.find("\\frac", i)) >= 0:
        out.append(s[i:j])
        args, k = _frac_args(s, j + len("\\frac"))
        if len(args) < 2:
            out.append("\\frac")
            i = j + len("\\frac")
            continue
        num, den = (_rewrite_fracs(a).strip() for a in args)
        num = num if _SIMPLE.match(num) else f"({num})"
        den = den if _SIMPLE.match(den) else f"({den})"
        out.append(f"{num}/{den}")
        i = k
    out.append(s[i:])
    return "".join(out)


def normalize_answer(answer: str) -> str:
    """Canonical text of an answer, so that spellings of the same value compare equal as strings."""
    s = answer.strip().replace("\u2212", "-")
    s = _replace_all(_TEXT_WRAPPER, r"\1", s)
    s = re.sub(r"\\left|\\right|\\displaystyle", "", s)
    s = re.sub(r"\\[!,;:> ]|~", "", s)
    s = s.replace("\\%", "%").replace("\\$", "").replace("$", "")
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = _rewrite_fracs(s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\{(\w)\}", r"\1", s)  # {a}^{2} and \sqrt{3} as a^2 and \sqrt3
    s = re.sub(r"^[a-zA-Z]=(?!=)", "", s)  # "x = 5" states 5
    s = s.rstrip(".")
    while s.startswith("{") and s.endswith("}") and _balanced(s[1:-1]):
        s = s[1:-1]
    s = _replace_all(re.compile(r"(\d),(\d{3})(?!\d)"), r"\1\2", s)
    s = re.sub(r"(?<![\d.])(-?\d+)\.0+(?![\d])", r"\1", s)
    return s.lower()


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def _evaluate(node: ast.AST, source: str) -> Fraction:
    """Exact value of an arithmetic expression tree of numbers, + - * / and parentheses."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, source)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        # From the source text, not the float: 0.1 stays exactly 1/10.
        segment = ast.get_source_segment(source, node)
        assert segment is not None  # every node parsed from ``source`` has its position
        return Fraction(segment)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError("not plain arithmetic")


def to_number(answer: str) -> Fraction | None:
    """The exact value of a normalised answer, else None.

    Integers, decimals, scientific notation, percentages (their number) and arithmetic of those
    (``3/4``, ``(1/2)/3``, ``-3/4``). Parsed with ``ast``, never evaluated as Python.
    """
    s = answer.removesuffix("%")
    if not s or not re.fullmatch(r"[\d.eE+\-*/()]+", s):
        return None
    # 1e999999999 would build a billion-digit integer: a response must not be able to stall the scorer.
    if any(int(e) > _MAX_EXPONENT for e in re.findall(r"[eE][-+]?(\d+)", s)):
        return None
    try:
        return _evaluate(ast.parse(s, mode="eval"), s)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def answers_match(predicted: str, reference: str) -> bool:
    """True when two answers have the same value (numerically if both parse, else as normalised text)."""
    p, r = normalize_answer(predicted), normalize_answer(reference)
    if p == r:
        return True
    pn, rn = to_number(p), to_number(r)
    return pn is not None and rn is not None and pn == rn


def reference_answer(label: str) -> str:
    """The answer inside a label: the boxed part, or the part after GSM8K's ``####``, else all of it."""
    boxed = last_boxed(label)
    if boxed is not None:
        return boxed
    return label.rsplit("####", 1)[-1]


def math_score(response: str, label: str) -> float:
    """1.0 when the response's final answer equals the label's, else 0.0."""
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    reference = reference_answer(label)
    if answers_match(predicted, reference):
        return 1.0
    # "The answer is 42 apples": a plain-text answer to a numeric question, read as its last number.
    # Only without LaTeX, where the last number may be a part of the answer (2\sqrt{3}).
    if to_number(normalize_answer(reference)) is not None and "\\" not in predicted:
        numbers = _NUMBER_OR_FRACTION.findall(predicted)
        if numbers and answers_match(numbers[-1], reference):
            return 1.0
    return 0.0
