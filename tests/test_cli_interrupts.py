"""Ctrl-C keeps the work (issue #45 item 4), through real terminals (pexpect): ``generate``
prints the text made so far and a summary, ``replay`` its summary, and ``serve`` a summary with
no figure made of no data; each one's figures are its report's (``--json`` / ``--report``)."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from nanokv_cli.engine.model.loader import load_tokenizer

pexpect = pytest.importorskip("pexpect")

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO / "examples" / "traces" / "mooncake_conversation_trace.jsonl"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BOX = re.compile("[╭╮╰╯│─]")
SUMMARY = re.compile(
    r"([\d,]+) tokens in [\d.]+ s \([\d.]+ tok/s\) · prompt ([\d,]+) tokens, ([\d,]+) from the "
    r"prefix cache \(hit rate [\d.]+%\) · interrupted: (\d+) of (\d+) prompts finished"
)


def spawn(args: list[str], width: int = 120) -> pexpect.spawn:
    return pexpect.spawn(
        sys.executable,
        ["-m", "nanokv_cli.cli", *args],
        cwd=str(REPO),
        # The size the terminal has (a test runner's COLUMNS and LINES would override it).
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": str(width), "LINES": "40"},
        dimensions=(40, width),
        encoding="utf-8",
        codec_errors="replace",  # the terminal echoes ^C, which may land inside a character
        timeout=180,
    )


def interrupt(child: pexpect.spawn) -> str:
    """Ctrl-C, then everything it writes until it exits; exit 130."""
    child.sendintr()
    rest = child.read()
    child.close()
    assert child.exitstatus == 130, rest[-2000:]
    assert "Traceback" not in rest
    return rest


def one_line(text: str) -> str:
    """Terminal output without escapes, with Rich's wrapped lines joined."""
    return re.sub(r"\s*\r?\n\s*", " ", ANSI.sub("", text))


# -- generate ----------------------------------------------------------------------------------


STORY = ["generate", "Tell me a long story about a cat", "--max-tokens", "3000", "--ignore-eos"]


def test_ctrl_c_on_generate_keeps_the_text_and_prints_a_summary():
    child = spawn([*STORY, "--chat", "--temperature", "0"])
    child.expect("seq \\d+")  # the live view streams text
    time.sleep(2)  # some more tokens
    out = interrupt(child)
    shown_frames, after_panel = out.rsplit("\x1b[2K", 1)  # the panel is erased, then ...
    after_panel = ANSI.sub("", after_panel)
    assert not BOX.search(after_panel), after_panel  # ... no stray border is left
    summary = one_line(after_panel)
    m = SUMMARY.search(summary)
    assert m, summary
    tokens, finished, prompts = int(m.group(1).replace(",", "")), m.group(4), m.group(5)
    assert tokens > 10 and (finished, prompts) == ("0", "1")
    assert summary.index("nanokv: interrupted") > m.end()
    # The text kept holds what the last frame's text panel showed (its tail), and more.
    kept = " ".join(summary[: m.start()].split())
    panel = ANSI.sub("", shown_frames).rsplit("seq ", 1)[1].split("╰", 1)[0]
    shown = " ".join(line.strip("│ ") for line in panel.splitlines()[1:] if "│" in line)
    shown = " ".join(shown.split())
    assert len(shown) > 20 and shown[-60:] in kept, (shown, kept)


def test_ctrl_c_on_generate_json_gives_the_tokens_the_summary_counts():
    child = spawn([*STORY, "The capital of France is", "--json", "--temperature", "0"])
    child.expect("KV cache")
    time.sleep(4)
    out = ANSI.sub("", interrupt(child)).replace("\r\n", "\n")
    m = SUMMARY.search(one_line(out))
    assert m, out[-2000:]
    start, end = out.index("[\n  {"), out.index("\n]\n") + 2
    results = json.loads(out[start:end])
    assert [r["finish_reason"] for r in results] == ["abort", "abort"]
    assert sum(r["num_output_tokens"] for r in results) == int(m.group(1).replace(",", ""))
    assert sum(r["num_prompt_tokens"] for r in results) == int(m.group(2).replace(",", ""))
    tokenizer = load_tokenizer(None)
    for r in results:
        assert r["num_output_tokens"] == len(r["token_ids"]) > 0
        assert r["text"] == tokenizer.decode(r["token_ids"])  # every token's text, kept


