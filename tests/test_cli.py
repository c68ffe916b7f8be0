"""The command line without a model: every format in dry run, traces, inspect, and user errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nanokv_cli import __version__
from nanokv_cli.cli import app
from nanokv_cli.trace.reader import TraceReader

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO / "examples" / "traces" / "mooncake_conversation_trace.jsonl"

runner = CliRunner()


def nanokv(*args: str, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def ok(*args: str, input: str | None = None):
    result = nanokv(*args, input=input)
    assert result.exit_code == 0, result.output
    return result


def json_of(*args: str):
    return json.loads(ok(*args, "--json").stdout)


@pytest.fixture
def prompts_jsonl(tmp_path) -> Path:
    system = "You are a careful assistant who answers in one sentence. " * 3
    lines = [
        {"prompt": system + "What is paged attention?", "timestamp": 0},
        # Arrives once the first prompt is computed, so it can hit its blocks.
        {"prompt": system + "What is a prefix cache?", "max_tokens": 5, "timestamp": 1},
        {
            "messages": [{"role": "user", "content": "hello"}],
            "temperature": 0.8,
            "seed": 1,
            "timestamp": 1,
        },
        {"prompt_token_ids": list(range(40)), "ignore_eos": True, "timestamp": 1.5},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def check_report(report: dict, requests: int) -> None:
    assert report["requests"] == requests
    assert report["prompt_tokens"] > 0 and report["output_tokens"] > 0
    assert report["hit_rate"] == pytest.approx(report["cache_hits"] / report["cache_queries"])
    for key in (
        "evictions",
        "preemptions",
        "peak_used_blocks",
        "output_throughput",
        "total_token_throughput",
    ):
        assert key in report
    assert 0 < report["peak_used_blocks"] <= report["num_blocks"]


# -- help and version --------------------------------------------------------------------------


def test_version():
    assert ok("--version").stdout.strip() == f"nanokv {__version__}"


@pytest.mark.parametrize("command", [[], ["generate"], ["replay"], ["inspect"]])
def test_help_has_examples(command):
    out = ok(*command, "--help").stdout
    assert "Examples" in out and "nanokv " in out


def test_no_command_shows_help():
    result = nanokv()
    assert "generate" in result.output and "replay" in result.output


# -- replay --dry-run, every format -------------------------------------------------------------


def test_dry_run_jsonl_all_record_kinds(prompts_jsonl, tokenizer_dir):
    report = json_of(
        "replay", prompts_jsonl, "--dry-run", "--model", tokenizer_dir, "--block-size", "8"
    )
    check_report(report, 4)
    assert report["dry_run"] and report["format"] == "jsonl" and report["block_size"] == 8
    assert report["cache_hits"] > 0  # the second prompt shares the first's long system text
    assert report["infinite_cache_hit_rate"] >= report["hit_rate"]
    assert report["model"] == str(tokenizer_dir.resolve())


def test_dry_run_plain_text_with_chat_template(tmp_path, tokenizer_dir):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\nsecond prompt\n\nthird\n")
    plain = json_of("replay", path, "--dry-run", "--model", tokenizer_dir, "--max-tokens", "3")
    chat = json_of(
        "replay", path, "--dry-run", "--model", tokenizer_dir, "--max-tokens", "3", "--chat"
    )
    check_report(plain, 3)
    assert plain["format"] == "text" and plain["output_tokens"] == 9
    assert chat["prompt_tokens"] > plain["prompt_tokens"]  # the template adds role markers


def test_dry_run_sharegpt(tmp_path, tokenizer_dir):
    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i}"},
                {"from": "gpt", "value": "answer"},
            ]
        }
        for i in range(3)
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    report = json_of("replay", path, "--dry-run", "--model", tokenizer_dir)
    check_report(report, 3)
    assert report["format"] == "sharegpt"


def test_dry_run_real_mooncake_trace_slice():
    report = json_of(
        "replay",
        MOONCAKE,
        "--dry-run",
        "--limit",
        "40",
        "--block-size",
        "64",
        "--num-blocks",
        "4000",
    )
    check_report(report, 40)
    assert report["format"] == "mooncake" and report["arrivals"] == "timestamps"
    assert report["model"] is None
    assert 0 < report["hit_rate"] <= report["infinite_cache_hit_rate"] <= 1
    assert report["duration_s"] > 0  # virtual seconds, following the trace's timestamps


def test_dry_run_rate_and_all_at_once_retime_arrivals():
    base = ["replay", MOONCAKE, "--dry-run", "--limit", "10", "--block-size", "256"]
    burst = json_of(*base, "--rate", "inf")
    paced = json_of(*base, "--rate", "0.5")
    assert burst["arrivals"] == "rate" and burst["rate"] is None
    assert paced["rate"] == 0.5
    assert paced["duration_s"] > burst["duration_s"]


def test_dry_run_comparison_json_lists_every_configuration():
    reports = json_of(
        "replay",
        MOONCAKE,
        "--dry-run",
        "--limit",
        "20",
        "--block-size",
        "16,64",
        "--num-blocks",
        "2000,8000",
    )
    assert [(r["block_size"], r["num_blocks"]) for r in reports] == [
        (16, 2000),
        (16, 8000),
        (64, 2000),
        (64, 8000),
    ]
    for r in reports:
        assert r["hit_rate"] <= r["infinite_cache_hit_rate"] + 1e-9
    # Same block size, more blocks: never fewer hits on this trace slice.
    assert reports[1]["cache_hits"] >= reports[0]["cache_hits"]


def test_dry_run_comparison_terminal_table_and_chart(tmp_path):
    report_file = tmp_path / "cmp.json"
    out = ok(
        "replay",
        MOONCAKE,
        "--dry-run",
        "--limit",
        "20",
        "--block-size",
        "16,64",
        "--report",
        report_file,
    ).stdout
    assert "Cache configurations" in out and "Prefix-cache hit rate" in out
    assert out.count("│") >= 2 and "█" in out
    saved = json.loads(report_file.read_text())
    assert [r["block_size"] for r in saved] == [16, 64]
    assert "\x1b[" not in out  # plain output when not a terminal


def test_dry_run_default_cache_is_the_same_number_of_tokens_per_block_size():
    reports = json_of("replay", MOONCAKE, "--dry-run", "--limit", "3", "--block-size", "16,256")
    assert reports[0]["num_blocks"] * 16 == reports[1]["num_blocks"] * 256


def test_summary_table_when_not_json(prompts_jsonl, tokenizer_dir, tmp_path):
    report_file = tmp_path / "r.json"
    out = ok(
        "replay", prompts_jsonl, "--dry-run", "--model", tokenizer_dir, "--report", report_file
    ).stdout
    assert "prefix-cache hit rate" in out and "peak blocks in use" in out
    report = json.loads(report_file.read_text())
    check_report(report, 4)
    assert f"{report['hit_rate']:.1%}" in out


def test_no_prefix_cache_means_no_hits(prompts_jsonl, tokenizer_dir):
    report = json_of(
        "replay",
        prompts_jsonl,
        "--dry-run",
        "--model",
        tokenizer_dir,
        "--no-prefix-cache",
        "--block-size",
        "8",
    )
    assert report["cache_hits"] == 0 and report["prefix_caching"] is False


def test_dry_run_imports_no_torch(tmp_path):
    """A dry run, with text needing the default model's tokenizer, and inspect: no torch."""
    text = tmp_path / "p.txt"
    text.write_text("hello there\nhello again\n")
    trace = tmp_path / "t.trace"
    code = (
        "import sys\n"
        "from nanokv_cli.cli import app\n"
        "def run(args):\n"
        "    try:\n"
        "        app(args, prog_name='nanokv')\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), e.code\n"
        f"run(['replay', {str(text)!r}, '--dry-run', '--record', {str(trace)!r}, '--json'])\n"
        f"run(['replay', {str(MOONCAKE)!r}, '--dry-run', '--limit', '5', '--json'])\n"
        f"run(['inspect', {str(trace)!r}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('NO TORCH')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("NO TORCH")


# -- record and inspect ------------------------------------------------------------------------


@pytest.fixture
def recorded(tmp_path, tokenizer_dir) -> Path:
    prefix = "A shared system prompt that spans several blocks of tokens. "
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"prompt": prefix + q, "timestamp": t})
            for t, q in enumerate(["one?", "two?", "three?"])
        )
    )
    trace = tmp_path / "run.trace"
    ok(
        "replay",
        path,
        "--dry-run",
        "--model",
        tokenizer_dir,
        "--block-size",
        "8",
        "--num-blocks",
        "64",
        "--record",
        trace,
        "--max-tokens",
        "400",
    )
    return trace


