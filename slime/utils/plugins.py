"""User plugins: the one loader for every ``--*-path`` flag, and the contract each flag's target must meet.

A plugin path is either a dotted path, ``pkg.module.fn`` (imported from ``sys.path``), a file path,
``path/to/file.py:fn`` (loaded from that file, so a script next to a launch command needs no package),
or a bare ``path/to/file.py``, which names the conventional attribute of its flag (``DEFAULT_NAMES``:
the usage guide writes ``--custom-generate-function-path custom_generate.py``).

``--custom-generate-function-path`` has two forms: slime's per-sample ``fn(args, sample,
sampling_params)`` and the usage guide's per-group ``fn(args, samples, evaluation=False)``
(``is_group_generate`` tells them apart). ``--custom-rm-path`` may name a reward-model class,
``C(model_path)`` with ``compute_reward(prompts, responses) -> list`` (checked by ``check_plugin``).

``PLUGIN_CONTRACTS`` names, per flag, the parameters slime passes. ``check_plugin`` binds those
parameters to the target's signature at start-up, so a plugin written for another contract is one
clear line before any process starts instead of a ``TypeError`` deep inside a Ray actor. Parameter
names are documentation: only the number (and the kind: async function, class with methods) is checked.

This module is imported by argument validation, so it must stay free of heavy imports (no torch).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class PluginError(ValueError):
    """A plugin path that cannot be loaded or whose target breaks its flag's contract."""


@dataclass(frozen=True)
class PluginContract:
    """What slime calls a plugin with: ``kind`` and the positional parameters it passes."""

    params: tuple[str, ...]
    """Positional arguments slime passes (for a class: its constructor's)."""
    kind: str = "sync"
    """``sync`` (called directly: must not be ``async def``), ``async`` (must be), ``any``, or ``class``."""
    methods: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """For ``class``: method name -> parameters after ``self``."""
    returns: str = ""
    """What the plugin returns, for the error message."""

    def describe(self) -> str:
        """The documented form, e.g. ``async fn(args, sample, sampling_params) -> Sample``."""
        if self.kind == "class":
            methods = ", ".join(f"{name}({', '.join(p)})" for name, p in self.methods.items())
            return f"a class C({', '.join(self.params)}) with methods {methods}"
        prefix = "async " if self.kind == "async" else ""
        arrow = f" -> {self.returns}" if self.returns else ""
        return f"{prefix}fn({', '.join(self.params)}){arrow}"


# Every flag whose value is a plugin path, with what slime passes. Adding a plugin flag is adding a line.
PLUGIN_CONTRACTS: dict[str, PluginContract] = {
    "--rollout-function-path": PluginContract(
        ("args", "rollout_id", "data_source", "evaluation"), returns="RolloutOutput"
    ),
    "--custom-generate-function-path": PluginContract(
        ("args", "sample", "sampling_params"), kind="async", returns="Sample | list[Sample]"
    ),
    "--custom-rm-path": PluginContract(
        ("args", "sample_or_group"), kind="any", returns="float | dict (list with --group-rm)"
    ),
    "--custom-reward-post-process-path": PluginContract(
        ("args", "samples"), returns="(raw_rewards, rewards)"
    ),
    "--custom-advantage-function-path": PluginContract(("args", "data"), returns="list[list[float]]"),
    "--custom-loss-function-path": PluginContract(
        ("args", "batch", "log_probs", "entropy"), returns="(loss, metrics)"
    ),
    "--dynamic-sampling-filter-path": PluginContract(("args", "group"), returns="FilterResult | bool"),
    "--buffer-filter-path": PluginContract(("args", "buffer", "num_groups"), returns="list[list[Sample]]"),
    "--data-source-path": PluginContract(
        ("args",),
        kind="class",
        methods={
            "get_samples": ("num_groups",),
            "add_samples": ("groups",),
            "save": ("rollout_id", "directory"),
            "load": ("rollout_id", "directory"),
        },
    ),
}


# The attributes a bare ``file.py`` names, tried in order: the names the usage guide and upstream slime
# give these plugins, so their files run without a ``:name`` suffix.
DEFAULT_NAMES: dict[str, tuple[str, ...]] = {
    "--custom-generate-function-path": ("custom_generate", "generate"),
    "--custom-rm-path": ("reward_func", "CustomRewardModel"),
}

GROUP_GENERATE = "async fn(args, samples, evaluation=False) -> list[Sample]"
"""The usage guide's generate form: the whole prompt group at once."""

