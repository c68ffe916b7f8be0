"""One truth in every view (issue #45): over random multi-turn traces under eviction pressure, in
both match modes, the live view's final frame, the summary, ``--json``, the report,
``--per-request``, ``inspect --summary`` and ``inspect --request`` give the same numbers, per
request and in total; and ``inspect --prompts`` gives, prompt by prompt, what a run of the
same prompts one at a time in a cache that never evicts serves.

Every view is the command's own, run in process through the CLI. (That each copied hit is
shown on the logical block its event names is ``test_copied_hits``' property.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from nanokv_cli.cli import app

runner = CliRunner()
WIDTH = 200  # wide enough that no line of the live view is cut
SOURCES = ("shared", "revived", "copied")
TOTALS = ("hit_rate", "cache_queries", "cache_hits", "evictions", "preemptions", "miss_tokens")
TOTALS += ("readmission_queries", "readmission_hits")


def invoke(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": str(WIDTH)})
    assert result.exit_code == 0, result.output
    return result.stdout


@st.composite
def conversations(draw):
    """Prompts of token ids from a small vocabulary: new conversations, next turns (an earlier
    prompt, an answer and a question: the history re-sent), near-repeats; arrivals in bursts."""
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(2, 9))):
        kind = draw(st.sampled_from(["new", "turn", "turn", "repeat"])) if prompts else "new"
        if kind == "new":
            prompt = draw(st.lists(st.integers(1, 40), min_size=1, max_size=40))
        else:
            earlier = draw(st.sampled_from(prompts))
            cut = len(earlier) if kind == "turn" else draw(st.integers(0, len(earlier)))
            more = draw(st.lists(st.integers(1, 40), min_size=1, max_size=24))
            prompt = earlier[:cut] + more
        prompts.append(prompt[:96])
    gaps = draw(st.lists(st.sampled_from([0.0, 0.002, 0.02, 1.0]), min_size=len(prompts)))
    tokens = draw(st.lists(st.integers(1, 8), min_size=len(prompts)))
    return [(p, t, g) for p, t, g in zip(prompts, tokens, gaps)]


def write_prompts(path: Path, requests, spacing: float | None = None) -> Path:
    """A JSONL prompt file; ``spacing``: one request every ``spacing`` virtual seconds
    (each finished before the next arrives) instead of the drawn gaps."""
    clock, lines = 0.0, []
    for i, (prompt, max_tokens, gap) in enumerate(requests):
        clock = i * spacing if spacing is not None else clock + gap
        record = {"prompt_token_ids": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        lines.append(json.dumps({**record, "timestamp": clock}))
    path.write_text("\n".join(lines) + "\n")
    return path


def final_frame(out: str) -> dict:
    """The numbers of the live view's last frame (printed before the summary)."""
    frame = out[: out.index("Summary")]
    cache = [line for line in frame.splitlines() if line.startswith("cache   ")][-1]
    misses = [line for line in frame.splitlines() if line.startswith("misses  ")][-1]
    done = [line for line in frame.splitlines() if "evictions" in line][-1]
    queue = [line for line in frame.splitlines() if "running" in line][-1]
    return {
        "hit_rate": re.search(r"hit rate ([\d.]+)%", cache).group(1),
        "sources": dict(re.findall(r"(shared|revived|copied) ([\d.]+)%", cache)),
        "queries": int(re.search(r"of ([\d,]+) tokens looked up", cache).group(1).replace(",", "")),
        "misses": {
            r: int(n.replace(",", "")) for r, n in re.findall(r"([a-z-]+) ([\d,]+) \(", misses)
        },
        "evictions": int(re.search(r"evictions ([\d,]+)", done).group(1).replace(",", "")),
        "preemptions": int(re.search(r"preemptions ([\d,]+)", done).group(1).replace(",", "")),
        "done": re.search(r"done (\d+)/(\d+)", queue).groups(),
    }


def check_frame(frame: dict, report: dict) -> None:
    q = report["cache_queries"]
    assert frame["hit_rate"] == f"{report['hit_rate']:.1%}"[:-1]
    assert frame["queries"] == q
    assert frame["sources"] == {s: f"{report[f'{s}_hit_tokens'] / q:.1%}"[:-1] for s in SOURCES}
    assert frame["misses"] == {r: n for r, n in report["miss_tokens"].items() if n}
    assert (frame["evictions"], frame["preemptions"]) == (
        report["evictions"],
        report["preemptions"],
    )
    assert frame["done"] == (str(report["requests"]), str(report["requests_added"]))


def check_summary(out: str, report: dict) -> None:
    summary = out[out.index("Summary") :]
    rows = {" ".join(line.split()[:2]): line.split() for line in summary.splitlines() if line}
    assert rows["prefix-cache hit"][3] == f"{report['hit_rate']:.1%}"
    assert f"{report['cache_hits']:,} of {report['cache_queries']:,} prompt tokens" in summary
    for reason, n in report["miss_tokens"].items():
        if n:
            assert f"{reason} {n:,}" in rows, reason
    assert rows[f"evictions {report['evictions']:,}"]
    assert rows[f"preemptions {report['preemptions']:,}"]