def test_record_writes_a_readable_trace(recorded, tokenizer_dir):
    reader = TraceReader(recorded)
    assert reader.header["model"] == str(tokenizer_dir.resolve())
    assert reader.header["dry_run"] is True and reader.block_size == 8
    state = reader.state_at()
    assert state.last_snapshot is not None and not state.block_tables  # all finished


def test_inspect_json_at_a_step_with_shared_blocks(recorded):
    reader = TraceReader(recorded)
    step = next(
        e.step for e in reader.events() if type(e).__name__ == "StepSnapshot" and e.num_running >= 2
    )
    info = json_of("inspect", recorded, "--step", str(step))
    assert info["step"] == step
    shared = [b for b in info["blocks"] if b["state"] == "shared"]
    assert shared and all(b["ref_count"] >= 2 and b["hash"] is not None for b in shared)
    tables = {s["seq_id"]: s["block_table"] for s in info["sequences"]}
    for b in shared:
        assert all(b["block_id"] in tables[s] for s in b["seq_ids"])
    text = {b["block_id"]: b["text"] for b in info["blocks"]}
    holder = shared[0]["seq_ids"][0]
    assert "".join(text[b] or "" for b in tables[holder]).startswith("A shared system prompt")


def test_inspect_terminal_defaults_to_the_last_step(recorded):
    last = TraceReader(recorded).state_at().last_snapshot.step
    out = ok("inspect", recorded).stdout
    assert f"step {last}" in out and "Blocks" in out and "cached-free" in out


