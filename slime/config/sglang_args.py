"""Family 2: ``--sglang-<flag>``, every SGLang server flag, passed to the rollout engines.

SGLang has hundreds of server flags and adds new ones every release, so they are not declared one
by one. Every leftover ``--sglang-<name> [value ...]`` is collected into ``args.sglang_server_args``
(``<name>`` in snake_case, values as typed) and then checked against a table of flags derived from
a ``ServerArgs`` class: SGLang's own when it imports (GPU nodes), so a new upstream flag works
the day it ships (a dataclass up to SGLang 0.5.19, a ``msgspec.Struct`` from 0.5.20 on: both are
read), or the built-in ``FallbackServerArgs`` subset on machines without SGLang, where
flags outside the subset are left to the engine backend (the torch engine refuses the ones it does
not implement when it starts). The fields slime sets for each engine are refused in both cases.
That subset is slime's one hand-kept table of ServerArgs fields: the torch engine's command line
(``slime.backends.torch_engine.server_args``) takes its flags, types and defaults from it too.

slime's own flags that happen to start with ``--sglang-`` are declared by the parser, so argparse
consumes them before anything reaches this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from slime.config.errors import ConfigError

SGLANG_PREFIX = "--sglang-"

# ServerArgs fields slime sets for every engine, and what sets them: a user value would break the
# placement, the weight-update groups or the seeding.
SLIME_CONTROLLED = {
    "model_path": "from --hf-checkpoint",
    "tp_size": "from --rollout-num-gpus-per-engine",
    "host": "to the engine node's address",
    "port": "to a free port on the engine's node",
    "nccl_port": "to a free port on the engine's node",
    "dist_init_addr": "to the address of the engine's first node",
    "base_gpu_id": "from the engine's GPU bundles",
    "random_seed": "from --rollout-seed plus the engine rank",
    "enable_memory_saver": "from --colocate",
    "nnodes": "from --rollout-num-gpus-per-engine and --num-gpus-per-node",
    "node_rank": "from the engine's placement",
}

SGLANG_HELP = """\
Any SGLang server flag, prefixed with --sglang-, is passed to every rollout engine.
Where SGLang is installed its ServerArgs defines the flags, their types and choices (an
unknown flag is an error); elsewhere a built-in subset is checked and other flags are left
to the engine backend. Collected into args.sglang_server_args (name in snake_case, values
as typed; a flag without a value is True, several values make a list). Set by slime and
refused here: model path, tp size, host, port, nccl port, dist-init address, base gpu id,
random seed, memory saver, nnodes, node rank. Example:
  --sglang-mem-fraction-static 0.8 --sglang-enable-metrics --sglang-cuda-graph-bs-decode 1 2 4
  -> {"mem_fraction_static": "0.8", "enable_metrics": True, "cuda_graph_bs_decode": ["1", "2", "4"]}"""


@dataclass
class FallbackServerArgs:
    """The SGLang server flags slime knows without SGLang (field names, types and defaults as
    SGLang's ServerArgs has them): the ones RL runs set most, and the fields slime controls. Read by
    the ``--sglang-*`` check where SGLang is not installed and by the torch engine's command line,
    which honours some and accepts the others without effect. Each is a flag of SGLang 0.5.23
    (tests/unit/test_sglang_wheels.py checks it against the real class)."""

    model_path: str = ""
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    nccl_port: int | None = None
    dist_init_addr: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    random_seed: int | None = None
    enable_memory_saver: bool = False
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    load_format: str = "auto"
    trust_remote_code: bool = False
    served_model_name: str | None = None
    api_key: str | None = None
    device: str | None = None
    context_length: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    chunked_prefill_size: int | None = None
    cuda_graph_max_bs_decode: int | None = None  # --cuda-graph-max-bs before SGLang 0.5.23
    cuda_graph_bs_decode: list[int] | None = None  # --cuda-graph-bs before SGLang 0.5.23
    disable_cuda_graph: bool = False
    disable_radix_cache: bool = False
    enable_metrics: bool = False
    skip_server_warmup: bool = False
    log_level: str = "info"
    log_level_http: str | None = None
    watchdog_timeout: float = 300.0
    weight_version: str = "default"
    enable_draft_weights_cpu_backup: bool = False
    enable_lora: bool | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    lora_paths: list[str] | None = None
    max_loaded_loras: int | None = None
    max_loras_per_batch: int = 8
    lora_backend: str = "csgmv"
    enable_return_routed_experts: bool = False


@dataclass(frozen=True)
class ServerFlag:
    """How one server flag takes its value: ``switch`` (none), ``value`` (one), ``list`` (one or
    more) or ``any`` (a custom argparse action or a type we cannot check: passed as given)."""

    field: str
    kind: Literal["switch", "value", "list", "any"]
    parse: Callable[[str], Any] = str
    choices: tuple[Any, ...] | None = None
    min_values: int = 1  # 0: the flag alone is valid too (nargs "?" or "*")


@dataclass(frozen=True)
class ServerArgsSource:
    """The ServerArgs class the flags come from; ``strict``: refuse flags it does not have."""

    cls: type
    strict: bool
    origin: str


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


def server_flags(server_args: dict[str, Any]) -> list[str]:
    """``args.sglang_server_args`` back into command-line flags (``{"a_b": "1"}`` -> ``--a-b 1``)."""
    flags: list[str] = []
    for name, value in server_args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            flags += [flag, *(str(v) for v in value)]
        else:
            flags += [flag, str(value)]
    return flags


@functools.cache
def server_args_source() -> ServerArgsSource:
    """SGLang's ServerArgs when SGLang imports here, else the built-in subset.

    ``find_spec`` first: on machines without SGLang this costs nothing, and ``parse_args`` stays
    free of heavy imports there. Where SGLang is installed, importing its ServerArgs pulls in torch.
    """
    if importlib.util.find_spec("sglang") is not None:
        try:
            import sglang
            from sglang.srt.server_args import ServerArgs
        except Exception as e:  # a broken install: check what we can, let the engine report the rest
            return ServerArgsSource(
                FallbackServerArgs, False, f"slime's built-in subset (import sglang failed: {e})"
            )
        return ServerArgsSource(ServerArgs, True, f"SGLang {getattr(sglang, '__version__', '?')}")
    return ServerArgsSource(FallbackServerArgs, False, "slime's built-in subset (SGLang not installed)")


def check_sglang_server_args(server_args: dict[str, Any], source: ServerArgsSource | None = None) -> None:
    """Raise ``ConfigError`` for a slime-controlled field, an unknown flag (strict sources only),
    a switch given a value, a value of the wrong type or outside the choices, or a wrong count."""
    source = source or server_args_source()
    flags = derive_server_flags(source.cls)
    for key, value in server_args.items():
        flag = SGLANG_PREFIX + key.replace("_", "-")
        spec = flags.get(key)
        field = spec.field if spec is not None else key
        if field in SLIME_CONTROLLED:
            raise ConfigError(flag, f"is set by slime for each engine ({SLIME_CONTROLLED[field]}); drop it")
        if spec is None:
            if source.strict:
                raise ConfigError(
                    flag,
                    f"is not a server flag of {source.origin}; see python -m sglang.launch_server --help",
                )
            continue
        _check_value(flag, spec, value)


def _check_value(flag: str, spec: ServerFlag, value: Any) -> None:
    if spec.kind == "any":
        return
    if spec.kind == "switch":
        if value is not True:
            raise ConfigError(flag, f"is a switch and takes no value, got {value!r}; write {flag} alone")
        return
    if value is True:  # the flag alone
        if spec.min_values == 0:
            return
        raise ConfigError(flag, f"needs a value; write {flag} VALUE")
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if spec.kind == "value" and len(values) != 1:
        raise ConfigError(flag, f"takes one value, got {len(values)} ({' '.join(map(str, values))})")
    for raw in values:
        try:
            parsed = spec.parse(str(raw))
        except Exception as e:
            kind = getattr(spec.parse, "__name__", "value")
            raise ConfigError(flag, f"invalid {kind} value {str(raw)!r} ({e})") from e
        if spec.choices is not None and parsed not in spec.choices:
            options = ", ".join(map(str, spec.choices))
            raise ConfigError(flag, f"{str(raw)!r} is not one of {options}")


@functools.cache
def derive_server_flags(cls: type) -> dict[str, ServerFlag]:
    """The command-line flags of a ServerArgs-shaped class (dataclass or msgspec Struct), keyed by
    snake_case flag name.

    One flag per init field, named after it, plus the ``cli_name`` / ``aliases`` of SGLang's
    ``Arg`` metadata where fields are ``Annotated`` with it. Types follow SGLang's own mapping:
    ``bool`` is a switch, ``list[X]`` takes one or more X, ``Optional[X]`` takes an X,
    ``Literal[...]`` and ``Arg(choices=...)`` restrict the values. Where the class builds its own
    CLI (``add_cli_args``, as SGLang's does) that CLI decides which flags exist: fields it leaves
    out are not flags, and flags it registers by hand (deprecated aliases, ``--config``) are
    accepted as given, under the field they set.
    """
    hints = _type_hints(cls)
    cli = _cli_flags(cls)
    flags = dict(cli)
    for field in init_fields(cls):
        hint, meta = _unwrap_annotated(hints.get(field))
        if getattr(meta, "no_cli", False):
            continue
        spec = _flag_spec(field, hint, meta)
        names = [getattr(meta, "cli_name", None) or field, *(getattr(meta, "aliases", None) or [])]
        for name in names:
            key = name.lstrip("-").replace("-", "_")
            if not cli or key in cli:
                flags[key] = spec
    return flags


def init_fields(cls: type) -> list[str]:
    """The constructor fields of a ServerArgs class, in declaration order.

    SGLang's ``ServerArgs`` is a dataclass up to 0.5.19 and a ``msgspec.Struct`` from 0.5.20 on
    (``sglang/srt/server_args.py``); a Struct lists its fields in ``__struct_fields__`` (all of them
    constructor arguments), a dataclass in ``dataclasses.fields`` (``init=False`` ones are not).
    """
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init]
    struct_fields = getattr(cls, "__struct_fields__", None)
    if isinstance(struct_fields, tuple):
        return list(struct_fields)
    raise TypeError(f"{cls.__module__}.{cls.__qualname__} is neither a dataclass nor a msgspec.Struct")


def _cli_flags(cls: type) -> dict[str, ServerFlag]:
    """Every ``--flag`` of ``cls.add_cli_args`` (SGLang's own CLI), unchecked; empty without one."""
    add_cli_args = getattr(cls, "add_cli_args", None)
    if add_cli_args is None:
        return {}
    parser = argparse.ArgumentParser(add_help=False)
    try:
        add_cli_args(parser)
    except Exception:  # an SGLang whose CLI cannot be built here: the fields alone still hold
        return {}
    return {
        option[2:].replace("-", "_"): ServerFlag(action.dest, "any")
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--")
    }


def _type_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations; a field whose annotation does not resolve maps to None (unchecked)."""
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:
        pass
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        module = sys.modules.get(klass.__module__)
        namespace = dict(vars(module)) if module is not None else {}
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            try:
                hints[name] = typing.get_type_hints(
                    types.SimpleNamespace(__annotations__={name: annotation}), namespace, include_extras=True
                )[name]
            except Exception:
                hints[name] = None
    return hints


def _unwrap_annotated(hint: Any) -> tuple[Any, Any]:
    """``Annotated[T, Arg(...)]`` -> ``(T, Arg)``; SGLang's ``Arg`` is read by attribute only."""
    if typing.get_origin(hint) is not Annotated:
        return hint, None
    inner, *extras = typing.get_args(hint)
    meta = next((e for e in extras if hasattr(e, "choices") and hasattr(e, "aliases")), None)
    return inner, meta


def _flag_spec(field: str, hint: Any, meta: Any) -> ServerFlag:
    choices = getattr(meta, "choices", None)
    choices = tuple(choices) if choices else None
    type_parser = getattr(meta, "type_parser", None)
    if hint is None or getattr(meta, "action", None) is not None:
        return ServerFlag(field, "any")
    hint = _unwrap_optional(hint)
    if typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        return ServerFlag(field, "value", _scalar_parser(type(values[0])), choices or values)
    if hint is bool:
        return ServerFlag(field, "switch")
    if typing.get_origin(hint) is list and type_parser is None:
        (element,) = typing.get_args(hint) or (str,)
        min_values = 0 if getattr(meta, "nargs", None) == "*" else 1
        return ServerFlag(field, "list", _scalar_parser(element), choices, min_values)
    if type_parser is None and hint not in (int, float, str):
        return ServerFlag(field, "any")
    min_values = 0 if getattr(meta, "nargs", None) == "?" else 1  # "?": the flag alone takes the const
    return ServerFlag(field, "value", type_parser or _scalar_parser(hint), choices, min_values)


def _unwrap_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _scalar_parser(tp: Any) -> Callable[[str], Any]:
    return tp if tp in (int, float) else str
