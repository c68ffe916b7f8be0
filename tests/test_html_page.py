"""The HTML pages of ``advise --html`` and ``replay --dry-run --html`` (views/html_page.py),
opened in a real headless Chromium with the network off: the charts must draw from the
page alone, with no script error and no request out, and the page's numbers must be the
input's."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plotly.offline import get_plotlyjs
from support.browser import Dom, Loaded, Node, console_errors, embedded, load

from nanokv_cli.views.html_page import DATA_ID, advise_page, replay_page

# ---- inputs ----


def pct(x: float) -> str:
    return f"{x * 100:.1f}%"


KV_BYTES_PER_TOKEN = 12_288  # 24 layers x K and V x 2 KV heads x 64 dims x 2 bytes
MISS_REASONS = ("cold", "evicted", "last-block")
FINDING_TEXTS = [
    (
        'System: You are a "helpful" assistant & <b>never</b> lie.\nToday is 2025-06-01.',
        'System: You are a "helpful" assistant & <b>never</b> lie.\nToday is 2025-06-02.',
    ),
    (
        '<tool name=\'search\'>{"q": "a < b && c > d"}</tool>',
        '<tool name=\'search\'>{"q": "a < b && c > d", "id": 7}</tool>',
    ),
    ("</script><script>alert('x')</script> & friends", "</pre><pre>&amp; friends</pre>"),
]


def capacity_points() -> list[dict]:
    rates = [0.08, 0.19, 0.33, 0.47, 0.58, 0.66, 0.71, 0.733, 0.7412]
    return [
        {
            "cache_tokens": 1024 * 2**k,
            "cache_gib": 1024 * 2**k * KV_BYTES_PER_TOKEN / 2**30,
            "hit_rate": r,
            "ideal_speedup": 1 / (1 - r),
        }
        for k, r in enumerate(rates)
    ]


def chat_timeline(rng: random.Random) -> list[dict]:
    """24 chat turns: whole blocks hit, the rest cold; evictions once the cache fills."""
    timeline = []
    for i in range(24):
        prompt = rng.randrange(200, 3000)
        hit = 16 * rng.randrange(0, prompt // 16) if i else 0
        misses = {"cold": prompt - hit - 7, "evicted": 0, "last-block": 7}
        if i > 12:
            misses["evicted"] = min(misses["cold"], rng.randrange(0, 400))
            misses["cold"] -= misses["evicted"]
        label = f"chat-{i % 5} turn {i // 5}"
        timeline.append(
            {"request": i, "label": label, "prompt_tokens": prompt, "hit_tokens": hit,
             "misses": misses}
        )  # fmt: skip
    return timeline


FINDINGS = [  # kind, cause, fix, tokens lost, gain
    ("volatile-header", "the date in the system prompt changes daily",
     "move the date after the shared instructions", 18_432, 16_000),
    ("tool-id", "tool calls carry a fresh id", "drop the id from the prompt", 5_120, 4_096),
    ("eviction", "the cache holds 8k tokens; the workload reuses 40k", "give it more", 3_300,
     None),
]  # fmt: skip


def advise_report() -> dict:
    rng = random.Random(48)
    findings = [
        {"rank": n + 1, "kind": k, "cause": c, "fix": f, "tokens_lost": lost,
         "gain_tokens": gain, "left": left, "right": right}
        for n, ((k, c, f, lost, gain), (left, right)) in enumerate(zip(FINDINGS, FINDING_TEXTS))
    ]  # fmt: skip
    rows = [
        [b, c, "block", round(0.5 + 0.1 * math.log2(c / 4096) - 0.01 * b / 8, 4),
         rng.randrange(0, 900)]
        for b in (8, 16, 32)
        for c in (4096, 8192, 16384)
    ]  # fmt: skip
    return {
        "title": "nanokv advise — chat trace <2025-06> & friends",
        "settings": {
            "model": "Qwen2.5-0.5B-Instruct (Q8_0)",
            "block_size": 16,
            "num_blocks": 512,
            "cache_tokens": 8192,
            "match": "block",
        },
        "capacity_curve": {"points": capacity_points(), "ceiling": 0.8125, "current_tokens": 8192},
        "timeline": chat_timeline(rng),
        "findings": findings,
        "grid": {
            "columns": ["block_size", "cache_tokens", "prefix_match", "hit_rate", "evictions"],
            "rows": rows,
        },
    }


def replay_grid() -> dict:
    rows = [
        [b, n, b * n, h, e]
        for (b, n, h, e) in [
            (8, 1024, 0.6731, 12),
            (16, 512, 0.6612, 40),
            (32, 256, 0.6204, 77),
            (16, 1024, 0.7003, 0),
            (16, 256, 0.4125, 310),
            (64, 128, 0.5, 2),
        ]
    ]
    return {
        "title": "replay --dry-run: block size × cache size",
        "columns": ["block_size", "num_blocks", "cache_tokens", "hit_rate", "evictions"],
        "rows": rows,
        "notes": ["cache sizes are in tokens & blocks", 'a "cold" miss < 1 block is free'],
    }


@pytest.fixture(scope="module")
def report() -> dict:
    return advise_report()


@pytest.fixture(scope="module")
def advise_loaded(report, tmp_path_factory) -> Loaded:
    work = tmp_path_factory.mktemp("advise-page")
    page = work / "advise.html"
    page.write_text(advise_page(report), encoding="utf-8")
    return load(page, work)


@pytest.fixture(scope="module")
def replay_loaded(tmp_path_factory) -> Loaded:
    work = tmp_path_factory.mktemp("replay-page")
    page = work / "replay.html"
    page.write_text(replay_page(replay_grid()), encoding="utf-8")
    return load(page, work)


def points_of(dom: Dom, trace: Node) -> list[Node]:
    return dom.find(trace, cls="point")


# ---- the advise page ----


def test_advise_charts_draw_offline(advise_loaded, report):
    dom = advise_loaded.dom
    for chart in ("capacity-chart", "timeline-hit-chart", "timeline-miss-chart", "grid-heatmap"):
        assert dom.find(dom.by_id(chart), tag="svg", cls="main-svg"), f"{chart} drew no SVG"
    curve = dom.find(dom.by_id("capacity-chart"), cls="tracecapacity-curve")
    assert len(curve) == 1
    assert len(points_of(dom, curve[0])) == len(report["capacity_curve"]["points"])
    today = dom.find(dom.by_id("capacity-chart"), cls="tracecapacity-today-point")
    assert len(today) == 1 and len(points_of(dom, today[0])) == 1
    # Bars carry no trace id in the SVG: the hit-rate chart's one bar trace, and the miss
    # chart's one per reason, in the order the reasons first appear.
    hit_bars = dom.find(dom.by_id("timeline-hit-chart"), tag="g", cls="bars")
    assert [len(points_of(dom, t)) for t in hit_bars] == [len(report["timeline"])]
    miss_bars = dom.find(dom.by_id("timeline-miss-chart"), tag="g", cls="bars")
    assert [len(points_of(dom, t)) for t in miss_bars] == [len(report["timeline"])] * 3
    legend = [
        n.attrs.get("data-unformatted")
        for n in dom.find(dom.by_id("timeline-miss-chart"), tag="text", cls="legendtext")
    ]
    assert legend == list(reversed(MISS_REASONS))  # plotly lists a stack top first
    # The heatmap writes each cell's text into the SVG: one per (block, cache), the input's.
    labels = dom.find(dom.by_id("grid-heatmap"), tag="text")
    cells = sorted(
        n.attrs["data-unformatted"]
        for n in labels
        if n.parent is not None and "heatmap-label" in n.parent.classes()
    )
    assert cells == sorted(pct(r[3]) for r in report["grid"]["rows"])


def test_advise_page_logs_no_error_and_asks_no_network(advise_loaded):
    # Nothing at all on the console: console.error() is logged at the level of console.log()
    # here, so only silence proves there was no error.
    assert advise_loaded.console == []
    assert advise_loaded.requests == []


def test_advise_texts_are_escaped(advise_loaded, report):
    dom = advise_loaded.dom
    sides = dom.find(tag="pre")
    shown = [("".join(p.text), p.attrs["data-side"]) for p in sides]
    wanted = [(f[side], side) for f in report["findings"] for side in ("left", "right")]
    assert shown == wanted
    # Markup in the data stays text: nothing was parsed into elements inside the texts.
    assert all(not dom.find(p) for p in sides)
    assert "".join(dom.find(tag="title")[0].text) == report["title"]
    assert [
        n
        for n in dom.nodes
        if n.tag == "script" and "alert(" in "".join(n.text) and n.attrs.get("id") != DATA_ID
    ] == []


def test_advise_numbers_are_the_inputs(advise_loaded, report):
    dom = advise_loaded.dom
    assert embedded(dom) == report
    rows = dom.find(dom.by_id("capacity-table"), tag="tr")[1:]
    points = report["capacity_curve"]["points"]
    assert len(rows) == len(points)
    for row, p in zip(rows, points):
        assert float(row.attrs["data-hit-rate"]) == p["hit_rate"]
        assert int(row.attrs["data-cache-tokens"]) == p["cache_tokens"]
        assert float(row.attrs["data-cache-gib"]) == p["cache_gib"]
        cells = ["".join(c.text) for c in dom.find(row, tag="td")]
        assert cells[0] == f"{p['cache_tokens']:,}"
        assert cells[2] == pct(p["hit_rate"])
        assert cells[3] == f"{p['ideal_speedup']:.2f}×"
    grid = dom.by_id("grid-table")
    values = [json.loads(td.attrs["data-value"]) for td in dom.find(grid, tag="td")]
    assert values == [v for r in report["grid"]["rows"] for v in r]
    ranks = [int(li.attrs["data-rank"]) for li in dom.find(tag="li") if "data-rank" in li.attrs]
    assert ranks == [1, 2, 3]


def test_page_is_one_self_contained_file(report, tmp_path):
    page = advise_page(report)
    (tmp_path / "advise.html").write_text(page, encoding="utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["advise.html"]
    bundle = get_plotlyjs()
    assert page.count(bundle) == 1  # plotly.js inlined, once
    # plotly.js's own source names a CDN for map and globe charts, which this page has none
    # of; everything else in the page must name no address at all.
    rest = page.replace(bundle, "")
    assert not re.search(r"https?://|//cdn|<link\b|<img\b|<iframe\b|@import|url\(", rest)
    assert not re.search(r"<script\b[^>]*\bsrc\s*=", page, re.IGNORECASE)


MARKUP = '$<b>evicted</b> & "x" <a href="https://example.com/">y</a> $5$'


def test_chart_text_from_the_data_is_escaped(tmp_path):
    """Plotly reads tags in its own strings (a <b> draws bold, an <a> draws a link, $...$ is
    LaTeX), so the data's text must reach the SVG as text."""
    report = {
        "timeline": [
            {
                "request": i,
                "label": MARKUP,
                "prompt_tokens": 100,
                "hit_tokens": 50,
                "misses": {MARKUP: 50},
            }
            for i in range(3)
        ],
        "grid": {
            "columns": ["block_size", "cache", "hit_rate"],
            "rows": [[16, MARKUP, 0.5], [16, "8k", 0.25]],
        },
    }
    page = tmp_path / "markup.html"
    page.write_text(advise_page(report), encoding="utf-8")
    loaded = load(page, tmp_path)
    dom = loaded.dom
    legend = dom.find(dom.by_id("timeline-miss-chart"), tag="text", cls="legendtext")
    assert ["".join(n.text) for n in legend] == [MARKUP]
    ticks = dom.find(dom.by_id("grid-heatmap"), tag="g", cls="xtick")
    assert sorted("".join(t.text) for t in ticks) == sorted([MARKUP, "8k"])
    for chart in ("timeline-miss-chart", "grid-heatmap"):
        drawn = dom.find(dom.by_id(chart), tag="a") + dom.find(dom.by_id(chart), tag="tspan")
        assert [n for n in drawn if "bold" in n.attrs.get("style", "") or n.tag == "a"] == []
    # Not even plotly's warning that MathJax is missing: "$...$" was not taken for math.
    assert loaded.console == [] and loaded.requests == []