def test_inspect_prompts_shows_shared_blocks(tmp_path, tokenizer_dir):
    path = tmp_path / "p.txt"
    path.write_text(
        "The same opening words for all, then one.\nThe same opening words for all, then two.\n"
    )
    info = json_of("inspect", "--prompts", path, "--block-size", "4", "--model", tokenizer_dir)
    first, second = info["prompts"]
    assert first["blocks"][0]["hash"] == second["blocks"][0]["hash"]
    assert first["blocks"][0]["shared_by"] == 2 and second["blocks"][0]["hit"]
    assert info["hit_rate"] > 0
    out = ok("inspect", "--prompts", path, "--block-size", "4", "--model", tokenizer_dir).stdout
    assert "2 prompts on 4-token blocks" in out and "Shared blocks" in out and "The same" in out


def test_inspect_prompts_mooncake_without_tokenizer():
    info = json_of("inspect", "--prompts", MOONCAKE, "--limit", "3", "--block-size", "512")
    # The first three requests open with hash id 0: one shared 512-token block.
    assert [p["blocks"][0]["shared_by"] for p in info["prompts"]] == [3, 3, 3]


# -- errors ------------------------------------------------------------------------------------


def fails(code: int, *args: str, input: str | None = None) -> str:
    result = nanokv(*args, input=input)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.stderr


def test_a_kv_cache_dtype_no_attention_path_reads_is_one_error():
    err = fails(1, "generate", "x", "--kv-cache-dtype", "bfloat16", "--no-live")
    assert err.count("\n") == 1 and "kv_cache_dtype 'bfloat16' with float32 weights" in err
    assert "--kv-cache-dtype" in err  # what to change
    assert "choose from auto, float32" in fails(2, "generate", "x", "--kv-cache-dtype", "fp8")


def test_missing_file():
    err = fails(1, "replay", "/no/such/prompts.txt", "--dry-run")
    assert err.strip() == "nanokv: error: /no/such/prompts.txt: no such file"
    assert "no such file" in fails(1, "inspect", "/no/such.trace")


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "broken"\n')
    err = fails(1, "replay", path, "--dry-run")
    assert f"{path} line 2: not valid JSON" in err and err.count("\n") == 1


def test_unknown_format(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "no known key"}\n')
    assert "unknown format" in fails(1, "replay", path, "--dry-run")
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    assert "unknown format" in fails(1, "replay", binary, "--dry-run")


def test_not_a_trace(tmp_path, prompts_jsonl):
    assert "not a nanokv trace" in fails(1, "inspect", prompts_jsonl)


