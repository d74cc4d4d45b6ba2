"""The one parser for all three flag families, and the entry point that validates before start-up.

``parse_args`` is the only function ``train.py`` needs: it parses Megatron-LM flags, slime flags
and the ``--sglang-*`` pass-through, fills in the values left to slime (``derive``) and checks the
result (``validate``), and on any problem prints a single
``error: <flag>: <what is wrong>; <what to do>`` line and exits with code 2, before any Ray
actor, placement group or engine exists. The result is a flat Namespace with Megatron-LM dest
names, because user plugins receive ``args`` as they do in slime and Megatron-LM.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable, Collection, Sequence
from typing import NoReturn

from slime.config import derive, validate
from slime.config.errors import ConfigError
from slime.config.megatron_args import add_megatron_arguments
from slime.config.sglang_args import add_sglang_arguments, collect_sglang_args
from slime.config.slime_args import add_slime_arguments

_ARGUMENT_ERROR = re.compile(r"^argument (?P<names>[^:]+): (?P<message>.*)$", re.DOTALL)

_DESCRIPTION = """\
slime: RL post-training for LLMs (Megatron-core trainers, SGLang rollout engines, Ray).
Three flag families share this parser: Megatron-LM flags under their Megatron-LM names (model
flags left out are read from --hf-checkpoint's config.json), --sglang-<flag> passed to every
engine, and slime's own flags. Everything is checked before anything starts."""


def _fail(line: str) -> NoReturn:
    sys.stderr.write(" ".join(line.split()) + "\n")
    sys.exit(2)


_USAGE = "%(prog)s [MEGATRON FLAGS] [SLIME FLAGS] [--sglang-<flag> [VALUE ...] ...]"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults after each help sentence and keep the hand-wrapped group descriptions."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # On/off switches: "(default: True)" after --disable-bias-linear would only confuse, and
        # "(default: None)" says nothing the help sentence does not.
        if action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)


class SlimeArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that never guesses abbreviations and fails in one line, without usage."""

    def __init__(self, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        kwargs.setdefault("description", _DESCRIPTION)
        kwargs.setdefault("usage", _USAGE)
        super().__init__(**kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        """Print ``error: <flag>: <problem>; see --help`` and exit 2 (argparse prints usage too)."""
        match = _ARGUMENT_ERROR.match(message)
        if match:
            message = f"{match['names'].split('/')[0]}: {match['message']}"
        _fail(f"error: {message}; see --help")


def build_parser() -> SlimeArgumentParser:
    """All flags of the three families, grouped by family in ``--help``."""
    parser = SlimeArgumentParser()
    add_megatron_arguments(parser)
    add_sglang_arguments(parser)
    add_slime_arguments(parser)
    return parser


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests of the flags typed in ``argv``: a model flag left out is filled from config.json."""
    # argparse keeps no record of which values came from the command line, so map the option
    # strings back to their actions (exact names only: abbreviations are disabled).
    actions = parser._option_string_actions
    dests: set[str] = set()
    for token in argv:
        if token == "--":
            break
        action = actions.get(token.split("=", 1)[0]) if token.startswith("-") else None
        if action is not None:
            dests.add(action.dest)
    return dests


def configure_steps(
    args: argparse.Namespace, explicit: Collection[str] | None = None
) -> tuple[Callable[[argparse.Namespace], None], ...]:
    """The derivations (``derive``, which write) and checks (``validate``, which only read) in the order
    they run: each derivation after the checks of what it reads, so that the first problem of a
    command line is the one reported. ``explicit`` is as for ``configure``."""
    return (
        derive.fill_modes,
        validate.check_modes,
        validate.check_required,
        validate.check_ranges,
        validate.check_sglang,
        validate.check_paths,
        validate.check_data_loading,
        functools.partial(derive.fill_model_from_hf, given=derive.given_fn(args, explicit)),
        validate.check_model_shape,
        derive.fill_model,
        derive.fill_cluster,
        validate.check_cluster,
        derive.fill_batch,
        validate.check_batch,
        derive.fill_data_parallel_size,
        validate.check_parallelism,
        validate.check_training_options,
        derive.fill_weight_transport,
        validate.check_weight_sync,
        validate.check_engine_backend,
        derive.fill_algorithm,
        validate.check_algorithm,
        derive.fill_eval,
        validate.check_eval,
        validate.check_plugins,
        derive.fill_plugin_paths,
        validate.check_reward_model_flags,
    )


def configure(args: argparse.Namespace, explicit: Collection[str] | None = None) -> None:
    """Fill every value left to slime into ``args`` and check them all; raises ``ConfigError`` on the
    first problem.

    ``explicit`` is the set of dests the user typed (``parse_args`` passes it). A model flag not in
    it is filled from config.json; one in it must match. Without it, a Megatron flag still at its
    Megatron default counts as omitted.
    """
    for step in configure_steps(args, explicit):
        step(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, derive and check; on any problem print one error line and exit with code 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, leftover = parser.parse_known_args(argv)
    args.sglang_server_args, unrecognized = collect_sglang_args(leftover)
    if unrecognized:
        parser.error(f"unrecognized arguments: {' '.join(unrecognized)}")
    try:
        configure(args, explicit=explicit_dests(parser, argv))
    except ConfigError as e:
        _fail(e.line())
    return args
