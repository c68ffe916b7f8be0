"""``nanokv advise`` and the divergence explanations, on prompt sets whose answers are known
by construction: a varying first line, a one-word difference at token k, prompts below one
block, a block-size-bound case. Every gain advise prints is checked against a separate
``nanokv replay --dry-run`` of the changed setting or input. Real tokenizer (the default
model's), dry runs only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nanokv_cli.cli import app
from nanokv_cli.engine.model.loader import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO / "examples" / "traces" / "mooncake_conversation_trace.jsonl"
runner = CliRunner()

POLICY = "\n".join(
    [
        "You answer for the Northwind store and follow these rules.",
        "Greet the customer once, by name when it is known.",
        "Orders ship within two working days; tracking links expire after a month.",
        "Refunds go back to the original card within ten days of the return arriving.",
        "Never promise a delivery date the carrier has not confirmed.",
        "Escalate threats, legal questions and data requests to a human agent.",
        "Quote prices with their currency and say whether tax is included.",
        "Keep every answer under eighty words and end with one follow-up question.",
    ]
)
QUESTIONS = [
    "Where is my parcel?",
    "Can I return shoes I wore once?",
    "Do you deliver to Norway?",
    "Why was my card charged twice?",
    "How do I change my address?",
]


def ok(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


def advise(path: Path, *args) -> dict:
    return json.loads(ok("advise", path, "--json", *args))


def write_prompts(path: Path, prompts: list[str]) -> Path:
    # One second apart: each prompt is computed (and cached) before the next arrives.
    lines = [
        json.dumps({"prompt": p, "timestamp": i, "max_tokens": 8}) for i, p in enumerate(prompts)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def replay_hit_rate(path: Path, row: dict) -> tuple[float, int]:
    """A separate dry run of ``path`` at a grid row's settings, as a user would type it."""
    args = ["replay", path, "--dry-run", "--json", "--max-tokens", "8"]
    args += ["--block-size", row["block_size"], "--num-blocks", row["num_blocks"]]
    if not row["prefix_caching"]:
        args.append("--no-prefix-cache")
    if "prefix_match" in row:
        args += ["--prefix-match", row["prefix_match"]]
    report = json.loads(ok(*args))
    return report["hit_rate"], report["cache_hits"]


def check_every_gain(advice: dict, path: Path, rewrites: dict[str, Path] | None = None) -> None:
    """Each run of the grid (and so each gain and bound) equals its own replay: of ``path``,
    or for a layout finding's run, of the file ``rewrites`` holds for that kind of finding."""
    now = advice["now"]
    assert (now["hit_rate"], now["cache_hits"]) == replay_hit_rate(path, now)
    for row in advice["grid"]:
        source = (rewrites or {}).get(row["layout"]) if row["layout"] else path
        assert source is not None, row
        assert (row["hit_rate"], row["cache_hits"]) == replay_hit_rate(source, row), row
        assert row["gain"] == row["hit_rate"] - now["hit_rate"]
        assert row["tokens_saved"] == row["cache_hits"] - now["cache_hits"]
    # One ranked list, settings and layout alike: by tokens more from the cache, each a run of
    # the grid, each gaining.
    ranked = [c["tokens_saved"] for c in advice["changes"]]
    assert ranked == sorted(ranked, reverse=True) and all(t > 0 for t in ranked)
    assert [c["rank"] for c in advice["changes"]] == list(range(1, len(ranked) + 1))
    rows = {r["label"]: r for r in advice["grid"]}
    for c in advice["changes"]:
        assert c["gain"] > 0 and {k: c[k] for k in rows[c["label"]]} == rows[c["label"]]
    for f in advice["findings"]:  # each finding's gain is its run's
        if f["rank"] is not None:
            c = advice["changes"][f["rank"] - 1]
            assert c["finding"] == f and c["tokens_saved"] == f["gain_tokens"]


# -- the cases ---------------------------------------------------------------------------------