@pytest.mark.parametrize(
    "damage", ["zero-length", "bad magic", "torn", "wrong version", "bad v1 line"]
)
def test_damaged_traces_give_one_line(recorded, tmp_path, damage):
    data = recorded.read_bytes()
    path = tmp_path / "t.trace"
    if damage == "torn":  # killed mid-write: what is whole is shown, with a note
        path.write_bytes(data[:-7])
        result = nanokv("inspect", path)
        assert result.exit_code == 0 and "torn" in result.stderr
        return
    path.write_bytes(
        {
            "zero-length": b"",
            "bad magic": b"NOTATRACE" + data[8:],
            "wrong version": json.dumps(
                {"format": "nanokv-trace", "version": 7, "block_size": 4, "num_blocks": 4}
            ).encode()
            + b"\n",
            "bad v1 line": json.dumps(
                {"format": "nanokv-trace", "version": 1, "block_size": 4, "num_blocks": 4}
            ).encode()
            + b"\n{not json\n",
        }[damage]
    )
    err = fails(1, "inspect", path)
    assert err.startswith("nanokv: error: ") and err.count("\n") == 1 and str(path) in err


def test_step_not_in_trace(recorded):
    assert "no step 99999" in fails(1, "inspect", recorded, "--step", "99999")


def test_impossible_cache_size_rejects_every_request():
    err = fails(
        1,
        "replay",
        MOONCAKE,
        "--dry-run",
        "--limit",
        "3",
        "--num-blocks",
        "2",
        "--block-size",
        "16",
    )
    assert "every request was rejected" in err and "cache has only 2" in err


def test_some_requests_too_big_are_skipped_with_a_warning():
    result = nanokv(
        "replay",
        MOONCAKE,
        "--dry-run",
        "--limit",
        "30",
        "--block-size",
        "16",
        "--num-blocks",
        "2000",
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["rejected"] > 0 and report["requests"] == 30 - report["rejected"]
    assert "skipped" in result.stderr and "line 12" in result.stderr


def test_prompt_too_long_for_max_model_len(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": list(range(50))}) + "\n")
    err = fails(1, "replay", path, "--dry-run", "--max-model-len", "20")
    assert "exceeds max_model_len (20)" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--block-size", "16,abc"], "expected integers"),
        (["--block-size", "0"], "values must be >= 1"),
        (["--num-blocks", "-5"], "values must be >= 1"),
        (["--rate", "-1"], "rate must be > 0"),
        (["--rate", "fast"], "requests per second"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--temperature", "-0.5"], "--temperature"),
        (["--limit", "0"], "--limit"),
        (["--format", "csv"], "--format"),
    ],
)
def test_bad_flag_values_are_usage_errors(args, message):
    err = fails(2, "replay", MOONCAKE, "--dry-run", *args)
    assert message in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["replay", "x.txt", "--block-size", "16,32"], "need --dry-run"),
        (
            ["replay", "x.txt", "--dry-run", "--block-size", "16,32", "--record", "t.trace"],
            "records one run",
        ),
        (["replay", "x.txt", "--dry-run", "--kv-cache-memory", "1GiB"], "use --num-blocks"),
        (["replay", "x.txt", "--kv-cache-memory", "lots"], "512MiB"),
        (["replay", "x.txt", "--dtype", "int3"], "--dtype"),
        (["replay", "x.txt", "--device", "gpu0"], "--device"),
        (["inspect"], "give a TRACE file or --prompts FILE"),
        (["inspect", "a.trace", "--prompts", "p.txt"], "give a TRACE file or --prompts FILE"),
        (["generate"], "give at least one PROMPT"),
        (["generate", "-", "more"], "cannot be mixed"),
        (["replay"], "Missing argument"),
        (["replay", "x.txt", "--no-such-flag"], "No such option"),
    ],
)
def test_usage_errors(args, message):
    assert message in fails(2, *args)


def test_debug_shows_the_exception():
    result = nanokv("replay", "/no/such/file.txt", "--dry-run", "--debug")
    assert result.exit_code != 0
    assert type(result.exception).__name__ == "PromptFileError"


