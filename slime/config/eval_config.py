"""The evaluation sets of a run, each settled into one ``EvalSetSettings`` before anything starts.

Sets come from ``--eval-prompt-data NAME PATH ...`` or from an ``--eval-config`` YAML file, never
both (two lists of sets would need a rule for order and clashes that no one would remember). The
file is a list of sets; each names ``name`` and ``path`` and may override any other key of
``EvalSetSettings``:

    - name: aime
      path: /data/aime-2024.jsonl
      n_samples_per_eval_prompt: 16
      temperature: 0.6
    - name: gsm8k
      path: /data/gsm8k-test.jsonl@[0:500]
      label_key: answer
      rm_type: math

A key a set leaves out falls back to its ``--eval-*`` flag, then to the rollout's flag
(``temperature``: ``--eval-temperature``, then ``--rollout-temperature``). ``rm_type`` and
``custom_rm_path`` are one choice: a set that names either takes neither from the flags (and scores
per sample: ``--group-rm`` belongs to the flags' ``--custom-rm-path``). An unknown key, a missing
``name``/``path`` or a value of the wrong type is one ``ConfigError`` line naming the file, the set
and the key. Paths are relative to the working directory, as the flags' are.

The evaluation path reads a set's settings from its ``EvalSetSettings``, never from ``args``.
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import yaml

from slime.config.errors import ConfigError

FLAG = "--eval-config"


@dataclass(frozen=True, kw_only=True)
class EvalSetSettings:
    """Everything one evaluation set is read, sampled and scored with, every fallback applied."""

    name: str
    """Metric prefix: ``eval/<name>``."""
    path: str
    """JSONL or Parquet file, optionally ``PATH@[start:end]``."""
    input_key: str
    """Prompt field (``--eval-input-key``, then ``--input-key``)."""
    label_key: str | None
    """Label field (``--eval-label-key``, then ``--label-key``)."""
    rm_type: str | None
    """Built-in reward function (``--rm-type``)."""
    custom_rm_path: str | None
    """Reward plugin ``fn(args, sample)`` (``--custom-rm-path``); wins over ``rm_type``."""
    group_rm: bool
    """Whether ``custom_rm_path`` scores whole groups: ``--group-rm`` for the flags' reward only."""
    n_samples_per_eval_prompt: int
    """Responses per prompt (``--n-samples-per-eval-prompt``); pass@k goes up to it."""
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int
    """Max new tokens (``--eval-max-response-len``, then ``--rollout-max-response-len``)."""
    apply_chat_template: bool
    """Render prompts with the tokenizer's chat template (``--apply-chat-template``)."""


# What a set in the file may say; ``group_rm`` is derived, never written.
CONFIG_KEYS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(EvalSetSettings) if f.name != "group_rm"
)
_REWARD_KEYS = ("rm_type", "custom_rm_path")


def eval_sets_from_args(args: argparse.Namespace) -> list[EvalSetSettings]:
    """The run's evaluation sets from ``--eval-config`` or ``--eval-prompt-data``, names unique.

    Needs the ``--eval-*`` sampling and key flags already defaulted to the rollout's (validation does
    that first). Data files are not opened here: validation checks they exist.
    """
    specs = args.eval_prompt_data or []
    if args.eval_config is not None:
        if specs:
            raise ConfigError(
                FLAG, "cannot be combined with --eval-prompt-data; list every set in the file, drop the flag"
            )
        entries = enumerate(read_eval_config(args.eval_config), start=1)
        sets = [resolve_eval_set(args, e, f"{args.eval_config}: set {i}") for i, e in entries]
        flag = FLAG
    else:
        if len(specs) % 2:
            raise ConfigError(
                "--eval-prompt-data",
                f"got {len(specs)} value(s), expected NAME PATH pairs; e.g. aime /data/aime.jsonl",
            )
        flag = "--eval-prompt-data"
        pairs = enumerate(zip(specs[::2], specs[1::2], strict=True), start=1)
        sets = [resolve_eval_set(args, {"name": n, "path": p}, f"set {i}", flag) for i, (n, p) in pairs]
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ConfigError(flag, f"dataset names repeat in {names}; give each set its own name")
    return sets