# ---- the replay page ----


def test_replay_page_draws_offline(replay_loaded):
    grid = replay_grid()
    dom = replay_loaded.dom
    chart = dom.by_id("replay-bars")
    assert dom.find(chart, tag="svg", cls="main-svg")
    bars = dom.find(chart, tag="g", cls="bars")
    assert [len(points_of(dom, t)) for t in bars] == [len(grid["rows"])]
    texts = [n.attrs.get("data-unformatted") for n in dom.find(bars[0], tag="text")]
    assert texts == [pct(r[3]) for r in grid["rows"]]
    assert replay_loaded.console == []
    assert replay_loaded.requests == []


def test_replay_numbers_and_notes_are_the_inputs(replay_loaded):
    grid = replay_grid()
    dom = replay_loaded.dom
    assert embedded(dom) == grid
    table = dom.by_id("replay-table")
    cells = dom.find(table, tag="td")
    assert [json.loads(td.attrs["data-value"]) for td in cells] == [
        v for r in grid["rows"] for v in r
    ]
    hit = [td for td in cells if td.attrs["data-col"] == "hit_rate"]
    assert ["".join(td.text) for td in hit] == [pct(r[3]) for r in grid["rows"]]
    notes = ["".join(li.text) for li in dom.find(dom.by_id("notes-list"), tag="li")]
    assert notes == grid["notes"]