def test_report_is_written_atomically_next_to_the_target(tmp_path, prompts_jsonl, tokenizer_dir):
    target = tmp_path / "out" / "report.json"
    target.parent.mkdir()
    target.write_text("old")
    ok("replay", prompts_jsonl, "--dry-run", "--model", tokenizer_dir, "--report", target)
    assert json.loads(target.read_text())["requests"] == 4
    assert [p.name for p in target.parent.iterdir()] == ["report.json"]  # no temp file left


# -- why a request hit or missed -------------------------------------------------------------


def test_summary_json_and_report_agree_and_explain_every_miss(
    tmp_path, prompts_jsonl, tokenizer_dir
):
    args = ["replay", prompts_jsonl, "--dry-run", "--model", tokenizer_dir, "--block-size", "8"]
    report_path, per_request = tmp_path / "r.json", tmp_path / "requests.jsonl"
    as_json = json_of(*args, "--report", report_path, "--per-request", per_request)
    report = json.loads(report_path.read_text())
    for key in ("hit_rate", "cache_queries", "cache_hits", "miss_tokens", "evictions"):
        assert report[key] == as_json[key]
    assert report["cache_hits"] == (
        report["shared_hit_tokens"] + report["revived_hit_tokens"] + report["copied_hit_tokens"]
    )
    assert sum(report["miss_tokens"].values()) == report["cache_queries"] - report["cache_hits"]
    lines = [json.loads(x) for x in per_request.read_text().splitlines()]
    assert sorted(r["line"] for r in lines) == [1, 2, 3, 4]
    assert sum(r["cached_tokens"] for r in lines) == report["cache_hits"]
    assert sum(r["prompt_tokens"] for r in lines) == report["cache_queries"]
    assert all(r["miss_reason"] in report["miss_tokens"] for r in lines)
    summary = ok(*args).stdout
    assert f"{report['hit_rate']:.1%}" in summary
    assert f"{report['cache_hits']:,} of {report['cache_queries']:,} prompt tokens" in summary
    for reason, n in report["miss_tokens"].items():
        if n:
            assert any(line.split()[:2] == [reason, f"{n:,}"] for line in summary.splitlines())


def test_inspect_request_explains_hits_and_the_miss(recorded):
    reader = TraceReader(recorded)
    later = [e.seq_id for e in reader.events() if type(e).__name__ == "SequenceAdded"][1]
    info = json_of("inspect", recorded, "--request", str(later))
    look = info["lookups"][0]
    assert look["first_admission"] and all(not x["first_admission"] for x in info["lookups"][1:])
    hits = [b for b in look["blocks"] if b["hit"]]
    whole = [b for b in hits if b["hit"] != "copied"]
    copied = sum(b["num_tokens"] for b in hits if b["hit"] == "copied")
    assert hits and look["cached_tokens"] == 8 * len(whole) + copied
    assert all(b["hit"] in ("shared", "revived") for b in whole) and len(hits) - len(whole) <= 1
    assert look["miss_reason"] in ("last-token", "evicted", "cold")
    assert look["miss_block"] == len(whole)
    out = ok("inspect", recorded, "--request", str(later)).stdout
    assert f"request {later}" in out and f"miss: {look['miss_reason']}" in out


def test_inspect_prompts_gives_each_prompt_its_miss_reason(tmp_path, tokenizer_dir):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt_token_ids": t}) for t in ([1, 2, 3, 4, 5], [1, 2, 3, 9, 9]))
    )
    info = json_of("inspect", "--prompts", path, "--block-size", "4")
    first, second = info["prompts"]
    assert first["miss_reason"] == "cold"
    # Token-granular reuse copies the three shared tokens; whole blocks miss them.
    assert (second["miss_reason"], second["cached_tokens"]) == ("cold", 3)
    assert info["miss_tokens"] == {"cold": 7} and info["hit_tokens"] == 3
    whole = json_of("inspect", "--prompts", path, "--block-size", "4", "--prefix-match", "block")
    assert (whole["prompts"][1]["miss_reason"], whole["prompts"][1]["partial_tokens"]) == (
        "partial",
        3,
    )
    assert whole["miss_tokens"] == {"partial": 5, "cold": 5} and whole["hit_tokens"] == 0
    bad = nanokv("inspect", "--prompts", path, "--prefix-match", "tokens")
    assert bad.exit_code == 2 and "--prefix-match" in bad.output


