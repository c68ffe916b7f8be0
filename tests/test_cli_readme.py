"""The README and docs as a reader meets them in a fresh clone: every command in them runs as
written, the set-up commands are the ones CI runs, the layout page matches the tree, every
link resolves, and nothing the repository runs reads a file outside it.

The commands run in a scratch copy of the repository's layout (every top-level entry linked
in, and nothing beside it: no ``../shared``), so relative paths resolve as they do for a
reader in a fresh clone, and files the commands write stay out of the working tree.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nanokv_cli.cli import app

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 200


def code_blocks(text: str, lang: str = "bash") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def nanokv_commands(block: str) -> list[str]:
    """The ``nanokv ...`` lines of a shell block: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = (line.split(" #", 1)[0].strip() for line in joined.splitlines())
    return [line for line in lines if line.startswith("nanokv ")]


def section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def walkthrough_commands() -> list[str]:
    return nanokv_commands(code_blocks((DOCS / "walkthrough.md").read_text(encoding="utf-8"))[0])


def quickstart_commands() -> list[str]:
    quickstart = section(README.read_text(encoding="utf-8"), "## Quickstart")
    return nanokv_commands(code_blocks(quickstart)[0])


def setup_commands() -> list[str]:
    """The README's two set-up commands: install and run, then test."""
    text = section(README.read_text(encoding="utf-8"), "## Install and run")
    return [block.strip() for block in code_blocks(text)]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readme")
    work = root / REPO.name
    work.mkdir()
    for entry in REPO.iterdir():
        if not entry.name.startswith("."):
            (work / entry.name).symlink_to(entry)
    return work


# -- the front door ------------------------------------------------------------------------------


def test_the_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[:3] == ["Install and run", "Quickstart", "Python API"], headings
    assert len(quickstart_commands()) == 6


def test_the_two_setup_commands_are_what_ci_runs():
    install, test = setup_commands()
    assert "pip install -e ." in install and "nanokv generate" in install
    assert "[test]" not in install  # generating text needs no test extras
    assert test.endswith("python -m pytest -q") and "'.[test]'" in test
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert install in ci and test in ci, "run the README's commands, exactly, in .ci/run"
    assert ci.index(install) < ci.index(test)


@pytest.mark.slow
@pytest.mark.parametrize("command", quickstart_commands())
def test_quickstart_command_runs_as_written(command, clone, monkeypatch):
    monkeypatch.chdir(clone)
    result = CliRunner().invoke(app, shlex.split(command)[1:])
    assert result.exit_code == 0, f"{command}\n{result.output}"


@pytest.mark.slow
def test_the_python_api_example_runs_as_written(clone):
    [example] = code_blocks(section(README.read_text(encoding="utf-8"), "## Python API"), "python")
    result = subprocess.run(
        [sys.executable, "-c", example],
        cwd=clone,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


# -- the walkthrough -----------------------------------------------------------------------------


def test_the_walkthrough_has_commands():
    commands = walkthrough_commands()
    assert any(c.startswith("nanokv generate") for c in commands)
    assert any(c.startswith("nanokv replay") for c in commands)
    assert any(c.startswith("nanokv inspect") for c in commands)


@pytest.mark.slow
@pytest.mark.parametrize("command", walkthrough_commands())
def test_walkthrough_command_runs_as_written(command, clone, monkeypatch):
    monkeypatch.chdir(clone)
    result = CliRunner().invoke(app, shlex.split(command)[1:])
    assert result.exit_code == 0, f"{command}\n{result.output}"


# -- links, layout, and nothing outside the clone -----------------------------------------------


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]


def test_every_relative_link_resolves():
    for page in markdown_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            assert path.is_relative_to(REPO), f"{page.name} links outside the clone: {target}"
            assert path.exists(), f"{page.name} links to a missing {target}"


def layout_entries() -> list[str]:
    """The paths docs/layout.md names, relative to the repository: an entry is the first word
    of a line indented by less than the description column, and an indented entry lies inside
    the nearest folder above it that is indented less."""
    block = code_blocks((DOCS / "layout.md").read_text(encoding="utf-8"), "")[0]
    entries, folders = [], []  # folders: (indent, path) of the enclosing folders
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= 16:
            continue  # a description's continuation
        name = line.split()[0]
        folders = [(i, p) for i, p in folders if i < indent]
        path = (folders[-1][1] if folders else "") + name
        entries.append(path.rstrip("/"))
        if name.endswith("/"):
            folders.append((indent, path))
    return entries


def test_the_layout_page_matches_the_tree():
    named = layout_entries()
    missing = [p for p in named if not (REPO / p).exists()]
    assert not missing, f"docs/layout.md names what the tree lacks: {missing}"
    must = [p.name for p in REPO.iterdir() if not p.name.startswith(".")]
    # Packages named module by module (the others are described in a line or two).
    listed = ("", "engine", "run", "workload", "whatif", "engine/core", "engine/model")
    listed += ("engine/runner", "engine/parallel", "engine/cpu")
    for package in ("nanokv_cli" + (f"/{p}" if p else "") for p in listed):
        must += [
            f"{package}/{p.name}"
            for p in (REPO / package).iterdir()
            if p.name not in ("__init__.py", "__pycache__") and (p.suffix == ".py" or p.is_dir())
        ]
    unnamed = sorted(
        set(must) - set(named) - {"build", "dist"} - {p for p in must if "egg-info" in p}
    )
    assert not unnamed, f"docs/layout.md does not name {unnamed}"


# A path built to leave the clone: ../shared (any spelling), or the folder above the
# repository (``REPO.parent``, ``parents[2]`` from a file one level down, ...).
OUTSIDE = re.compile(
    r"\.\./shared|[\"']shared/|[\"']shared[\"']\s*/|\b(?:REPO|ROOT|HERE)\.parent\b|parents\[[2-9]\]"
    r"|parents\[\d\]\.parent\b|\.parent\.parent\.parent"
)


def test_nothing_reads_outside_the_clone():
    files = [README, *DOCS.rglob("*.md"), REPO / ".ci" / "run", REPO / "pyproject.toml"]
    for folder in ("tests", "scripts", "examples"):
        files += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if OUTSIDE.search(line) and path != Path(__file__).resolve():
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "reads outside the clone:\n" + "\n".join(found)


def test_the_bundled_trace_carries_its_source_and_licence():
    traces = REPO / "examples" / "traces"
    notes = (traces / "README.md").read_text(encoding="utf-8")
    assert "kvcache-ai/Mooncake" in notes and "Apache License 2.0" in notes
    assert "Apache License" in (traces / "LICENSE-Apache-2.0").read_text(encoding="utf-8")
    with open(traces / "mooncake_conversation_trace.jsonl", "rb") as f:
        assert sum(1 for _ in f) == 12031  # the whole conversation trace, as the docs say
