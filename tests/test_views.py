"""Rich views rendered for real: block map, live view, tables, chart, inspect."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.dry_run import DryRunExecutor, VirtualClock
from nanokv_cli.engine.core.events import (
    BlockAllocated,
    BlockFreed,
    BlockHit,
    BlockStored,
    CacheState,
)
from nanokv_cli.engine.core.llm_engine import LLMEngine
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.run.analysis import describe_state
from nanokv_cli.views.blockmap import blocks_per_cell, legend, render_block_map
from nanokv_cli.views.inspect import render_prompt_map, render_trace_state
from nanokv_cli.views.live import LiveView
from nanokv_cli.views.tables import comparison_table, hit_rate_chart, summary_table
from nanokv_cli.workload.prompts import map_prompt_blocks


def console(width: int = 100, height: int = 40) -> Console:
    return Console(
        file=io.StringIO(), width=width, height=height, record=True, color_system="truecolor"
    )


def text_of(renderable, width: int = 100) -> str:
    c = console(width)
    c.print(renderable)
    return c.export_text()


def state_with_every_kind() -> CacheState:
    """Block 0 shared by 3, block 1 used, block 2 free but cached, the rest free and clean."""
    state = CacheState(8)
    for event in [
        BlockAllocated(0, 0),
        BlockAllocated(0, 1),
        BlockAllocated(0, 2),
        BlockStored(0, 111, -1, [1, 2]),
        BlockStored(2, 222, 111, [3, 4]),
        BlockHit(1, 0, 111, "shared"),
        BlockHit(2, 0, 111, "shared"),
        BlockFreed(0, 2, 0),
    ]:
        state.apply(event)
    return state


def test_block_map_one_cell_per_block_by_state():
    text = render_block_map(state_with_every_kind(), width=8).plain
    assert text == "3█▒·····"


def test_block_map_wraps_rows_and_colours_shared_blocks_by_ref_count():
    state = state_with_every_kind()
    text = render_block_map(state, width=3)
    assert text.plain == "3█▒\n···\n··"
    spans = {text.plain[s.start : s.end]: str(s.style) for s in text.spans}
    assert "on" in spans["3"] and spans["█"] == "green"


def test_block_map_aggregates_when_blocks_do_not_fit():
    state = CacheState(1000)
    for b in range(600):
        state.apply(BlockAllocated(0, b))
    text = render_block_map(state, width=10, max_rows=5).plain
    rows = text.split("\n")
    assert blocks_per_cell(1000, 10, 5) == 20
    assert len(rows) == 5 and all(len(r) == 10 for r in rows)
    assert text.count("█") == 30 and text.count("·") == 20
    assert "1 cell = 20 blocks" in legend(20).plain
    assert "cell" not in legend(1).plain


def dry_engine(num_blocks: int = 64, block_size: int = 4) -> LLMEngine:
    clock = VirtualClock()
    settings = EngineConfig(num_blocks=num_blocks, block_size=block_size)
    return LLMEngine(DryRunExecutor(settings, clock=clock), settings, clock=clock)


def drive_shared_prefix(eng: LLMEngine, view: LiveView, n: int = 4) -> None:
    prefix = list(range(50, 70))
    for i in range(n):
        eng.add_request(prefix + [i, i + 1], SamplingParams(max_tokens=8, ignore_eos=True))
        eng.step()
        view.tick()


def test_live_view_renders_map_counters_and_block_tables():
    eng = dry_engine()
    con = console()
    view = LiveView(eng.num_blocks, 4, console=con, title="unit", total_requests=4)
    view.attach(eng.events)
    drive_shared_prefix(eng, view)
    view.update()
    out = text_of(view.render())
    assert "unit · 64 blocks × 4 tokens" in out
    snap = view.snapshot
    assert f"step {snap.step}" in out
    assert f"{snap.num_used_blocks} used" in out
    assert f"running {snap.num_running} · waiting {snap.num_waiting}" in out
    assert f"hit rate {snap.hits / snap.queries:.1%}" in out and snap.hits > 0
    # The first five blocks hold the shared 20-token prefix of every sequence: ref count 4.
    assert out.splitlines()[1].lstrip("│ ").startswith("44444")
    for table in view.state.block_tables.values():
        assert " ".join(map(str, table)) in out
    assert view.hit_blocks and all(n == 5 for n in list(view.hit_blocks.values())[1:])


def test_live_view_streams_text_tail():
    eng = dry_engine()
    view = LiveView(eng.num_blocks, 4, console=console(), show_text=True)
    view.attach(eng.events)
    seq = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    eng.step()
    view.set_text(seq, "line one\nline two\nthe last words")
    view.update()
    out = text_of(view.render())
    assert f"seq {seq}" in out and "the last words" in out


def test_live_view_draws_at_a_bounded_rate_and_leaves_the_last_frame():
    eng = dry_engine()
    con = console()
    view = LiveView(eng.num_blocks, 4, console=con, max_fps=1e-6)  # one frame per ~11 days
    view.attach(eng.events)
    with view:
        drive_shared_prefix(eng, view, n=3)
        while eng.has_unfinished_requests():
            eng.step()
            view.tick()
    assert eng.num_steps >= 10
    assert view.frames == 2  # the opening frame, and the final one on exit
    out = con.export_text()
    assert f"step {eng.num_steps - 1}" in out  # the final frame shows the last step
    assert "done 3" in out
    # ... and the run's rate: every token the steps computed, not the last seconds' none.
    final = out.split("done · ")[-1].splitlines()[0]
    assert final.startswith(f"{view.tokens_total:,} tokens in ") and view.tokens_total > 0
    assert "step · 0 tokens/s" not in out.split("done 3")[-1]


def test_live_view_in_a_terminal_restores_the_cursor():
    eng = dry_engine()
    buf = io.StringIO()
    con = Console(file=buf, width=80, height=30, force_terminal=True, color_system="256")
    view = LiveView(eng.num_blocks, 4, console=con)
    view.attach(eng.events)
    with view:
        drive_shared_prefix(eng, view, n=2)
    out = buf.getvalue()
    assert "\x1b[?25l" in out and out.rstrip().endswith("\x1b[?25h")  # cursor hidden, then shown


REPORT = {
    "requests": 10,
    "requests_added": 10,
    "prompt_tokens": 1000,
    "output_tokens": 200,
    "cache_hits": 250,
    "hit_rate": 0.25,
    "cache_queries": 1000,
    "shared_hit_tokens": 150,
    "revived_hit_tokens": 100,
    "readmission_queries": 100,
    "readmission_hits": 40,
    "miss_tokens": {"preempted": 60, "last-block": 50, "partial": 200, "cold": 500},
    "computed_prompt_tokens": 810,
    "evictions": 7,
    "preemptions": 2,
    "peak_used_blocks": 40,
    "num_blocks": 64,
    "steps": 30,
    "duration_s": 2.0,
    "output_throughput": 100.0,
    "total_token_throughput": 600.0,
    "request_throughput": 5.0,
    "ttft_s": {"mean": 0.1, "p50": 0.05, "p90": 0.2, "p99": 0.3},
    "itl_s": {"mean": 0.01, "p50": 0.01, "p90": 0.02, "p99": 0.03},
}


def test_summary_table_shows_every_headline_number():
    out = text_of(summary_table(REPORT))
    for needle in (
        "25.0%",
        "250 of 1,000 prompt tokens",
        "60% / 40%",
        "missed tokens",
        "810",
        "re-admissions",
        "40.0%",
        "evictions",
        "7",
        "40",
        "of 64",
        "100.0 tok/s",
        "50.0 ms",
        "p99 30.0 ms",
        "10.0 ms",
    ):
        assert needle in out, needle
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if line.strip()}
    assert rows["preempted"] == ["60", "7%"] and rows["cold"] == ["500", "62%"]
    assert rows["last-block"] == ["50", "6%"] and rows["partial"] == ["200", "25%"]


def test_every_latency_figure_is_labelled_and_aborted_streams_count():
    report = {
        **REPORT,
        "requests_aborted": 3,
        "output_tokens_aborted": 57,
        "e2e_latency_s": {"mean": 1.5, "p50": 1.0, "p90": 2.0, "p99": 3.0},
    }
    lines = text_of(summary_table(report)).splitlines()
    for label, figures in (
        ("time to first token", ("p50 50.0 ms", "mean 100.0 ms", "p90 200.0 ms", "p99 300.0 ms")),
        ("inter-token latency", ("p50 10.0 ms", "mean 10.0 ms", "p90 20.0 ms", "p99 30.0 ms")),
        ("request latency", ("p50 1,000.0 ms", "mean 1,500.0 ms", "p99 3,000.0 ms")),
    ):
        [line] = [x for x in lines if x.startswith(label)]
        for figure in figures:
            assert figure in line, (figure, line)
    assert any("of 10 added, 3 aborted" in x for x in lines)
    assert any(x.startswith("output tokens") and "57 of them for aborted" in x for x in lines)


def test_comparison_table_and_chart_mark_the_bound():
    reports = [
        {
            **REPORT,
            "block_size": 16,
            "num_blocks": 100,
            "hit_rate": 0.2,
            "infinite_cache_hit_rate": 0.5,
            "rejected": 0,
        },
        {
            **REPORT,
            "block_size": 64,
            "num_blocks": 1000,
            "hit_rate": 0.4,
            "infinite_cache_hit_rate": 0.5,
            "rejected": 3,
        },
    ]
    table = text_of(comparison_table(reports))
    assert "20.0%" in table and "40.0%" in table and "rejected" in table
    chart = hit_rate_chart(reports, console_width=80).plain.splitlines()
    bars = [line for line in chart if line.lstrip().startswith("bs")]
    assert len(bars) == 2
    first = bars[0]
    bar = first[first.index(" ", first.index("×") + 2) + 1 :]
    width = bar.index(" ")
    assert bar[: round(0.2 * width)] == "█" * round(0.2 * width)
    assert bar.index("│") == round(0.5 * width)
    assert "20.0% / 50.0%" in first


def test_inspect_views_render_a_state_and_a_prompt_map():
    state = state_with_every_kind()
    info = describe_state(state, 2, decode=lambda ids: "tok" + "-".join(map(str, ids)))
    header = {"num_blocks": 8, "block_size": 2, "model": None}
    out = text_of(render_trace_state(header, state, info, 80))
    assert "3█▒·····" in out
    assert "tok1-2" in out and f"{111:016x}" in out and "shared" in out
    prompt_info = map_prompt_blocks([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 9]], 2)
    out = text_of(
        render_prompt_map(
            prompt_info,
            ["a", "b", "c"],
            100,
            lambda ids: "T" + str(ids[0]),
            [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 9]],
        )
    )
    assert "3 prompts on 2-token blocks" in out
    assert "Shared blocks" in out and "T1" in out and "0,1" in out


@pytest.mark.parametrize("match", ["block", "token"])
def test_live_view_counters_match_the_block_managers_stats_in_a_terminal(match):
    """A real engine run drawn into a terminal: the final frame's hit rate, re-admissions and
    miss reasons are the BlockManager's own numbers, and at every step the view's books (which
    it applies event by event) equal what ``CacheState.apply_all`` makes of the same events."""
    import re

    from nanokv_cli.engine.core.cache_stats import MISS_REASONS
    from nanokv_cli.engine.core.events import CacheLookup
    from nanokv_cli.run.loop import dry_run_engine

    eng, _ = dry_run_engine(EngineConfig(block_size=4, num_blocks=24, prefix_match=match))
    buf = io.StringIO()
    con = Console(file=buf, width=160, height=60, force_terminal=True, color_system="256")
    view = LiveView(eng.num_blocks, 4, console=con)
    ref = CacheState(eng.num_blocks)
    lookups: dict[int, CacheLookup] = {}
    eng.events.subscribe(ref.apply)
    view.attach(eng.events)
    eng.events.subscribe(lambda e: lookups.update({e.seq_id: e}) if type(e) is CacheLookup else 0)
    prefix = list(range(100, 116))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    waves = [
        [prefix + [1, 2, 3]],  # cold
        [prefix + [1, 2, 3], prefix[:14] + [7, 8, 9], prefix + [5]],  # last-block, partial
        [prefix + [6, 6]],  # revived: the prefix sits in the free queue
        [[1000 + 10 * i + j for j in range(15)] for i in range(4)],  # preemption, evictions
        [prefix + [4, 4, 4, 4, 4]],  # evicted
    ]

    def step() -> None:
        eng.step()
        view.tick()
        assert view.state.ref_count == ref.ref_count
        assert view.state.block_hash == ref.block_hash
        assert view.state.block_tables == ref.block_tables
        # The sequence table's hit column: hit blocks at each holder's current admission.
        assert view.hit_blocks.keys() >= ref.block_tables.keys()
        for seq_id in ref.block_tables:
            assert view.hit_blocks[seq_id] == lookups[seq_id].num_hit_tokens // 4

    with view:
        for i, wave in enumerate(waves):
            for prompt in wave:
                eng.add_request(prompt, params)
            for _ in range(20 if i == 1 else 3):
                step()
        while eng.has_unfinished_requests():
            step()

    stats = eng.block_manager.stats
    misses = {r: n for r, n in stats.miss_tokens.items() if n}
    assert stats.revived_hits and stats.shared_hits and stats.readmission_queries
    if match == "block":
        assert {"cold", "partial", "last-block", "evicted", "preempted"} <= misses.keys()
    else:  # the tokens "partial" and "last-block" name are copied instead
        assert stats.copied_hits and {"cold", "last-token", "preempted"} <= misses.keys()
    # The final frame: the last of each line the terminal was sent, escape codes stripped.
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", buf.getvalue()).splitlines()
    cache_line = [line for line in lines if line.startswith("cache   ")][-1]
    miss_line = [line for line in lines if line.startswith("misses  ")][-1]
    evictions_line = [line for line in lines if "evictions" in line][-1]

    q = stats.queries
    assert cache_line.startswith(f"cache   hit rate {stats.hit_rate:.1%} ")
    assert (
        f"(shared {stats.shared_hits / q:.1%} · revived {stats.revived_hits / q:.1%}"
        f" · copied {stats.copied_hits / q:.1%} of {q:,} tokens looked up)"
    ) in cache_line
    assert (
        f"preemptions {stats.preemptions:,} · re-admissions: "
        f"{stats.readmission_hits:,} of {stats.readmission_queries:,} tokens hit"
    ) in evictions_line
    shown = re.findall(r"([a-z-]+) ([\d,]+) \((\d+)%\)", miss_line)
    assert [r for r, _, _ in shown] == [r for r in MISS_REASONS if r in misses]
    assert {r: int(n.replace(",", "")) for r, n, _ in shown} == misses
    total = sum(misses.values())
    assert total == stats.queries - stats.hits + stats.readmission_queries - stats.readmission_hits
    assert miss_line.rstrip() == "misses  " + " · ".join(
        f"{r} {misses[r]:,} ({misses[r] / total:.0%})" for r, _, _ in shown
    )
