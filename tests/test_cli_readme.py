"""The README's walkthrough, run command by command exactly as written.

The commands run in a scratch copy of the repository's layout (every top-level entry linked
in, ``../shared`` next to it), so relative paths resolve as they do for a reader in a fresh
clone, and files the walkthrough writes stay out of the working tree.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nanokv_cli.cli import app

# Slow as a whole (builds, installs, runs): not in the fast subset (-m 'not slow').
pytestmark = pytest.mark.slow


REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def walkthrough_commands() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Walkthrough", 1)[1]
    block = re.search(r"```(?:bash|sh|console)?\n(.*?)```", section, re.S).group(1)
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line.startswith("nanokv "):
            commands.append(line)
    return commands


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readme")
    work = root / REPO.name
    work.mkdir()
    for entry in REPO.iterdir():
        if not entry.name.startswith("."):
            (work / entry.name).symlink_to(entry)
    if SHARED.exists():
        (root / "shared").symlink_to(SHARED)
    return work


def test_the_walkthrough_has_commands():
    commands = walkthrough_commands()
    assert any(c.startswith("nanokv generate") for c in commands)
    assert any(c.startswith("nanokv replay") for c in commands)
    assert any(c.startswith("nanokv inspect") for c in commands)


@pytest.mark.parametrize("command", walkthrough_commands())
def test_walkthrough_command_runs_as_written(command, clone, monkeypatch):
    monkeypatch.chdir(clone)
    result = CliRunner().invoke(app, shlex.split(command)[1:])
    assert result.exit_code == 0, f"{command}\n{result.output}"