def check_requests(trace: Path, lines: list[dict], report: dict) -> None:
    assert sum(r["cached_tokens"] for r in lines) == report["cache_hits"]
    assert sum(r["prompt_tokens"] for r in lines) == report["cache_queries"]
    missed: dict[str, int] = {}
    for rec in lines:
        shown = json.loads(invoke("inspect", trace, "--request", rec["seq_id"], "--json"))
        first = [look for look in shown["lookups"] if look["first_admission"]]
        assert len(first) == 1, shown["lookups"]
        look = first[0]
        assert (look["cached_tokens"], look["miss_reason"], look["miss_block"]) == (
            rec["cached_tokens"],
            rec["miss_reason"],
            rec["miss_block"],
        )
        assert shown["num_prompt_tokens"] == rec["prompt_tokens"]
        missed[rec["miss_reason"]] = missed.get(rec["miss_reason"], 0) + (
            rec["prompt_tokens"] - rec["cached_tokens"]
        )
    # Each request's misses are counted under its own (first missed block's) reason, and what
    # re-admissions after a preemption recompute under "preempted".
    again = report["readmission_queries"] - report["readmission_hits"]
    assert sum(r["readmission_hit_tokens"] for r in lines) == report["readmission_hits"]
    missed["preempted"] = missed.get("preempted", 0) + again
    assert {r: n for r, n in missed.items() if n} == {
        r: n for r, n in report["miss_tokens"].items() if n
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    conversations(),
    st.sampled_from([2, 4, 8, 16]),
    st.integers(0, 12),  # blocks beyond what the largest request needs: evictions, preemptions
    st.sampled_from(["token", "block"]),
)
def test_every_view_gives_the_same_numbers(requests, block_size, spare, mode):
    import tempfile

    need = max(-(-(len(p) + t) // block_size) for p, t, _ in requests)
    num_blocks = need + spare
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        prompts = write_prompts(tmp / "prompts.jsonl", requests)
        trace, report_path, per_request = tmp / "run.trace", tmp / "r.json", tmp / "q.jsonl"
        run = ["replay", prompts, "--dry-run", "--block-size", block_size]
        run += ["--num-blocks", num_blocks, "--prefix-match", mode]
        out = invoke(*run, "--live", "--record", trace, "--report", report_path,
                     "--per-request", per_request)  # fmt: skip
        report = json.loads(report_path.read_text())
        as_json = json.loads(invoke(*run, "--json"))
        summary = json.loads(invoke("inspect", trace, "--summary", "--json"))
        lines = [json.loads(x) for x in per_request.read_text().splitlines()]

        assert report["requests"] == len(requests)
        assert report["cache_hits"] == sum(report[f"{s}_hit_tokens"] for s in SOURCES)
        assert sum(report["miss_tokens"].values()) == (
            report["cache_queries"]
            - report["cache_hits"]  # first admissions
            + report["readmission_queries"]
            - report["readmission_hits"]  # after preemption
        )
        for key in TOTALS + tuple(f"{s}_hit_tokens" for s in SOURCES):
            assert as_json[key] == report[key], key
            assert summary["cache"][key] == report[key], key
        check_frame(final_frame(out), report)
        check_summary(out, report)
        check_requests(trace, lines, report)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.sampled_from([2, 4, 8, 16]), st.sampled_from(["token", "block"]))
def test_inspect_prompts_is_a_run_one_at_a_time_that_never_evicts(requests, block_size, mode):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # One output token: a block's only tokens are its prompt's, as in the prompt map.
        one_at_a_time = [(p, 1, 0.0) for p, _, _ in requests]
        prompts = write_prompts(tmp / "prompts.jsonl", one_at_a_time, spacing=10.0)
        per_request = tmp / "q.jsonl"
        blocks = sum(-(-(len(p) + 1) // block_size) for p, _, _ in requests)
        run = ["replay", prompts, "--dry-run", "--block-size", block_size, "--prefix-match", mode]
        as_json = json.loads(invoke(*run, "--num-blocks", blocks, "--per-request", per_request,
                                    "--json"))  # fmt: skip
        assert as_json["evictions"] == 0
        # Each request frees its blocks in the step that computed it: the peak still counts them.
        assert as_json["peak_used_blocks"] >= -(-len(requests[0][0]) // block_size)
        mapped = json.loads(
            invoke(
                "inspect",
                "--prompts",
                prompts,
                "--block-size",
                block_size,
                "--prefix-match",
                mode,
                "--json",
            )  # fmt: skip
        )
        lines = sorted(
            (json.loads(x) for x in per_request.read_text().splitlines()), key=lambda r: r["line"]
        )
        rows = mapped["prompts"]
        assert [r["cached_tokens"] for r in rows] == [r["cached_tokens"] for r in lines]
        # The map tells ``below-block`` (a prompt that never fills one block) apart from the
        # engine's ``last-block``, in its rows and its headline alike; nothing else differs.
        for row, line in zip(rows, lines, strict=True):
            if row["miss_reason"] == "below-block":
                assert line["miss_reason"] == "last-block"
                assert line["prompt_tokens"] <= block_size
            else:
                assert row["miss_reason"] == line["miss_reason"]
        # The rows add up to the headline, and the headline is the run's.
        assert sum(r["cached_tokens"] for r in rows) == mapped["hit_tokens"]
        assert mapped["hit_tokens"] == as_json["cache_hits"]
        assert mapped["prompt_tokens"] == as_json["cache_queries"]
        merged = dict(mapped["miss_tokens"])
        merged["last-block"] = merged.get("last-block", 0) + merged.pop("below-block", 0)
        assert {r: n for r, n in merged.items() if n} == {
            r: n for r, n in as_json["miss_tokens"].items() if n
        }