def test_a_varying_first_line_is_found_and_moving_it_measured(tmp_path, tokenizer):
    ids = [4817, 2093, 7761, 3358, 9124]
    prompts = [f"Request id: {i}\n{POLICY}\nUser: {q}" for i, q in zip(ids, QUESTIONS)]
    path = write_prompts(tmp_path / "ids.jsonl", prompts)
    advice = advise(path, "--block-size", "16")
    # By construction: every later prompt parts from an earlier one inside line 1, in the id.
    point = advice["divergence_points"][0]
    assert point["requests"] == len(prompts) - 1 and point["line"] == 1
    prefix = len(tokenizer.encode("Request id: "))
    assert prefix <= point["at_token"] < prefix + 4
    assert "Request id: " in point["text"]["before"]
    # The layout finding names the id line, and moving it is the change that gains most.
    top = advice["changes"][0]
    finding = top["finding"]
    assert top["kind"] == "layout" and top["layout"] == finding["kind"] == "varying-first"
    assert finding["prompts"] == len(prompts) and top["gain"] > 0.5
    assert '"Request id: ' in finding["cause"] and finding["rank"] == 1
    assert finding["left"].startswith("Request id: ") and "▸" in finding["left"]
    # The changed input, written as the test built it: the id line where the shared text ends.
    moved = [f"{POLICY}\nRequest id: {i}\nUser: {q}" for i, q in zip(ids, QUESTIONS)]
    relaid = write_prompts(tmp_path / "moved.jsonl", moved)
    check_every_gain(advice, path, {"varying-first": relaid})
    out = ok("advise", path, "--block-size", "16")
    assert "in line 1" in out and "Request id: " in out and "‖" in out
    assert "move the varying line after the shared text" in out and "cause: a varying line" in out


def test_a_one_word_difference_at_token_k(tmp_path, tokenizer):
    head = POLICY + "\nThe customer writes in a"
    tail = " mood and asks about the order status."
    prompts = [head + word + tail for word in (" cheerful", " furious", " puzzled")]
    k = len(tokenizer.encode(head))
    assert tokenizer.encode(prompts[1])[:k] == tokenizer.encode(head)  # the split is clean
    path = write_prompts(tmp_path / "word.jsonl", prompts)
    mode = ["--prefix-match", "block"]
    advice = advise(path, "--block-size", "64", *mode)
    point = advice["divergence_points"][0]
    assert point["at_tokens"] == [k, k] and point["requests"] == 2
    sides = point["text"]
    assert sides["before"].endswith("writes in a")
    # Shown by the first request that parts there: line 2 against line 1.
    assert (point["example"], point["shared_with"]) == (2, 1)
    assert sides["this"].startswith(" furious") and sides["earlier"].startswith(" cheerful")
    assert any(lim["reason"] == "partial" for lim in advice["limits"])
    # Smaller blocks reach closer to token k: a measured gain.
    assert any(c["kind"] == "block_size" and c["block_size"] < 64 for c in advice["changes"])
    check_every_gain(advice, path)
    # The same divergence in inspect --prompts and in --per-request lines.
    info = json.loads(ok("inspect", "--prompts", path, "--block-size", "64", "--json"))
    assert [p["divergence"] and p["divergence"]["at_token"] for p in info["prompts"]] == [
        None,
        k,
        k,
    ]
    assert info["prompts"][2]["divergence"]["shared_with"] in (0, 1)  # both share k tokens
    records = tmp_path / "requests.jsonl"
    ok("replay", path, "--dry-run", "--block-size", "64", "--per-request", records)
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    by_seq = {rec["seq_id"]: rec["divergence"] for rec in lines}
    assert by_seq[0] is None and by_seq[2]["at_token"] == k and by_seq[2]["shared_with"] in (0, 1)
    assert by_seq[2]["text"]["this"].startswith(" puzzled")
    out = ok("inspect", "--prompts", path, "--block-size", "64")
    assert "writes in a‖ puzzled" in out and "writes in a‖ furious" in out


