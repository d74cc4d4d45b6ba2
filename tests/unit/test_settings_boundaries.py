"""Issue 34's boundary: below the entry points no code of slime's picks flags out of the ``args``
namespace or writes into it; each component reads its own part of ``RunSettings``.

``args`` stays where upstream slime's plugin contract puts it: ``slime/config`` (which builds the
settings from it), ``slime/cli.py`` (entry-point checks) and the plugin adapters listed below, which
hand it on or read it for plugins written against upstream slime."""

from __future__ import annotations

import ast

from tests.support.paths import REPO

SLIME = REPO / "slime"

ALLOWED = {
    "slime/cli.py": "entry-point checks, before the settings are built",
    "slime/rollout/plugin_args.py": "the plugin adapter: the router address and settings bound to args",
    "slime/rollout/rm_hub.py": "upstream slime's rm_hub.async_rm(args, sample)",
    "slime/rollout/sample.py": "upstream slime's Sample.get_reward_value(args)",
    "slime/rollout/filter_hub/dynamic_sampling_filters.py": "upstream slime's filter(args, samples)",
}
"""Module -> why it may read the namespace."""

OWN_NAMESPACES = ("slime/config/", "slime/backends/torch_engine/")
"""Where ``args`` is something else or the settings' source: the config package reads the flags; the
torch engine's ``args`` are its own server's (SGLang's ``ServerArgs``), parsed in its process."""


def namespace_uses(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """``(line, attribute, is_write)`` of every ``args.X`` / ``self.args.X`` in ``tree``'s code."""
    uses = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        named = isinstance(owner, ast.Name) and owner.id == "args"
        held = isinstance(owner, ast.Attribute) and owner.attr == "args"
        if named or held:
            uses.append((node.lineno, node.attr, isinstance(node.ctx, ast.Store)))
    for node in ast.walk(tree):  # setattr(args, ...)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
            target = node.args[0]
            if isinstance(target, ast.Name) and target.id == "args":
                uses.append((node.lineno, "setattr", True))
    return uses


def modules() -> list[tuple[str, ast.AST]]:
    return [
        (str(path.relative_to(REPO)), ast.parse(path.read_text(), str(path)))
        for path in sorted(SLIME.rglob("*.py"))
    ]


def test_no_module_below_the_entry_points_reads_the_namespace():
    found = {
        name: [f"{line}: args.{attr}" for line, attr, _ in uses]
        for name, tree in modules()
        if not name.startswith(OWN_NAMESPACES) and name not in ALLOWED and (uses := namespace_uses(tree))
    }
    assert found == {}


def test_nothing_outside_the_config_package_writes_into_the_namespace():
    writes = {
        name: [f"{line}: args.{attr}" for line, attr, is_write in uses if is_write]
        for name, tree in modules()
        if not name.startswith("slime/config/") and (uses := namespace_uses(tree))
    }
    assert {name: lines for name, lines in writes.items() if lines} == {}


def test_the_check_sees_reads_and_writes_and_the_allowed_modules_exist():
    """So the two tests above cannot pass by finding nothing."""
    tree = ast.parse("args.x = args.y\nself.args.z\nsetattr(args, 'w', 1)\n")
    assert sorted(namespace_uses(tree)) == [
        (1, "x", True),
        (1, "y", False),
        (2, "z", False),
        (3, "setattr", True),
    ]
    uses = {name: namespace_uses(tree) for name, tree in modules()}
    assert all(uses[name] for name in ALLOWED), "an allowed module no longer reads args: drop it from ALLOWED"
    assert any(uses[name] for name in uses if name.startswith("slime/config/"))