# ---- the checks check ----


@pytest.mark.parametrize(
    ("script", "error", "url"),
    [
        ('<script>throw new Error("boom")</script>', "Uncaught Error: boom", None),
        ("<script>let = = 3;</script>", "SyntaxError", None),
        ('<script>console.log("all fine")</script>', None, None),
        (
            '<script src="https://cdn.plot.ly/plotly-2.35.2.min.js"></script>',
            None,
            "https://cdn.plot.ly/plotly-2.35.2.min.js",
        ),
    ],
    ids=["throw", "syntax-error", "clean", "cdn-script"],
)
def test_the_browser_checks_see_errors_and_requests(tmp_path, script, error, url):
    page = tmp_path / "probe.html"
    page.write_text(f"<!DOCTYPE html><html><body><p>probe</p>{script}</body></html>")
    loaded = load(page, tmp_path)
    assert loaded.console or error is None or url is not None, "no console output at all"
    errors = console_errors(loaded.console)
    if error is None:
        assert errors == []
    else:
        assert len(errors) == 1 and error in errors[0], loaded.console
    assert loaded.requests == ([url] if url else [])
    if "all fine" in script:  # the console is captured at all, so silence above means it
        assert any('"all fine"' in m for m in loaded.console)


# ---- no browser ----

LEAF = st.none() | st.booleans() | st.integers(-2, 10**7) | st.floats() | st.text(max_size=8)
JSONISH = st.recursive(
    LEAF,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


def shaped(keys, **special):
    """A dict with some of the keys (random values, or the given strategy), or any value."""
    return st.fixed_dictionaries({}, optional={k: special.get(k, JSONISH) for k in keys}) | JSONISH


POINT = shaped(["cache_tokens", "cache_gib", "hit_rate", "ideal_speedup"])
REQUEST = shaped(
    ["request", "label", "prompt_tokens", "hit_tokens", "misses"],
    misses=st.dictionaries(st.text(max_size=5), LEAF, max_size=3) | LEAF,
)
FINDING = shaped(["rank", "kind", "cause", "fix", "tokens_lost", "gain_tokens", "left", "right"])
COLUMNS = st.lists(
    st.sampled_from(["block_size", "cache_tokens", "num_blocks", "hit_rate", "label", "x_rate"])
    | st.text(max_size=4),
    max_size=5,
)
GRID = shaped(
    ["columns", "rows", "title", "notes"],
    columns=COLUMNS,
    rows=st.lists(
        st.lists(LEAF, max_size=6)
        | st.dictionaries(
            st.sampled_from(["block_size", "cache_tokens", "hit_rate", "label"]), LEAF
        )
        | LEAF,
        max_size=5,
    ),
    notes=st.lists(LEAF, max_size=3) | LEAF,
)
REPORT = shaped(
    ["title", "settings", "capacity_curve", "timeline", "findings", "grid"],
    capacity_curve=shaped(
        ["points", "ceiling", "current_tokens"], points=st.lists(POINT, max_size=4) | LEAF
    ),
    timeline=st.lists(REQUEST, max_size=4) | LEAF,
    findings=st.lists(FINDING, max_size=3) | LEAF,
    grid=GRID,
)


@settings(max_examples=150, deadline=None)
@given(report=REPORT, grid=GRID)
def test_any_input_renders_without_error(report, grid):
    # Whatever --json grows into, or a hand-edited file, the page renders: a section it
    # cannot read says "not available". The data block holds the input, in strict JSON.
    for page in (advise_page(report), replay_page(grid)):
        assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
        json.loads(
            "".join(Dom(page.replace(get_plotlyjs(), "")).by_id(DATA_ID).text),
            parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"),
        )


def test_missing_sections_say_not_available():
    page = advise_page({})
    assert page.count("not available") == 5
    assert "Plotly.newPlot" not in page and len(page) < 20_000  # no chart, no plotly.js
    odd = advise_page(
        {
            "settings": [],
            "capacity_curve": {"points": []},
            "timeline": "x",
            "findings": None,
            "grid": {"columns": ["a"], "rows": [[1]]},
        }
    )
    assert odd.count("not available") == 5  # four sections and the grid's heatmap
    assert 'data-col="a"' in odd
    empty_replay = replay_page({})
    assert empty_replay.count("not available") == 2


def test_infinite_speedup_and_dict_rows():
    curve = {
        "points": [
            {"cache_tokens": 0, "cache_gib": 0.0, "hit_rate": 0.0, "ideal_speedup": 1.0},
            {"cache_tokens": 4096, "cache_gib": 0.05, "hit_rate": 1.0, "ideal_speedup": math.inf},
        ],
        "ceiling": 1.0,
        "current_tokens": 4096,
    }
    page = advise_page({"capacity_curve": curve})
    dom = Dom(page)
    cells = ["".join(td.text) for td in dom.find(dom.by_id("capacity-table"), tag="td")]
    assert cells == ["0", "0", "0.0%", "1.00×", "4,096", "0.05", "100.0%", "∞"]
    assert embedded(dom) == {"capacity_curve": curve}
    rows = replay_page(
        {
            "columns": ["label", "hit_rate"],
            "rows": [{"label": "a", "hit_rate": 0.25}, {"hit_rate": 0.5}],
        }
    )
    dom = Dom(rows)
    assert ["".join(td.text) for td in dom.find(tag="td")] == ["a", "25.0%", "—", "50.0%"]
