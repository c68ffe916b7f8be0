"""Hostile and careless settings, fourth round (issue #49, items 10-24): environment variables,
prompts, traces and model files that were accepted silently, crashed later or said the wrong
thing. Each case gives one clear message in bounded time and memory, or the right answer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def nanokv(*args, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanokv_cli.cli", *map(str, args)],
        cwd=cwd or REPO,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def one_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 1 or 2 with one ``nanokv: error:`` line (or a usage error) holding every fragment."""
    out = result.stdout + result.stderr
    assert "Traceback" not in out, out[-3000:]
    assert result.returncode in (1, 2), out
    errors = [line for line in result.stderr.splitlines() if line.startswith("nanokv: error:")]
    text = errors[0] if len(errors) == 1 else " ".join(result.stderr.replace("│", " ").split())
    for fragment in fragments:
        assert fragment in text, text
    return text


# -- item 23: NANOKV_CPU_KERNELS ----------------------------------------------------------------


@pytest.mark.parametrize("value", ["false", "OFF", " no ", "0"])
def test_every_usual_off_spelling_switches_the_kernels_off(value):
    from nanokv_cli.engine.cpu import build

    os.environ[build.SWITCH_VARIABLE] = value
    try:
        status = build.kernels()
    finally:
        del os.environ[build.SWITCH_VARIABLE]
    assert status.lib is None and status.switched_off


@pytest.mark.parametrize("value", ["true", "On", "yes", "1", ""])
def test_every_usual_on_spelling_keeps_them_on(value):
    from nanokv_cli.engine.cpu import build

    os.environ[build.SWITCH_VARIABLE] = value
    try:
        assert not build.switched_off()
    finally:
        del os.environ[build.SWITCH_VARIABLE]


def test_an_unknown_kernel_switch_is_one_error_not_ignored():
    result = nanokv("generate", "Hi", "--max-tokens", 1, "--no-live", env={"NANOKV_CPU_KERNELS": "maybe"})
    one_error(result, "NANOKV_CPU_KERNELS='maybe'", "0/false/off/no")


# -- advise: items 14, 15 and 22 ------------------------------------------------------------------


def write_lines(path: Path, rows: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_advise_on_an_empty_prompt_says_so_as_replay_does(tmp_path):
    only = write_lines(tmp_path / "empty.jsonl", [{"prompt_token_ids": []}])
    says = "every request was rejected; the first: line 1: the prompt is empty"
    one_error(nanokv("advise", only), says)
    one_error(nanokv("replay", only, "--dry-run"), says)
    mixed = write_lines(tmp_path / "mixed.jsonl", [{"prompt": ""}, {"prompt_token_ids": [5, 6, 7]}])
    result = nanokv("advise", mixed)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "1 of 2 requests were left out" in text and "the prompt is empty" in text
    assert "too big" not in text


def test_identical_prompts_do_not_part_at_their_end(tmp_path):
    import json

    rows = [{"prompt_token_ids": list(range(5, 45))}] * 3
    rows.append({"prompt_token_ids": list(range(5, 30)) + [99] * 10})  # parts at token 25
    path = write_lines(tmp_path / "same.jsonl", rows)
    result = nanokv("advise", path, "--block-size", 16, "--json")
    assert result.returncode == 0, result.stderr
    points = json.loads(result.stdout)["divergence_points"]
    assert [(p["requests"], p["at_tokens"]) for p in points] == [(1, [25, 25])]
    text = nanokv("advise", path, "--block-size", 16).stdout
    assert "(ends)" not in text and "1 request parts at token 25" in text


@pytest.mark.parametrize("columns", [80, 50])
def test_advise_never_cuts_a_number_in_a_pipe(columns, tmp_path):
    import json

    args = ["advise", REPO / "examples" / "prompts.jsonl", "--block-size", 16]
    args += ["--num-blocks", 10_000_000]
    grid = json.loads(nanokv(*args, "--json").stdout)["grid"]
    result = nanokv(*args, env={"COLUMNS": str(columns)})
    assert result.returncode == 0, result.stderr
    table = result.stdout.split("Every run", 1)[1].split("Notes", 1)[0]
    assert "…" not in table
    for row in grid:
        line_numbers = f"{row['num_blocks']:,}", f"{row['evictions']:,}", f"{row['hit_rate']:.1%}"
        for number in line_numbers:
            assert number in table, (number, table)
    assert "block" in table and "token" in table  # the match column, whole