def test_prompts_below_one_block_are_named(tmp_path):
    prompts = [f"Translate to French: {w}" for w in ("cat", "dog", "house", "tree")]
    path = write_prompts(tmp_path / "short.jsonl", prompts)
    advice = advise(path, "--block-size", "64", "--prefix-match", "block")
    below = next(lim for lim in advice["limits"] if lim["reason"] == "below-block")
    assert below["prompts"] == 4 and below["tokens"] == advice["now"]["cache_queries"]
    assert advice["hit_rate"] == 0
    point = advice["divergence_points"][0]
    assert point["requests"] == 3 and point["text"]["before"].endswith("Translate to French:")
    # Token-granular reuse serves the shared words, and says so by its measured gain.
    assert any(c["kind"] == "prefix_match" for c in advice["changes"])
    check_every_gain(advice, path)
    out = ok("advise", path, "--block-size", "64", "--prefix-match", "block")
    assert "below-block" in out and "Translate to French:" in out


def test_a_block_size_bound_case(tmp_path, tokenizer):
    # Prompts share the policy (well over 64 tokens, under 256) and then part.
    prompts = [f"{POLICY}\nUser: {q}" for q in QUESTIONS]
    shared = len(tokenizer.encode(POLICY + "\nUser:"))
    assert 64 < shared < 256
    path = write_prompts(tmp_path / "policy.jsonl", prompts)
    mode = ["--prefix-match", "block"]
    advice = advise(path, "--block-size", "256", *mode)
    assert advice["hit_rate"] == 0 and advice["bounds"]["infinite_cache"]["hit_rate"] == 0
    assert advice["bounds"]["token_level"]["hit_rate"] > 0.5
    point = advice["divergence_points"][0]
    assert point["at_token"] == shared and point["requests"] == len(prompts) - 1
    assert point["text"]["before"].endswith("User:") and point["line"] == POLICY.count("\n") + 2
    top = advice["changes"][0]
    assert top["kind"] in ("block_size", "prefix_match") and top["gain"] > 0.3
    check_every_gain(advice, path)


def test_advise_a_recorded_trace_runs_its_requests_again(tmp_path, tokenizer):
    prompts = [f"{POLICY}\nUser: {q}" for q in QUESTIONS]
    path = write_prompts(tmp_path / "policy.jsonl", prompts)
    trace = tmp_path / "run.trace"
    ok("replay", path, "--dry-run", "--block-size", "32", "--num-blocks", "300", "--record", trace)
    advice = advise(trace)
    recorded = advice["recorded"]
    assert advice["settings"]["block_size"] == 32 and advice["settings"]["num_blocks"] == 300
    # The same requests on the same settings: the recorded run exactly.
    assert (advice["hit_rate"], advice["now"]["cache_hits"]) == (
        recorded["hit_rate"],
        recorded["cache_hits"],
    )
    # inspect --request explains where request 1 parts from request 0, with the text.
    info = json.loads(ok("inspect", trace, "--request", "1", "--json"))
    div = info["divergence"]
    assert div["shared_with"] == 0 and div["at_token"] == len(tokenizer.encode(POLICY + "\nUser:"))
    assert div["text"]["this"].startswith(" Can I") and div["text"]["earlier"].startswith(" Where")
    out = ok("inspect", trace, "--request", "1")
    assert "shares its first" in out and "User:‖ Can I" in out


def test_advise_a_mooncake_slice_says_what_hash_ids_cannot_show():
    advice = advise(MOONCAKE, "--limit", "150", "--block-size", "512", "--num-blocks", "400")
    assert advice["bounds"]["token_level"] is None
    assert any("hash ids of 512-token blocks" in n for n in advice["notes"])
    sizes = {r["block_size"] for r in advice["grid"] if r["kind"] == "block_size"}
    assert sizes and min(sizes) >= 512
    point = advice["divergence_points"][0]
    assert point["text"] is None and point["at_token"] % 512 == 0 and "no text" in point["note"]
    out = ok("advise", MOONCAKE, "--limit", "150", "--block-size", "512", "--num-blocks", "400")
    assert "below 512 cannot be evaluated faithfully" in " ".join(out.split())


def test_advise_help_and_bad_input(tmp_path):
    out = ok("advise", "--help")
    assert "Examples" in out and "nanokv advise" in out
    result = runner.invoke(app, ["advise", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 1 and "no such file" in result.stderr