def test_inspect_summary_and_exports(recorded, tmp_path):
    info = json_of("inspect", recorded, "--summary")
    reader = TraceReader(recorded)
    assert info["steps"] == reader.state_at().last_snapshot.step + 1
    assert info["events"]["StepSnapshot"] == info["steps"] and info["file_bytes"] > 0
    kv = tmp_path / "run.kv"
    result = ok("inspect", recorded, "--export", "vllm-kv-events", kv)
    assert "event batches" in result.stderr and kv.stat().st_size > 0
    assert "choose from" in nanokv("inspect", recorded, "--export", "csv", kv).output
    err = fails(1, "inspect", recorded, "--export", "jsonl", tmp_path / "no" / "x.jsonl")
    assert "cannot write --export" in err and err.count("\n") == 1


def test_inspect_lists_what_it_shows_and_all_with_all(recorded, monkeypatch):
    import nanokv_cli.commands.inspect as cli_module
    import nanokv_cli.views.inspect as inspect_view

    full = json_of("inspect", recorded, "--json", "--all")
    assert full["blocks_listed"] == full["blocks_total"] == len(full["blocks"]) > 3
    assert full["sequences_total"] == len(full["sequences"])
    monkeypatch.setattr(cli_module, "JSON_LIST_LIMIT", 3)
    capped = json_of("inspect", recorded, "--json")
    assert capped["blocks_listed"] == len(capped["blocks"]) == 3
    assert capped["blocks_total"] == full["blocks_total"] and capped["counts"] == full["counts"]
    assert capped["blocks"] == full["blocks"][:3]  # the same blocks, the same text
    monkeypatch.setattr(inspect_view, "MAX_ROWS", 2)
    out = " ".join(ok("inspect", recorded).stdout.split())
    assert f"… {full['blocks_total'] - 2:,} more blocks not shown" in out


def test_inspect_summary_gives_the_runs_cache_numbers(tmp_path, prompts_jsonl):
    trace, report = tmp_path / "run.trace", tmp_path / "report.json"
    ok("replay", prompts_jsonl, "--dry-run", "--record", trace, "--report", report)
    run = json.loads(report.read_text())
    info = json_of("inspect", trace, "--summary")
    assert info["requests"] == run["requests_added"] > 0
    for key in ("hit_rate", "cache_queries", "cache_hits", "evictions", "preemptions"):
        assert info["cache"][key] == run[key], key
    text = ok("inspect", trace, "--summary").stdout
    assert f"hit rate {run['hit_rate']:.1%}" in " ".join(text.split())


def test_bad_request_id_per_request_path_and_old_traces(recorded, tmp_path, prompts_jsonl):
    err = fails(1, "inspect", recorded, "--request", "99999")
    assert "no request 99999 in this trace (its requests are 0 to 2)" in err
    err = fails(
        1, "replay", prompts_jsonl, "--dry-run", "--per-request", tmp_path / "no" / "r.jsonl"
    )
    assert err.startswith("nanokv: error: cannot write --per-request") and err.count("\n") == 1
    v1 = tmp_path / "v1.trace"
    ok("inspect", recorded, "--export", "jsonl", v1)
    old = tmp_path / "old.trace"  # as an older nanokv wrote it: version 1, no lookups
    old.write_text(
        "\n".join(
            line for line in v1.read_text().splitlines() if '"type":"CacheLookup"' not in line
        )
        + "\n"
    )
    err = fails(1, "inspect", old, "--request", "1")
    assert "no cache-lookup records" in err and err.count("\n") == 1


def test_each_option_alias_is_declared_once():
    """A flag several commands share is declared once (commands/options.py); one a command
    declares for itself has a name of its own, so a reader never meets two meanings under one
    alias."""
    import ast

    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "nanokv_cli" / "commands").glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            value = getattr(node, "value", None)
            if isinstance(node, ast.Assign) and isinstance(value, ast.Subscript):
                if getattr(value.value, "id", None) == "Annotated":
                    for target in node.targets:
                        seen.setdefault(target.id, []).append(path.name)
    assert len(seen) > 40, sorted(seen)  # the scan finds the aliases
    twice = {name: files for name, files in seen.items() if len(files) > 1}
    assert not twice, twice
