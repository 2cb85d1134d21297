"""Every code block of README.md works as written.

``python`` blocks run, each in a fresh interpreter from the repository root, on
CUDA where there is one (they compile with Inductor: `slow`). Shell blocks
(``bash``, and ``sh`` for what needs a GPU or several processes) are checked
rather than run, since they install packages, run this test suite, tune kernels
on a GPU or start processes: each block must parse (``bash -n``), each
``pip install -e`` must name extras the project declares, and each ``python``
command's script or module must accept the options the README gives it (they
must appear in its ``--help``; under a launcher such as ``python -m
torch.distributed.run``, the launcher's options in its help and the script's in
the script's). `.ci/run` must run the install commands verbatim.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# Modules that import triton at the top: their --help needs it installed.
NEEDS_TRITON = ("torch_moe_ops.tune",)
# ``python -m <launcher> [its options] script.py [the script's options]``.
LAUNCHERS = ("torch.distributed.run",)
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def blocks(language: str) -> list:
    """``pytest.param(code, id=<section>-<n>)`` for every ``language`` block."""
    found, seen = [], {}
    for match in BLOCK.finditer(README):
        if match.group(1) != language:
            continue
        headings = re.findall(r"^#+ (.+)$", README[:match.start()], re.MULTILINE)
        section = re.sub(r"\W+", "_", headings[-1]).strip("_").lower()
        seen[section] = seen.get(section, 0) + 1
        found.append(pytest.param(match.group(2), id=f"{section}-{seen[section]}"))
    return found


def commands() -> list:
    """``pytest.param(argv)`` for every command of every shell block (split at ``&&``):
    ``bash`` blocks run on any machine, ``sh`` blocks need a GPU (tuning)."""
    found = []
    for block in blocks("bash") + blocks("sh"):
        for line in block.values[0].splitlines():
            for command in filter(None, (part.strip() for part in line.split("&&"))):
                argv = shlex.split(command)
                marks = [pytest.mark.triton] if set(argv) & set(NEEDS_TRITON) else []
                found.append(pytest.param(argv, marks=marks, id=command))
    return found


def readme_environment() -> dict:
    # What a user's shell has: the Triton interpreter is the tests' setting.
    return {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}


def test_readme_counts_no_test_suite():
    """A suite's size changes with every test added: the README says how to list a suite,
    never how many tests it has (which drifted: 224 written, 238 collected)."""
    assert not re.findall(r"suite \(\d+ tests\)|\d+ tests in the suite", README)


def test_readme_has_blocks():
    assert len(blocks("python")) >= 2 and len(blocks("bash")) + len(blocks("sh")) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("code", blocks("python"))
def test_python_block_runs(code):
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=readme_environment(),
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("code", blocks("bash") + blocks("sh"))
def test_bash_block_parses(code):
    result = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("argv", commands())
def test_bash_command_is_valid(argv):
    if argv[:3] == ["pip", "install", "-e"]:
        target = re.fullmatch(r"\.(?:\[([\w,]+)\])?", argv[3])
        assert target is not None and len(argv) == 4, f"installs the project only: {argv}"
        extras = set(filter(None, (target.group(1) or "").split(",")))
        declared = importlib.metadata.metadata("torch-moe-ops").get_all("Provides-Extra")
        assert extras <= set(declared)
        return
    if argv[:2] == ["pip", "install"] and argv[2].startswith("torch=="):
        # torch's CPU build, pinned, from PyTorch's CPU index.
        assert argv[2].endswith("+cpu") and "https://download.pytorch.org/whl/cpu" in argv
        return
    assert argv[0] == "python", f"a README command this test does not know: {argv}"
    program = argv[1:3] if argv[1] == "-m" else argv[1:2]
    options = argv[len(program) + 1:]
    if program[0] == "-m" and program[1] in LAUNCHERS:
        script = next(i for i, arg in enumerate(options) if arg.endswith(".py"))
        check_options(program, options[:script])
        check_options(options[script:script + 1], options[script + 1:])
    else:
        check_options(program, options)


def check_options(program: list, options: list) -> None:
    """``program`` (``[script.py]`` or ``["-m", module]``) exists, and its ``--help``
    names every option of ``options``."""
    if program[0] != "-m":
        assert (ROOT / program[0]).is_file(), program[0]
    result = subprocess.run([sys.executable, *program, "--help"], cwd=ROOT,
                            env=readme_environment(), capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    for option in options:
        if option.startswith("-"):
            assert re.search(rf"(^|[\s,]){re.escape(option)}\b", result.stdout), option


def test_ci_runs_the_readme_commands():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    install = README[README.index("## Install and test"):README.index("## Usage")]
    for match in BLOCK.finditer(install):
        assert match.group(2).strip() in ci_lines
