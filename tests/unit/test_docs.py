"""The README and ``docs/`` point only at things that exist: relative links, repository paths and
flags. The README stays a front page that reaches the GPU command and the reward hook early.

What is checked, in ``README.md`` and every ``docs/**/*.md``:

- every relative link ``[text](path)`` resolves from the document's own folder;
- every inline-code path whose first part is an entry of the repository root exists (globs must
  match something; ``path:function`` is checked by its path part);
- every ``--flag`` is a flag of ``train.py`` (``--sglang-<x>``: a field of SGLang's ``ServerArgs``),
  a flag one of the repository's own scripts defines, or one of a few external commands' flags
  (``EXTERNAL_FLAGS``).
"""

from __future__ import annotations

import functools
import glob
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
GPU_SCRIPT = REPO / "scripts" / "run-qwen3-4B.sh"

EXTERNAL_FLAGS = {
    # docker build / run
    "--gpus", "--network", "--ipc", "--shm-size", "--build-arg", "--rm",
    # pip
    "--no-deps",
    # hf download (huggingface_hub's CLI)
    "--local-dir", "--repo-type",
    # pytest
    "--durations",
    # sglang-router's own flags (slime starts it with them; --router-extra-args passes more)
    "--disable-retries", "--policy",
}  # fmt: skip
"""Flags of other programs that the docs show in their commands."""

FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w/-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![a-z0-9])(-[<*])?")
ADD_ARGUMENT = re.compile(r"add_argument\((.*?)\)\s*$", re.DOTALL | re.MULTILINE)
STRING_FLAG = re.compile(r"""["'](--[a-z][a-z0-9-]*)["']""")


def documents() -> list[Path]:
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def broken_links(doc: Path) -> list[str]:
    """Relative link targets of ``doc`` that do not exist (web links and bare anchors are skipped)."""
    text = FENCE.sub("", doc.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    return broken


@functools.cache
def root_entries(repo: Path = REPO) -> frozenset[str]:
    """The repository root's tracked entries: what a run writes there (``outputs/``) is not the repo's."""
    tracked = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=repo, check=True
    ).stdout.splitlines()
    return frozenset(path.split("/", 1)[0] for path in tracked)


def missing_paths(doc: Path, repo: Path = REPO) -> list[str]:
    """Inline-code words that name a path under a repository-root entry and do not exist there."""
    text = FENCE.sub("", doc.read_text())
    roots, missing = root_entries(repo), []
    for span in INLINE_CODE.findall(text):
        for word in span.split():
            word = word.strip("\"'(),;").split(":", 1)[0]
            first = word.split("/", 1)[0]
            if first not in roots or "/" not in word or re.search(r"[<{$\[]", word):
                continue
            found = glob.glob(str(repo / word)) if "*" in word else (repo / word).exists()
            if not found:
                missing.append(word)
    return missing


@functools.cache
def train_flags() -> frozenset[str]:
    from slime.config.parser import build_parser

    return frozenset(option for option in build_parser()._option_string_actions if option.startswith("--"))


@functools.cache
def script_flags() -> frozenset[str]:
    """Flags the repository's own scripts define (tools, benchmarks, the GPU check, the torch engine)."""
    flags = set()
    for path in REPO.glob("**/*.py"):
        if ".venv" in path.parts:
            continue
        for call in ADD_ARGUMENT.findall(path.read_text(errors="replace")):
            flags.update(STRING_FLAG.findall(call))
    return frozenset(flags)


@functools.cache
def sglang_fields() -> frozenset[str]:
    """Fields of SGLang's ``ServerArgs`` in the unpacked 0.5.19 and 0.5.23 wheels (``make venv``),
    else of slime's built-in subset."""
    wheels = REPO / ".venv" / "sglang-wheels"
    sources = [
        *wheels.glob("*/sglang/srt/server_args.py"),
        *wheels.glob("*/sglang/srt/arg_groups/fields/*.py"),  # 0.5.23 splits ServerArgs by group
    ]
    if sources:
        return frozenset(
            name for path in sources for name in re.findall(r"^    (\w+): ", path.read_text(), re.MULTILINE)
        )
    import dataclasses

    from slime.config.sglang_args import FallbackServerArgs

    return frozenset(field.name for field in dataclasses.fields(FallbackServerArgs))


