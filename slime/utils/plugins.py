"""User plugins: the one loader for every ``--*-path`` flag, and the contract each flag's target must meet.

A plugin path is either a dotted path, ``pkg.module.fn`` (imported from ``sys.path``), or a file path,
``path/to/file.py:fn`` (loaded from that file, so a script next to a launch command needs no package).

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


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


@functools.cache
def load_function(path: str) -> Callable[..., Any]:
    """The object ``path`` names: ``pkg.module.attr`` or ``path/to/file.py:attr`` (cached per process).

    Raises ``PluginError`` with one line saying what is wrong and how to write the path.
    """
    split = _split_file_path(path)
    if split is not None:
        location, attr = split
        try:
            module = _import_file(location)
        except PluginError:
            raise
        except Exception as e:  # the file's own code raised while loading
            raise PluginError(f"cannot load {location!r} ({_one_line(e)}); fix the file") from e
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


def check_plugin(flag: str, path: str) -> Callable[..., Any]:
    """Loads ``path`` and checks it against ``flag``'s contract; returns the target.

    Raises ``PluginError`` naming the target's actual signature and the documented one.
    """
    contract = PLUGIN_CONTRACTS[flag]
    target = load_function(path)
    expected = contract.describe()
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