# -- replay ------------------------------------------------------------------------------------


def test_ctrl_c_on_replay_prints_the_summary_its_last_frame_and_report_agree_on(tmp_path):
    report = tmp_path / "report.json"
    args = ["replay", str(MOONCAKE), "--dry-run", "--limit", "4000", "--block-size", "64"]
    child = spawn([*args, "--num-blocks", "4000", "--report", str(report)], width=140)
    child.expect("done [1-9]\\d*/4000")  # requests have finished
    out = ANSI.sub("", interrupt(child))
    saved = json.loads(report.read_text())
    assert saved["interrupted"] is True and 0 < saved["requests"] < 4000
    frame, summary = out.rsplit("Summary (interrupted", 1)
    assert int(re.findall(r"done (\d+)/4000", frame)[-1]) == saved["requests"]
    assert f"step {saved['steps'] - 1} " in frame.rsplit("╭", 1)[-1]  # the last step's frame
    rows = {line[:29].strip(): line[29:].split() for line in summary.splitlines()[1:]}
    assert rows["requests finished"][0] == f"{saved['requests']:,}"
    assert rows["output tokens"][0] == f"{saved['output_tokens']:,}"
    assert rows["prefix-cache hit rate"][0] == f"{saved['hit_rate']:.1%}"
    assert rows["evictions"][0] == f"{saved['evictions']:,}"
    assert "nanokv: interrupted" in summary


# -- serve -------------------------------------------------------------------------------------


def test_ctrl_c_on_serve_with_every_request_aborted_shows_no_made_up_figure(tmp_path):
    report = tmp_path / "serve.json"
    # The default model: slow enough on a CPU that both streams are still going at Ctrl-C.
    args = ["serve", "--port", "0", "--served-model-name", "tiny", "--report", str(report)]
    child = spawn(args)
    child.expect(r"serving .* on (http://\S+)/v1")
    url = child.match.group(1)
    texts: list[list[str]] = [[], []]
    going = threading.Event()

    def stream(i: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        try:
            for chunk in client.completions.create(
                model="tiny",
                prompt=f"Request {i} with a longer prompt than one token",
                max_tokens=4000,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                texts[i].append(chunk.choices[0].text)
                going.set()
        except (openai.APIError, ConnectionError):
            pass  # the server went away: what came is kept

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert going.wait(60)
    # Keep the pty drained while the streams run (the live view writes to it).
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            child.read_nonblocking(1 << 16, timeout=0.1)
        except pexpect.TIMEOUT:
            pass
    out = interrupt(child)
    for t in threads:
        t.join(60)
    saved = json.loads(report.read_text())
    assert saved["requests"] == 0 and saved["requests_aborted"] == 2
    assert all(texts), texts  # each client kept what it was sent
    assert saved["output_tokens"] >= sum(map(len, texts))
    assert saved["prompt_tokens_aborted"] > 0
    summary = ANSI.sub("", out).rsplit("Summary (interrupted", 1)[1]
    lines = {line.split("  ")[0]: line for line in summary.splitlines()}
    latency = lines["request latency"]
    assert "n/a" in latency and "0.0 ms" not in latency, latency
    [output_rate, both_rate] = [x for x in summary.splitlines() if "tok/s" in x]
    assert f"{saved['output_throughput']:,.1f} tok/s" in output_rate
    assert f"{saved['total_token_throughput']:,.1f} tok/s" in both_rate
    total = saved["prompt_tokens_aborted"] + saved["output_tokens"]
    assert saved["total_token_throughput"] == pytest.approx(total / saved["duration_s"])
    assert saved["total_token_throughput"] > saved["output_throughput"]
    assert f"{saved['output_tokens']:,}" in lines["output tokens"]