def known_flag(flag: str) -> bool:
    """A flag of ``train.py`` or of a script here, ``--sglang-<a ServerArgs field>``, a flag of the
    SGLang server itself (named where the docs say what slime passes it), or an external one."""
    if flag in train_flags() or flag in script_flags() or flag in EXTERNAL_FLAGS:
        return True
    return flag.removeprefix("--sglang-").removeprefix("--").replace("-", "_") in sglang_fields()


def unknown_flags(doc: Path) -> list[str]:
    """``--flags`` in ``doc`` (code blocks too) that no program here or in ``EXTERNAL_FLAGS`` has;
    a family written as ``--eval-*`` or ``--sglang-<flag>`` is not a flag."""
    unknown = []
    for flag, family in FLAG.findall(doc.read_text()):
        if not family and not known_flag(flag):
            unknown.append(flag)
    return sorted(set(unknown))


@pytest.mark.parametrize("doc", documents(), ids=lambda path: str(path.relative_to(REPO)))
def test_every_link_path_and_flag_of_a_doc_exists(doc):
    problems = {
        "broken links": broken_links(doc),
        "paths that do not exist": missing_paths(doc),
        "flags that no command here takes": unknown_flags(doc),
    }
    assert not any(problems.values()), f"{doc.relative_to(REPO)}: {problems}"


def test_the_checks_fail_on_a_broken_link_a_missing_path_and_an_unknown_flag(tmp_path):
    doc = tmp_path / "guide.md"
    (tmp_path / "there.md").write_text("# there\n")
    doc.write_text(
        "See [there](there.md#part), [gone](gone.md) and [web](https://example.com).\n"
        "Files: `slime/rollout/sample.py`, `slime/rollout/no_such_module.py:fn`, `bench/results/*.json`,\n"
        "`bench/results/*.nothing`, `/data/user.jsonl`, `DIR/iter_<rollout>/`.\n"
        "Flags: --rollout-batch-size, --sglang-mem-fraction-static, --eval-* and --sglang-<flag>,\n"
        "--no-such-flag, --sglang-no-such-field, --local-dir.\n"
        "```bash\npython train.py --rollout-temperature 1.0 --made-up-in-a-block\n```\n"
    )
    assert broken_links(doc) == ["gone.md"]
    assert missing_paths(doc) == ["slime/rollout/no_such_module.py", "bench/results/*.nothing"]
    assert unknown_flags(doc) == ["--made-up-in-a-block", "--no-such-flag", "--sglang-no-such-field"]


def code_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def line_of(text: str, needle: str) -> int:
    """The 1-based line of the first occurrence of ``needle`` in ``text``."""
    index = text.find(needle)
    assert index >= 0, f"README lacks {needle!r}"
    return text.count("\n", 0, index) + 1


def test_the_readme_is_a_front_page_with_the_gpu_command_and_the_reward_hook_early():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert line_of(text, "bash scripts/run-qwen3-4B.sh") < 60
    assert line_of(text, "--custom-rm-path") < 100
    assert "UTC" not in text, "dated measurements belong in LOG.md"


def test_the_readme_gpu_command_is_the_scripts_own_usage_line():
    """One source for the GPU command: the README runs the script as its header says, and no README
    block spells out a ``train.py`` command of its own."""
    usage = next(
        line.removeprefix("#").strip()
        for line in GPU_SCRIPT.read_text().splitlines()
        if line.startswith("#") and "bash scripts/run-qwen3-4B.sh" in line
    )
    text = README.read_text()
    assert usage in text
    assert not [block for block in code_blocks(text) if "train.py" in block]


def test_the_gpu_scripts_flags_are_train_flags():
    """The script the README points at runs: every flag it passes is one ``train.py`` takes."""
    flags = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*)", GPU_SCRIPT.read_text(), re.MULTILINE))
    assert flags and not {flag for flag in flags if not known_flag(flag)}


def test_train_help_lists_the_flags_the_docs_check_against():
    """``train_flags`` reads the parser ``train.py --help`` prints."""
    help_text = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    for flag in ("--rollout-batch-size", "--custom-rm-path", "--tensor-model-parallel-size"):
        assert flag in train_flags() and flag in help_text