REWARD_MODEL = "a class C(model_path) with method compute_reward(prompts, responses) -> list[float]"
"""The usage guide's reward-model form of ``--custom-rm-path``."""


UPSTREAM_BUFFER_FILTER = "fn(args, rollout_id, buffer, num_samples) (upstream slime's form)"
_OTHER_FORMS = {
    "--custom-generate-function-path": GROUP_GENERATE,
    "--custom-rm-path": REWARD_MODEL,
    "--buffer-filter-path": UPSTREAM_BUFFER_FILTER,
}


def bind_buffer_filter(fn: Callable[..., Any], args: Any) -> Callable[[list, int], list]:
    """``--buffer-filter-path`` bound to ``args``: the usage guide's ``(args, buffer, num_samples)``, or
    upstream slime's current ``(args, rollout_id, buffer, num_samples)``, which upstream's data source
    calls with ``rollout_id`` None (``slime/rollout/data_source.py``), as here."""
    if _takes_rollout_id(fn):
        return functools.partial(fn, args, None)
    return functools.partial(fn, args)


def _takes_rollout_id(fn: Callable[..., Any]) -> bool:
    return _accepts(fn, 4) and not _accepts(fn, 3)


def _import_file(file_path: str) -> Any:
    """The module at ``file_path``, loaded once per process under a name derived from its real path."""
    real = os.path.realpath(file_path)
    if not os.path.isfile(real):
        raise PluginError(f"file {file_path!r} does not exist; pass path/to/file.py:function")
    stem = os.path.splitext(os.path.basename(real))[0]
    name = f"slime_plugin_{stem}_{hashlib.sha1(real.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, real)
    if spec is None or spec.loader is None:
        raise PluginError(f"{file_path!r} cannot be loaded as a Python module; name a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _split_file_path(path: str) -> tuple[str, str] | None:
    """``(file, attr)`` of a ``file.py:attr`` path; None for a dotted path."""
    location, _, attr = path.rpartition(":")
    return (location, attr) if location.endswith(".py") else None


def absolute_path(path: str) -> str:
    """``path`` with its file part made absolute, so Ray workers with another working directory load it."""
    split = _split_file_path(path)
    return path if split is None else f"{os.path.abspath(split[0])}:{split[1]}"


def resolve_path(flag: str, path: str) -> str:
    """``path`` in the form every process loads: a bare ``file.py`` becomes ``/abs/file.py:name`` with
    the first of ``DEFAULT_NAMES[flag]`` the file defines; other forms get an absolute file part.

    Raises ``PluginError`` naming the names tried (or, for a flag without conventional names, how
    to name one)."""
    if not path.endswith(".py"):
        return absolute_path(path)
    names = DEFAULT_NAMES.get(flag, ())
    if not names:
        raise PluginError(f"{path!r} names a file but no function in it; write {path}:function_name")
    module = _load_file(path)
    for name in names:
        if hasattr(module, name):
            return f"{os.path.abspath(path)}:{name}"
    raise PluginError(
        f"{path} defines none of {', '.join(names)} (the names a bare file is looked up by); "
        f"define one or write {path}:function_name"
    )


def _load_file(file_path: str) -> Any:
    """``_import_file``, with an error of the file's own code while loading as one ``PluginError`` line."""
    try:
        return _import_file(file_path)
    except PluginError:
        raise
    except Exception as e:
        raise PluginError(f"cannot load {file_path!r} ({_one_line(e)}); fix the file") from e


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


@functools.cache
def load_function(path: str) -> Callable[..., Any]:
    """The object ``path`` names: ``pkg.module.attr`` or ``path/to/file.py:attr`` (cached per process).

    A bare ``file.py`` is refused: which name it means depends on the flag (``resolve_path``).

    Raises ``PluginError`` with one line saying what is wrong and how to write the path.
    """
    if path.endswith(".py"):
        raise PluginError(f"{path!r} names a file but no function in it; write {path}:function_name")
    split = _split_file_path(path)
    if split is not None:
        location, attr = split
        module = _load_file(location)
    else:
        module_name, _, attr = path.rpartition(".")
        if not module_name or not attr:
            raise PluginError(
                f"{path!r} is not a dotted path module.attr or a file path file.py:attr; "
                "use e.g. my_pkg.rewards.score or path/to/rewards.py:score"
            )
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise PluginError(
                f"cannot import module {module_name!r} ({_one_line(e)}); check the path and PYTHONPATH"
            ) from e
    try:
        target = getattr(module, attr)
    except AttributeError as e:
        raise PluginError(f"{_one_line(e)}; check the name in {path}") from e
    if not callable(target):
        raise PluginError(f"{path} is a {type(target).__name__}, not a callable; point it at a function")
    return target


def _accepts(fn: Callable[..., Any], num_params: int) -> bool:
    """Whether ``fn`` can be called with ``num_params`` positional arguments (unknown signature: yes)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and C callables may not expose one
        return True
    try:
        signature.bind(*range(num_params))
    except TypeError:
        return False
    return True


def _shown(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(?)"


def is_group_generate(fn: Callable[..., Any]) -> bool:
    """Whether a generate function takes the whole prompt group (the usage guide's form): its first
    parameter after ``args`` is called ``samples`` or annotated as a list."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if len(params) < 2:
        return False
    data = params[1]
    annotation = data.annotation
    if isinstance(annotation, str):  # ``from __future__ import annotations`` leaves it unevaluated
        is_list = annotation.replace("typing.", "").startswith(("list", "List"))
    else:
        is_list = annotation is list or getattr(annotation, "__origin__", None) is list
    return data.name == "samples" or is_list


def declares(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (or ``**kwargs``), so it may be passed by keyword."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def reward_model_needs_path(cls: type) -> bool:
    """Whether a reward-model class cannot be built without ``model_path``."""
    return not _accepts(cls, 0)


def _check_reward_model(path: str, cls: type) -> type:
    """A ``--custom-rm-path`` class: buildable from ``model_path`` and with ``compute_reward(prompts,
    responses)``, sync or async."""
    if not _accepts(cls, 1) and not _accepts(cls, 0):
        raise PluginError(f"{path}{_shown(cls)} cannot be built as C(model_path); expected {REWARD_MODEL}")
    method = getattr(cls, "compute_reward", None)
    if not callable(method):
        raise PluginError(f"{path} has no method compute_reward; expected {REWARD_MODEL}")
    bound = isinstance(inspect.getattr_static(cls, "compute_reward"), (staticmethod, classmethod))
    if not _accepts(method, 2 + (0 if bound else 1)):
        raise PluginError(
            f"{path}.compute_reward{_shown(method)} does not take (prompts, responses); "
            f"expected {REWARD_MODEL}"
        )
    return cls


def check_plugin(flag: str, path: str) -> Callable[..., Any]:
    """Loads ``path`` (after ``resolve_path``) and checks it against ``flag``'s contract; returns the target.

    Raises ``PluginError`` naming the target's actual signature and the documented one.
    """
    path = resolve_path(flag, path)
    contract = PLUGIN_CONTRACTS[flag]
    target = load_function(path)
    expected = contract.describe()
    if flag in _OTHER_FORMS:
        expected += f" or {_OTHER_FORMS[flag]}"
    if flag == "--custom-rm-path" and inspect.isclass(target):
        return _check_reward_model(path, target)
    if flag == "--buffer-filter-path" and _takes_rollout_id(target):
        return target
    if flag == "--custom-generate-function-path" and is_group_generate(target):
        if not inspect.iscoroutinefunction(target) or not _accepts(target, 2):
            raise PluginError(f"{path}{_shown(target)} takes samples but is not {GROUP_GENERATE}")
        return target
    if contract.kind == "class":
        if not inspect.isclass(target):
            raise PluginError(f"{path} is a {type(target).__name__}, not a class; expected {expected}")
        if not _accepts(target, len(contract.params)):
            raise PluginError(f"{path}{_shown(target)} cannot be built as {expected}")
        for name, params in contract.methods.items():
            method = getattr(target, name, None)
            if not callable(method):
                raise PluginError(f"{path} has no method {name}; expected {expected}")
            # Looked up on the class, a plain method still takes ``self``; static and class methods do not.
            bound = isinstance(inspect.getattr_static(target, name), (staticmethod, classmethod))
            if not _accepts(method, len(params) + (0 if bound else 1)):
                raise PluginError(
                    f"{path}.{name}{_shown(method)} does not take ({', '.join(params)}); expected {expected}"
                )
        return target
    if contract.kind == "async" and not inspect.iscoroutinefunction(target):
        raise PluginError(f"{path} is not an async function; expected {expected}")
    if contract.kind == "sync" and inspect.iscoroutinefunction(target):
        raise PluginError(f"{path} is an async function, but slime calls it directly; expected {expected}")
    if not _accepts(target, len(contract.params)):
        raise PluginError(
            f"{path}{_shown(target)} does not take ({', '.join(contract.params)}); expected {expected}"
        )
    return target
