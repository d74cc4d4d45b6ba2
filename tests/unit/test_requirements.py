"""requirements.txt and pyproject.toml list the same dependencies (issue 33 item 6).

The usage guide installs from source with ``pip install -r requirements.txt && pip install -e .``;
pyproject.toml is what ``make`` installs. A dependency added to one and not the other would make the
two installs differ, so they are compared here. torch is the one difference allowed: requirements.txt
pins the exact build the Makefile and constraints.txt pin, which must satisfy pyproject's range.
"""

from __future__ import annotations

import tomllib
from packaging.requirements import Requirement

from tests.support.paths import REPO


def requirement_lines(path: str) -> list[str]:
    """The requirement lines of a pip requirements file: no comments, blanks or ``-c``/``-r`` options."""
    lines = (line.split("#", 1)[0].strip() for line in (REPO / path).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def by_name(lines: list[str]) -> dict[str, Requirement]:
    requirements = [Requirement(line) for line in lines]
    return {r.name.lower(): r for r in requirements}


def test_requirements_txt_matches_pyproject_dependencies() -> None:
    pyproject = by_name(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    requirements = by_name(requirement_lines("requirements.txt"))
    assert set(requirements) == set(pyproject)
    for name, requirement in requirements.items():
        if name != "torch":
            assert requirement.specifier == pyproject[name].specifier, name


def test_torch_is_pinned_as_the_makefile_pins_it() -> None:
    torch = by_name(requirement_lines("requirements.txt"))["torch"]
    pinned = by_name(requirement_lines("constraints.txt"))["torch"]
    assert str(torch.specifier) == str(pinned.specifier) and str(torch.specifier).startswith("==")
    version = str(torch.specifier).removeprefix("==")
    assert f"torch=={version}" in (REPO / "Makefile").read_text()
    pyproject = by_name(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    assert pyproject["torch"].specifier.contains(version)
    assert "-c constraints.txt" in (REPO / "requirements.txt").read_text().splitlines()
