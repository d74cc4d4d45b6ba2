"""A multi-turn, tool-using rollout: the model may call a calculator, the environment answers, repeat.

``generate`` is a ``--custom-generate-function-path`` plugin. Each model turn stops at ``</calc>`` or
after ``TURN_TOKENS`` tokens. A turn that ends the episode (the model's end-of-sequence token) is its
final answer; any other turn gets an environment reply, appended with loss mask 0:

- ``<calc>EXPR</calc>`` -> ``<result>VALUE</result>`` (arithmetic on numbers, + - * / and brackets);
- no call -> ``<result>none</result>``, so the model sees the format it did not follow.

The loop ends at the final answer, after ``--max-turns`` model turns, when the
``--rollout-max-response-len`` budget of the whole trajectory is spent, or when the rollout aborts.
Everything is appended as token ids (``slime.rollout.generate_utils``): the engine's tokens with their
log-probs (trained on) and the tokenized tool output (masked), never re-tokenized text. With
``--partial-rollout`` an aborted trajectory resumes where it stopped.

``reward`` is 1.0 when the number in the final answer equals the label.
"""

from __future__ import annotations

import argparse
import ast
import operator
import re
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
from slime.rollout.sample import Sample

TURN_TOKENS = 16
CALL_END = "</calc>"
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only numbers, + - * / and brackets")


def calculator(expression: str) -> str:
    """The tool: the value of an arithmetic expression, or ``error`` (never raises, never runs code)."""
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "error"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def tool_reply(model_text: str) -> str:
    """The environment's answer to one model turn."""
    calls = CALL.findall(model_text)
    return f"\n<result>{calculator(calls[-1]) if calls else 'none'}</result>\n"


async def generate(args: argparse.Namespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """The trajectory of one sample (continues a partial one); see the module docstring."""
    start_sample(args, sample)
    if sample.response_length == 0:
        sample.metadata["tool_replies"] = []
    while len(sample.turn_spans) < args.max_turns:
        budget = min(TURN_TOKENS, remaining_tokens(sample, sampling_params))
        params = {**sampling_params, "max_new_tokens": budget, "stop": [CALL_END]}
        turn = await generate_turn(args, sample.tokens, params, sample.index, routes=route_request(sample))
        append_model_turn(sample, turn)
        called = turn.finish_reason.get("matched") == CALL_END
        if turn.status is Sample.Status.ABORTED or (turn.status is Sample.Status.COMPLETED and not called):
            return sample
        reply = tool_reply(turn.text)
        ids = env_token_ids(args, reply)
        if len(ids) > remaining_tokens(sample, sampling_params):  # no room for the reply and a next turn
            break
        append_env_output(sample, ids, reply)
        sample.metadata["tool_replies"].append(reply)
    sample.status = Sample.Status.TRUNCATED  # out of turns or tokens before a final answer
    return sample


def reward(args: argparse.Namespace, sample: Sample) -> float:
    """1.0 when the last number of the final model turn equals the label."""
    if not sample.turn_spans or sample.status is not Sample.Status.COMPLETED:
        return 0.0
    start, end = sample.turn_spans[-1]
    final = sample.tokens[sample.prompt_length + start : sample.prompt_length + end]
    numbers = NUMBER.findall(cached_tokenizer(args.hf_checkpoint).decode(final, skip_special_tokens=True))
    return float(bool(numbers) and sample.label is not None and float(numbers[-1]) == float(sample.label))
