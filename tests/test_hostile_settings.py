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
    result = nanokv(
        "generate", "Hi", "--max-tokens", 1, "--no-live", env={"NANOKV_CPU_KERNELS": "maybe"}
    )
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


# -- item 18: token ids past what a trace records ----------------------------------------------


@pytest.mark.parametrize("bad", [2**31, 2**32, 2**64 + 1, -1])
@pytest.mark.parametrize(
    "command",
    [
        ["replay", "{file}", "--dry-run"],
        ["replay", "{file}", "--dry-run", "--record", "{tmp}/run.trace"],
        ["advise", "{file}"],
        ["inspect", "--prompts", "{file}"],
    ],
)
def test_a_token_id_past_int32_is_one_error_where_prompts_are_read(bad, command, tmp_path):
    path = write_lines(tmp_path / "ids.jsonl", [{"prompt_token_ids": [1, 2, bad]}])
    args = [a.format(file=path, tmp=tmp_path) for a in command]
    one_error(nanokv(*args), "ids.jsonl line 1", "token ids from 0 to 2,147,483,647")
    assert not (tmp_path / "run.trace").exists()


# -- item 19: model files nested deeper than the parser's stack ---------------------------------


@pytest.mark.parametrize(
    "name", ["config.json", "generation_config.json", "model.safetensors.index.json"]
)
def test_a_deeply_nested_model_file_is_one_error(name, tiny, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    (folder / name).write_text('{"a": ' + "[" * 200_000 + "]" * 200_000 + "}")
    result = nanokv("generate", "Hi", "--model", folder, "--max-tokens", 1, "--no-live")
    one_error(result, name, "nested too deeply")


# -- item 20: version-1 (JSONL) traces get version 2's checks ------------------------------------


def v1_trace(path: Path, *lines: str) -> Path:
    import json

    header = {"format": "nanokv-trace", "version": 1, "block_size": 16, "num_blocks": 8}
    header |= {"model": None, "dry_run": True}
    path.write_text(json.dumps(header) + "\n" + "".join(line + "\n" for line in lines))
    return path


STORED = (
    '{"type": "BlockStored", "block_id": 1, "block_hash": 7, "parent_hash": -1, "token_ids": %s}'
)


@pytest.mark.parametrize(
    "line, says",
    [
        (
            '{"type": "StepSnapshot", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "nested too deeply",
        ),
        (STORED % "5", "BlockStored.token_ids = 5 is not token ids"),
        (STORED % '["x", null]', "is not token ids"),
        (STORED % str(2**31), "is not token ids"),
        (
            '{"type": "SequenceAdded", "seq_id": 0, "prompt_token_ids": [1], "max_tokens": 1, '
            '"arrival_time": 0.0, "prompt_recipe": ["mooncake", "x", 1, 2]}',
            "prompt_recipe is not a prompt's recipe",
        ),
    ],
    ids=["deep", "an-int", "not-ints", "past-int32", "recipe"],  # short: ids go in the env
)
@pytest.mark.parametrize(
    "view",
    [[], ["--export", "vllm-kv-events", "{tmp}/out.kv"], ["--summary"]],
    ids=["last-step", "export", "summary"],
)
def test_a_forged_version_1_trace_is_one_error_in_every_view(line, says, view, tmp_path):
    path = v1_trace(tmp_path / "forged.jsonl", line)
    args = [a.format(tmp=tmp_path) for a in view]
    one_error(nanokv("inspect", path, *args), "forged.jsonl line 2", says)
    assert not (tmp_path / "out.kv").exists()  # nothing malformed exported


def test_advise_on_a_forged_version_1_trace_is_one_error(tmp_path):
    path = v1_trace(tmp_path / "forged.jsonl", STORED % "5")
    one_error(nanokv("advise", path), "forged.jsonl line 2", "is not token ids")


# -- item 24: what was accepted silently or echoed whole ---------------------------------------


def test_an_eos_id_past_the_vocabulary_is_refused_at_load(tiny, tmp_path):
    import json
    import shutil

    for name in ("config.json", "generation_config.json"):
        folder = tmp_path / name
        shutil.copytree(tiny, folder)
        path = folder / name
        config = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**config, "eos_token_id": 5000}))  # the vocabulary: 320
        result = nanokv("generate", "Hi", "--model", folder, "--max-tokens", 1, "--no-live")
        one_error(result, "is 5000", "outside the vocabulary (320 ids: 0 to 319)")


def test_a_huge_seed_is_refused_without_echoing_it():
    from nanokv_cli.engine.sampling_params import SamplingParams

    for seed in (10**4000, -(10**6000)):  # past Python's own 4,300-digit text limit too
        with pytest.raises(ValueError) as caught:
            SamplingParams(seed=seed)
        message = str(caught.value)
        assert "seed must be an integer between" in message and len(message) < 200, message
        assert "digits" in message