def read_eval_config(path: str) -> list[dict[str, Any]]:
    """The sets of an ``--eval-config`` file as written: a non-empty YAML list of mappings."""
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(FLAG, f"{path} does not exist; pass a YAML file listing the eval sets") from None
    except yaml.YAMLError as e:
        problem = " ".join(str(e).split())
        raise ConfigError(FLAG, f"{path} is not valid YAML ({problem})") from e
    if not isinstance(loaded, list) or not loaded:
        raise ConfigError(FLAG, f"{path} must be a non-empty YAML list of sets (- name: ...  path: ...)")
    for i, entry in enumerate(loaded):
        if not isinstance(entry, dict):
            raise ConfigError(FLAG, f"{path}: set {i + 1} is a {type(entry).__name__}, not a mapping of keys")
    return loaded


def resolve_eval_set(
    args: argparse.Namespace, entry: dict[str, Any], where: str, flag: str = FLAG
) -> EvalSetSettings:
    """One set's settings: ``entry``'s keys, the rest from the flags; ``flag`` and ``where`` (the file
    and the set's place in it) name the set in errors."""
    if isinstance(entry.get("name"), str) and entry["name"]:
        where = f"{where} ({entry['name']})"
    for key in entry:
        if key not in CONFIG_KEYS:
            raise ConfigError(flag, f"{where}: unknown key {key!r}; known keys: {', '.join(CONFIG_KEYS)}")
    for key in ("name", "path"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ConfigError(flag, f"{where}: {key!r} is required and must be a non-empty string")
    own_reward = any(key in entry for key in _REWARD_KEYS)
    defaults = {
        "input_key": args.eval_input_key,
        "label_key": args.eval_label_key,
        "rm_type": None if own_reward else args.rm_type,
        "custom_rm_path": None if own_reward else args.custom_rm_path,
        "n_samples_per_eval_prompt": args.n_samples_per_eval_prompt,
        "temperature": args.eval_temperature,
        "top_p": args.eval_top_p,
        "top_k": args.eval_top_k,
        "max_response_len": args.eval_max_response_len,
        "apply_chat_template": args.apply_chat_template,
    }
    values = {**defaults, **entry}
    for key, value in values.items():
        _check_value(flag, where, key, value)
    values["temperature"], values["top_p"] = float(values["temperature"]), float(values["top_p"])
    return EvalSetSettings(**values, group_rm=args.group_rm and not own_reward)


def _check_value(flag: str, where: str, key: str, value: Any) -> None:
    """A value of the type (and range) its key needs; ``where`` names the set."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    plugin = "a plugin path (pkg.module.fn or file.py:fn)"
    checks = {
        "name": (isinstance(value, str), "a string"),
        "path": (isinstance(value, str), "a string"),
        "input_key": (isinstance(value, str), "a string"),
        "label_key": (value is None or isinstance(value, str), "a string"),
        "rm_type": (value is None or isinstance(value, str), "a string"),
        "custom_rm_path": (value is None or isinstance(value, str), plugin),
        "n_samples_per_eval_prompt": (is_int and value >= 1, "an integer >= 1"),
        "temperature": (is_number and value >= 0, "a number >= 0"),
        "top_p": (is_number and 0 < value <= 1, "a number in (0, 1]"),
        "top_k": (is_int and (value == -1 or value >= 1), "-1 (off) or an integer >= 1"),
        "max_response_len": (is_int and value >= 1, "an integer >= 1"),
        "apply_chat_template": (isinstance(value, bool), "true or false"),
    }
    ok, expected = checks[key]
    if not ok:
        raise ConfigError(flag, f"{where}: {key} must be {expected}, got {value!r}")
