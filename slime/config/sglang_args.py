"""Family 2: ``--sglang-<flag>`` pass-through to the rollout engines.

SGLang has hundreds of server flags and cannot be imported on CPU-only machines, so they are not
declared one by one: every leftover ``--sglang-<name> [value ...]`` is collected into
``args.sglang_server_args`` with ``<name>`` in snake_case (SGLang's ``ServerArgs`` field names).
Values stay strings; the engine backend converts, honours or clearly rejects each one. Checking
the names against ``ServerArgs`` when SGLang is installed belongs in ``collect_sglang_args``.
slime's own flags that happen to start with ``--sglang-`` are declared by the parser, so argparse
consumes them before anything reaches this module.
"""

from __future__ import annotations

import argparse

SGLANG_PREFIX = "--sglang-"

SGLANG_HELP = """\
Any SGLang server flag, prefixed with --sglang-, is passed to every rollout engine.
Collected into args.sglang_server_args (name in snake_case, values as strings;
a flag without a value is True, several values make a list). Example:
  --sglang-mem-fraction-static 0.8 --sglang-enable-metrics --sglang-cuda-graph-bs 1 2 4
  -> {"mem_fraction_static": "0.8", "enable_metrics": True, "cuda_graph_bs": ["1", "2", "4"]}"""


def add_sglang_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Document the pass-through family in ``--help`` (it declares no arguments of its own)."""
    parser.add_argument_group("SGLang: --sglang-<flag> pass-through", SGLANG_HELP)
    return parser


def collect_sglang_args(leftover: list[str]) -> tuple[dict[str, object], list[str]]:
    """Split argparse's leftover tokens into SGLang server args and unrecognized tokens.

    ``--sglang-x=v`` and ``--sglang-x v`` give ``{"x": "v"}``; ``--sglang-x v1 v2`` gives a list;
    ``--sglang-x`` followed by another ``--flag`` or by nothing gives ``True``. A repeated flag
    keeps its last value, as argparse does. Returns ``(server_args, unrecognized)``.
    """
    server_args: dict[str, object] = {}
    unrecognized: list[str] = []
    i = 0
    while i < len(leftover):
        token = leftover[i]
        i += 1
        if not token.startswith(SGLANG_PREFIX) or len(token) == len(SGLANG_PREFIX):
            unrecognized.append(token)
            continue
        name, eq, inline_value = token[len(SGLANG_PREFIX) :].partition("=")
        key = name.replace("-", "_")
        if eq:
            server_args[key] = inline_value
            continue
        values: list[str] = []
        while i < len(leftover) and not leftover[i].startswith("--"):
            values.append(leftover[i])
            i += 1
        server_args[key] = True if not values else values[0] if len(values) == 1 else values
    return server_args, unrecognized