def test_a_stop_string_with_a_lone_surrogate_is_a_400_like_the_prompt(tiny, tmp_path):
    import httpx

    from nanokv_cli.serve.process import ServerProcess

    server = ServerProcess(["--model", str(tiny), "--no-live", "--threads", "1"], tmp_path)
    try:
        url = f"{server.url}/v1/completions"
        # JSON's \ud800 escape: a lone surrogate, as a client can send it.
        for field in ('"prompt": "Hi \\ud800", "stop": "x"', '"prompt": "Hi", "stop": "\\ud800"'):
            body = '{"max_tokens": 2, ' + field + "}"
            r = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert "surrogate" in r.json()["error"]["message"]
        ok = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2, "stop": ["\n"]})
        assert ok.status_code == 200, ok.text
    finally:
        server.kill()


# -- item 13: a figure with no data is n/a, not 0.0 --------------------------------------------


def test_latencies_no_request_gave_are_na_not_zero():
    from rich.console import Console

    from nanokv_cli.run.stats import RunStats
    from nanokv_cli.views.tables import summary_table

    stats = RunStats(latencies=True)
    stats.ttft.append(0.25)  # one first token came; no request finished, no second token
    report = stats.report(duration=1.0, wall_time=1.0, num_blocks=8, block_size=16)
    assert report["e2e_latency_s"]["p50"] is None and report["itl_s"]["mean"] is None
    assert report["ttft_s"]["p50"] == 0.25
    console = Console(width=120, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(summary_table(report))
    text = console.export_text()
    rows = {line.split("  ")[0].strip(): line for line in text.splitlines()}
    assert "p50 n/a" in rows["request latency"] and "0.0 ms" not in rows["request latency"]
    assert "p50 n/a" in rows["inter-token latency"]
    assert "p50 250.0 ms" in rows["time to first token"]


def test_doctor_fails_an_unknown_kernel_switch_and_names_a_spelling_it_took():
    import json

    result = nanokv("doctor", "--json", env={"NANOKV_CPU_KERNELS": "maybe"})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["kernel variant"]["status"] == "fail"
    assert "NANOKV_CPU_KERNELS='maybe'" in json.dumps(checks["kernel variant"])
    result = nanokv("doctor", "--json", env={"NANOKV_CPU_KERNELS": "off"})
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["kernels"]["status"] == "warn"
    assert "NANOKV_CPU_KERNELS=off" in json.dumps(checks["kernels"])


def test_after_ctrl_c_the_summary_counts_only_tokens_clients_received(tiny, tmp_path):
    """Whole (non-streaming) answers cut short by Ctrl-C reach their clients as a 503 with no
    text: the summary's output tokens of aborted requests are then 0, however many the engine
    had generated for them (issue #49, item 13)."""
    import json
    import signal
    import threading
    import time

    import httpx

    from nanokv_cli.serve.process import ServerProcess

    report = tmp_path / "serve.json"
    args = ["--model", str(tiny), "--no-live", "--threads", "1", "--max-num-seqs", "1"]
    server = ServerProcess([*args, "--report", str(report)], tmp_path, {"OMP_NUM_THREADS": "1"})
    answers: list = []

    def ask() -> None:
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}
        try:
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            answers.append(r.status_code)
        except httpx.HTTPError:
            answers.append(None)

    threads = [threading.Thread(target=ask) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        # Both requests must have arrived (one running, one queued behind it) and the first
        # must have some tokens: on a busy machine the second thread can be late.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = server.metrics()
            tokens = m.get("vllm:generation_tokens_total", 0)
            if m.get("vllm:num_requests_waiting") == 1 and tokens > 20:
                break
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGINT)
        code = server.wait(120)
        for t in threads:
            t.join(60)
    finally:
        server.kill()
    assert code == 130, server.log()
    assert 200 not in answers, answers  # neither answer was whole: both were cut short
    saved = json.loads(report.read_text())
    assert saved["requests"] == 0 and saved["requests_added"] == 2
    assert saved["output_tokens_aborted"] == 0 == saved["output_tokens"], saved


# -- item 21: past --shutdown-timeout, one line per cancelled request ---------------------------


def test_requests_cancelled_past_the_shutdown_timeout_log_one_line_each(tiny, tmp_path):
    import signal
    import threading
    import time

    import httpx

    from nanokv_cli.serve.process import ServerProcess

    args = ["--model", str(tiny), "--no-live", "--threads", "1", "--max-num-seqs", "1"]
    server = ServerProcess([*args, "--shutdown-timeout", "1"], tmp_path, {"OMP_NUM_THREADS": "1"})

    def stream() -> None:
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=stream) for _ in range(24)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)  # all in: one decoding, the rest waiting for it
        server.proc.send_signal(signal.SIGTERM)
        code = server.wait(120)
        for t in threads:
            t.join(60)
    finally:
        server.kill()
    log = server.log()
    assert code == 0, log
    assert "Traceback" not in log and "CancelledError" not in log, log
    cancelled = [line for line in log.splitlines() if "request in flight was cancelled" in line]
    assert cancelled, log  # 24 requests of 400 tokens, one at a time, outlast 1 s
    assert all("--shutdown-timeout" in line for line in cancelled)
