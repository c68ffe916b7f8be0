"""The command line with a real model: a tiny random Llama (fast), greedy, few tokens."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nanokv_cli.cli import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def nanokv(*args, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def ok(*args, input: str | None = None):
    result = nanokv(*args, input=input)
    assert result.exit_code == 0, result.output
    return result


def test_generate_json_matches_the_python_api(tiny):
    from nanokv_cli import LLM, SamplingParams

    outs = json.loads(
        ok(
            "generate",
            "The capital of France is",
            "Hello",
            "--model",
            tiny,
            "--max-tokens",
            "6",
            "--json",
        ).stdout
    )
    llm = LLM(str(tiny))
    expected = llm.generate(
        ["The capital of France is", "Hello"], SamplingParams(temperature=0.0, max_tokens=6)
    )
    assert [o["prompt"] for o in outs] == ["The capital of France is", "Hello"]
    for out, ref in zip(outs, expected):
        assert out["token_ids"] == ref["token_ids"] and len(out["token_ids"]) == 6
        assert out["text"] == ref["text"]
        assert out["num_prompt_tokens"] == ref["num_prompt_tokens"]
        assert out["finish_reason"] == "length" and out["ttft_s"] >= 0


def test_generate_streams_plain_text_when_piped(tiny):
    args = ("--model", tiny, "--max-tokens", "5")
    streamed = ok("generate", "The quick brown fox", *args)
    [ref] = json.loads(ok("generate", "The quick brown fox", *args, "--json").stdout)
    assert streamed.stdout == ref["text"] + "\n"
    assert "\x1b[" not in streamed.stdout
    assert "5 tokens in" in streamed.stderr  # the summary goes to stderr


def test_generate_several_prompts_in_order(tiny):
    out = ok("generate", "one", "two", "--model", tiny, "--max-tokens", "3").stdout
    assert out.index("--- 'one'") < out.index("--- 'two'")


def test_generate_from_stdin_and_chat(tiny):
    piped = json.loads(
        ok(
            "generate", "-", "--model", tiny, "--max-tokens", "3", "--json", input="Hello world\n"
        ).stdout
    )
    direct = json.loads(
        ok("generate", "Hello world", "--model", tiny, "--max-tokens", "3", "--json").stdout
    )
    assert piped[0]["prompt"] == "Hello world" and piped[0]["token_ids"] == direct[0]["token_ids"]
    chat = json.loads(
        ok(
            "generate", "Hello world", "--chat", "--model", tiny, "--max-tokens", "3", "--json"
        ).stdout
    )
    assert chat[0]["num_prompt_tokens"] > direct[0]["num_prompt_tokens"]


def test_replay_with_a_model_reports_latencies_and_records_text(tiny, tmp_path):
    path = tmp_path / "p.jsonl"
    prefix = "A prefix cache lets requests that share a prompt reuse its blocks. "
    lines = [
        {"prompt": prefix + "First.", "timestamp": 0},
        {"prompt": prefix + "Second.", "timestamp": 0.2},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    trace, report_file = tmp_path / "run.trace", tmp_path / "r.json"
    args = ["replay", path, "--model", tiny, "--block-size", "4", "--max-tokens", "4"]
    result = ok(*args, "--record", trace, "--report", report_file, "--json")
    report = json.loads(result.stdout)
    assert report == json.loads(report_file.read_text())
    assert report["requests"] == 2 and report["output_tokens"] == 8
    assert report["dry_run"] is False and report["model"] == str(tiny.resolve())
    for key in ("ttft_s", "itl_s", "e2e_latency_s"):
        assert set(report[key]) == {"mean", "p50", "p90", "p99"}
    assert report["ttft_s"]["p50"] > 0
    assert report["cache_hits"] > 0  # the second request arrives after the first is computed
    info = json.loads(ok("inspect", trace, "--json").stdout)
    texts = "".join(b["text"] or "" for b in info["blocks"])
    assert "A prefix cache" in texts


@pytest.mark.parametrize("dry_run", [False, True])
def test_per_request_lines_carry_every_latency(tiny, tmp_path, dry_run):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Question {i}?"}) for i in range(3)))
    lines_file = tmp_path / "requests.jsonl"
    args = ["replay", path, "--model", tiny, "--block-size", "4", "--max-tokens", "5"]
    args += ["--per-request", lines_file, "--report", tmp_path / "r.json"]
    summary = ok(*args, *(["--dry-run"] if dry_run else [])).stdout
    lines = [json.loads(x) for x in lines_file.read_text().splitlines()]
    assert len(lines) == 3
    for rec in lines:
        assert 0 < rec["ttft_s"] <= rec["e2e_latency_s"], rec
        assert 0 < rec["itl_mean_s"] <= rec["itl_max_s"], rec
        assert rec.get("clock") == ("virtual" if dry_run else None)
    report = json.loads((tmp_path / "r.json").read_text())
    assert max(r["e2e_latency_s"] for r in lines) == pytest.approx(report["e2e_latency_s"]["p99"])
    assert ("time to first token (virtual)" in summary) == dry_run


def test_unknown_model_architecture(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10})
    )
    result = nanokv("generate", "hi", "--model", folder)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "GPT2LMHeadModel" in result.stderr and result.stderr.count("\n") == 1


def test_missing_model_path():
    result = nanokv("generate", "hi", "--model", "/no/such/model")
    assert result.exit_code == 1 and "does not exist" in result.stderr


def test_prompt_too_long(tiny):
    result = nanokv("generate", "word " * 50, "--model", tiny, "--max-model-len", "16")
    # Refused before tokenizing: 250 characters cannot fit 16 tokens of this vocabulary.
    assert result.exit_code == 1 and "more than 16 tokens can hold" in result.stderr
    # Short enough in bytes, too long in tokens: refused once tokenized.
    result = nanokv("generate", "word " * 20, "--model", tiny, "--max-model-len", "16")
    assert result.exit_code == 1 and "exceeds max_model_len (16)" in result.stderr


def test_impossible_cache_size(tiny):
    result = nanokv(
        "generate", "hi", "--model", tiny, "--kv-cache-memory", "1KiB", "--block-size", "256"
    )
    assert result.exit_code == 1 and "cannot hold a single block" in result.stderr
    result = nanokv(
        "generate",
        "a much longer prompt than two blocks",
        "--model",
        tiny,
        "--num-blocks",
        "2",
        "--block-size",
        "4",
    )
    assert result.exit_code == 1 and "cache has only 2" in result.stderr


def run_in_pty(args: list[str], timeout: int = 120) -> tuple[int, str]:
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "nanokv_cli.cli", *map(str, args)],
        cwd=str(REPO),
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "40"},
        dimensions=(40, 100),
        encoding="utf-8",
        timeout=timeout,
    )
    out = child.read()
    child.close()
    return child.exitstatus, out


def test_generate_live_view_in_a_terminal(tiny):
    code, out = run_in_pty(
        [
            "generate",
            "The capital of France is",
            "--model",
            tiny,
            "--max-tokens",
            "6",
            "--block-size",
            "4",
        ]
    )
    assert code == 0, out
    assert "cached-free" in out and "blocks × 4 tokens" in out  # the live view was drawn
    assert "\x1b[?25l" in out and "\x1b[?25h" in out  # cursor hidden while live, then restored


def test_replay_live_view_in_a_terminal(tiny, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\nsecond prompt\n")
    code, out = run_in_pty(
        ["replay", path, "--model", tiny, "--max-tokens", "4", "--block-size", "4"]
    )
    assert code == 0, out
    assert "nanokv replay p.txt" in out and "done 2/2" in out and "prefix-cache hit rate" in out


def test_progress_bar_on_a_terminal_without_the_live_view():
    mooncake = REPO / "examples" / "traces" / "mooncake_conversation_trace.jsonl"
    code, out = run_in_pty(["replay", mooncake, "--dry-run", "--limit", "30", "--no-live"])
    assert code == 0, out
    assert "replay" in out and "/30" in out  # the bar's done/total column
    assert "cached-free" not in out  # no live view
    assert "prefix-cache hit rate" in out
