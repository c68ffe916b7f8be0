"""A self-contained HTML page for ``nanokv advise --html`` and ``replay --dry-run --html``.

Both renderers are pure functions over the plain dicts the commands print with ``--json``, so
the page shows exactly the JSON's numbers. The page needs no network: plotly.js is inlined
once (only when the page has a chart), every chart is drawn from data in the page, and all
text taken from the data is HTML-escaped. The input is also carried verbatim in
``<script type="application/json" id="nanokv-data">`` (strict JSON: a non-finite float is
written as the string "Infinity", "-Infinity" or "NaN"), and table cells carry their raw
value in ``data-value``, so a reader or a test can check the page against its input.

``advise_page(report)`` reads these keys; each is optional, and a missing or empty one leaves
its section as a one-line "not available":

- ``title``: str.
- ``settings``: ``{name: value}``, today's settings (block_size, num_blocks, cache_tokens,
  match mode, model, ...), shown as a two-column table in the dict's order.
- ``capacity_curve``: ``{"points": [{"cache_tokens": int, "cache_gib": float,
  "hit_rate": float in 0..1, "ideal_speedup": float (1 / (1 - hit_rate); inf or None
  shows as "∞")}], "ceiling": float (the token-level never-evicting bound's hit rate),
  "current_tokens": int (today's cache size)}``. Points are drawn in cache_tokens order on a
  log axis, so a point with cache_tokens <= 0 is only in the table.
- ``timeline``: ``[{"request": int, "label": str, "prompt_tokens": int, "hit_tokens": int,
  "misses": {reason: tokens}}]`` in arrival order.
- ``findings``: ``[{"rank": int, "kind": str, "cause": str, "fix": str,
  "tokens_lost": int, "gain_tokens": int | None, "left": str, "right": str}]``, listed by
  rank with ``left`` and ``right`` side by side.
- ``grid``: ``{"columns": [str], "rows": [[value, ...] | {column: value}]}``, a table; also
  a heatmap when the columns hold ``block_size``, a cache column (the first of cache_tokens,
  cache, num_blocks, cache_gib) and ``hit_rate``.

``replay_page(grid)`` reads ``{"title": str, "columns": [str], "rows": [...],
"notes": [str]}`` (rows as in ``grid`` above): the table, a bar chart of each row's hit_rate
when that column exists, and the notes.

A column named ``hit_rate`` or ending in ``_rate`` is shown as a percent with one decimal.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

DATA_ID = "nanokv-data"
CACHE_COLUMNS = ("cache_tokens", "cache", "num_blocks", "cache_gib")
# No plotly logo link: the page should hold no link out, and it is not ours to advertise.
_CHART_CONFIG = {"displaylogo": False, "responsive": True}

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1200px;
       padding: 0 16px; color: #1d1d1f; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; } td.num { text-align: right; }
th { background: #f4f4f6; text-align: left; }
.na { color: #777; font-style: italic; }
.sides { display: grid; grid-template-columns: 1fr 1fr; gap: 8px; }
.sides pre { font: 12px/1.35 ui-monospace, monospace; white-space: pre-wrap;
             word-break: break-word; background: #f7f7f9; border: 1px solid #e2e2e6;
             padding: 6px; margin: 0; max-height: 320px; overflow: auto; }
.findings li { margin-bottom: 18px; }
"""


# ---- formatting: every shown number comes from one of these, so page and JSON agree ----


def _number(x: Any) -> float | None:
    """A float for a number or a JSON spelling of one ("inf", "Infinity"), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int | float):
        return float(x)
    if isinstance(x, str) and x.strip().lower() in ("inf", "infinity", "+inf", "+infinity"):
        return math.inf
    return None


def _pct(x: Any) -> str:
    v = _number(x)
    return "—" if v is None or not math.isfinite(v) else f"{v * 100:.1f}%"


def _speedup(x: Any) -> str:
    # 1 / (1 - hit_rate) is infinite at a 100% hit rate; the JSON may carry that as inf,
    # "Infinity" or None (json has no inf), and all of them mean the same.
    v = _number(x)
    if x is None or (v is not None and math.isinf(v)):
        return "∞"
    return "—" if v is None or math.isnan(v) else f"{v:.2f}×"


def _plain(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool) or not isinstance(x, int | float):
        return x if isinstance(x, str) else json.dumps(x, default=str)
    if isinstance(x, int) or (x.is_integer() and abs(x) < 1e15):
        return f"{int(x):,}"  # 8192.0 reads as 8,192, not 8192 or 8.192e+03
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    return "—" if math.isnan(x) else f"{x:,.4g}"


def _cell_text(column: str, x: Any) -> str:
    is_rate = column == "hit_rate" or column.endswith("_rate")
    return _pct(x) if is_rate and _number(x) is not None else _plain(x)


def _esc(x: Any) -> str:
    return html.escape(x if isinstance(x, str) else _plain(x), quote=True)


def _ptext(x: Any) -> str:
    """Text for plotly to draw. Plotly reads tags in its strings (a <b> turns bold, an <a>
    becomes a link), so text from the data is escaped for it as for the page; and a string
    between two "$" is LaTeX to it (MathJax, which the page lacks), so "$" goes as &#36;."""
    text = html.escape(x if isinstance(x, str) else _plain(x), quote=False)
    return text.replace("$", "&#36;")


def _strict(x: Any) -> Any:
    """The data with non-finite floats as strings, so the embedded block is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {str(k): _strict(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_strict(v) for v in x]
    return x


def _raw(x: Any) -> str:
    """A value as its JSON text, for data-* attributes (float() reads it back exactly)."""
    return html.escape(json.dumps(_strict(x), default=str), quote=True)


def _data_block(data: Any) -> str:
    text = json.dumps(_strict(data), default=str, ensure_ascii=False)
    # "</script>" inside the data would end the block early; these escapes are plain JSON.
    text = text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    return f'<script type="application/json" id="{DATA_ID}">{text}</script>'


# ---- page scaffolding ----


class _Page:
    """Collects sections; knows whether any chart was drawn, so plotly.js goes in once or not
    at all (a page with no chart stays a few kB instead of ~5 MB)."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.parts: list[str] = []
        self.charts = 0

    def section(self, heading: str, anchor: str, body: str) -> None:
        self.parts.append(
            f'<section id="{anchor}"><h2>{html.escape(heading)}</h2>\n{body}\n</section>'
        )

    def chart(self, fig: go.Figure, div_id: str, height: int = 420) -> str:
        self.charts += 1
        fig.update_layout(height=height, margin={"l": 60, "r": 20, "t": 40, "b": 60})
        return pio.to_html(
            fig,
            full_html=False,
            include_plotlyjs=False,
            div_id=div_id,
            config=_CHART_CONFIG,
            default_height=f"{height}px",
        )

    def document(self, data: Any) -> str:
        script = f"<script>{get_plotlyjs()}</script>" if self.charts else ""
        body = "\n".join(self.parts)
        return (
            '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{html.escape(self.title)}</title>\n<style>{_CSS}</style>\n{script}\n"
            f"</head>\n<body>\n<h1>{html.escape(self.title)}</h1>\n{body}\n"
            f"{_data_block(data)}\n</body>\n</html>\n"
        )


def _missing(what: str) -> str:
    return f'<p class="na">{html.escape(what)}: not available.</p>'


def _rows_as_lists(columns: list[str], rows: Any) -> list[list[Any]]:
    """Rows as lists as long as the columns: they may come as lists (the documented shape)
    or as dicts keyed by column, and a short row is padded rather than shifting cells."""
    out = []
    for r in rows if isinstance(rows, list) else []:
        if isinstance(r, dict):
            out.append([r.get(c) for c in columns])
        else:
            cells = list(r) if isinstance(r, list | tuple) else [r]
            out.append((cells + [None] * len(columns))[: len(columns)])
    return out


def _table(columns: list[str], rows: list[list[Any]], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for col, value in zip(columns, row):
            cls = ' class="num"' if _number(value) is not None else ""
            cells.append(
                f'<td{cls} data-col="{html.escape(str(col), quote=True)}" '
                f'data-value="{_raw(value)}">{html.escape(_cell_text(str(col), value))}</td>'
            )
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<table id="{table_id}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )


# ---- advise ----


def advise_page(report: dict) -> str:
    """The whole HTML document for ``nanokv advise --html`` (shapes: the module docstring)."""
    report = report if isinstance(report, dict) else {}
    page = _Page(str(report.get("title") or "nanokv advise"))
    page.section("Settings", "settings", _settings(report.get("settings")))
    page.section(
        "Hit rate by cache size", "capacity", _capacity(page, report.get("capacity_curve"))
    )
    page.section("Requests over time", "timeline", _timeline(page, report.get("timeline")))
    page.section("Findings", "findings", _findings(report.get("findings")))
    page.section("Block size × cache size", "grid", _grid(page, report.get("grid")))
    return page.document(report)


def _settings(settings: Any) -> str:
    if not isinstance(settings, dict) or not settings:
        return _missing("Settings")
    rows = [[k, v] for k, v in settings.items()]
    return _table(["setting", "value"], rows, "settings-table")


def _capacity(page: _Page, curve: Any) -> str:
    points = curve.get("points") if isinstance(curve, dict) else None
    points = [p for p in points if isinstance(p, dict)] if isinstance(points, list) else []
    if not points:
        return _missing("Capacity curve")
    points = sorted(points, key=lambda p: _sort_key(p.get("cache_tokens")))
    ceiling, current = curve.get("ceiling"), curve.get("current_tokens")
    words = []
    if _number(ceiling) is not None:
        words.append(f"Ceiling (token-level, never evicting): {_pct(ceiling)}.")
    if _number(current) is not None:
        words.append(f"Today: {_plain(current)} tokens of cache.")
    fig = _capacity_figure(points, ceiling, current)
    chart = page.chart(fig, "capacity-chart") if fig is not None else _missing("Chart")
    rows = [
        f'<tr data-cache-tokens="{_raw(p.get("cache_tokens"))}" '
        f'data-cache-gib="{_raw(p.get("cache_gib"))}" data-hit-rate="{_raw(p.get("hit_rate"))}" '
        f'data-ideal-speedup="{_raw(p.get("ideal_speedup"))}">'
        f'<td class="num">{_esc(p.get("cache_tokens"))}</td>'
        f'<td class="num">{_esc(p.get("cache_gib"))}</td>'
        f'<td class="num">{html.escape(_pct(p.get("hit_rate")))}</td>'
        f'<td class="num">{html.escape(_speedup(p.get("ideal_speedup")))}</td></tr>'
        for p in points
    ]
    table = (
        '<table id="capacity-table"><thead><tr><th>cache tokens</th><th>cache GiB</th>'
        "<th>hit rate</th><th>ideal speedup</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )
    return f"<p>{html.escape(' '.join(words))}</p>\n{chart}\n{table}"


def _capacity_figure(points: list[dict], ceiling: Any, current: Any) -> go.Figure | None:
    # A log axis cannot place 0 tokens (nor inf); such a point stays in the table only.
    drawn = [p for p in points if 0 < (_number(p.get("cache_tokens")) or 0) < math.inf]
    if not drawn:
        return None
    xs = [_number(p["cache_tokens"]) for p in drawn]
    ys = [_number(p.get("hit_rate")) for p in drawn]
    gib = [_ptext(p.get("cache_gib")) for p in drawn]
    hover = [
        f"{_ptext(x)} tokens ({g} GiB)<br>hit rate {_pct(y)}<br>ideal speedup "
        f"{_speedup(p.get('ideal_speedup'))}"
        for x, g, y, p in zip(xs, gib, ys, drawn)
    ]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys,
            mode="lines+markers",
            name="hit rate",
            uid="capacity-curve",
            hovertext=hover,
            hoverinfo="text",
        )
    )
    # The ceiling and today's line are traces, not shapes or annotations: on a log axis
    # annotations want log10 coordinates, and a trace also gets a legend entry for free.
    if _number(ceiling) is not None:
        fig.add_trace(
            go.Scatter(
                x=[min(xs), max(xs)],
                y=[_number(ceiling)] * 2,
                mode="lines",
                name=f"ceiling {_pct(ceiling)}",
                uid="capacity-ceiling",
                line={"dash": "dash", "color": "#888"},
                hoverinfo="name",
            )
        )
    _mark_today(fig, xs, ys, _number(current))
    ticks = [f"{_ptext(x)}<br>{g} GiB" for x, g in zip(xs, gib)]
    fig.update_xaxes(
        type="log", title="cache size (tokens; GiB below)", tickvals=xs, ticktext=ticks
    )
    fig.update_yaxes(title="hit rate", tickformat=".0%", range=[0, 1.05])
    return fig


def _mark_today(fig: go.Figure, xs: list, ys: list, current: float | None) -> None:
    """Today's cache size as a vertical line; a star on the curve when it is one of its points."""
    if current is None or not 0 < current < math.inf:
        return
    fig.add_trace(go.Scatter(
        x=[current, current], y=[0, 1], mode="lines", name=f"today: {_ptext(current)} tokens",
        uid="capacity-today", line={"dash": "dot", "color": "#d62728"}, hoverinfo="name",
    ))  # fmt: skip
    at = [y for x, y in zip(xs, ys) if x == current]
    if at:
        fig.add_trace(go.Scatter(
            x=[current], y=at[:1], mode="markers", name="today's hit rate",
            uid="capacity-today-point", hovertext=[f"today: {_pct(at[0])}"], hoverinfo="text",
            marker={"size": 14, "symbol": "star", "color": "#d62728"},
        ))  # fmt: skip


def _timeline(page: _Page, timeline: Any) -> str:
    reqs = [r for r in timeline if isinstance(r, dict)] if isinstance(timeline, list) else []
    if not reqs:
        return _missing("Timeline")
    xs = [r.get("request") for r in reqs]
    labels = [_ptext(r.get("label") or r.get("request")) for r in reqs]
    rates = [_hit_rate(r) for r in reqs]
    # The running rate weighs requests by prompt tokens, as the engine's hit rate does.
    hit = total = 0
    running = []
    for r in reqs:
        hit += _number(r.get("hit_tokens")) or 0
        total += _number(r.get("prompt_tokens")) or 0
        running.append(hit / total if total else None)
    rate_fig = go.Figure()
    rate_fig.add_trace(
        go.Bar(
            x=xs,
            y=rates,
            name="this request",
            uid="timeline-hit-rate",
            hovertext=[f"{lb}: {_pct(v)}" for lb, v in zip(labels, rates)],
            hoverinfo="text",
        )
    )
    rate_fig.add_trace(
        go.Scatter(
            x=xs, y=running, mode="lines", name="so far", uid="timeline-running", hoverinfo="y"
        )
    )
    rate_fig.update_xaxes(title="request (arrival order)")
    rate_fig.update_yaxes(title="hit rate", tickformat=".0%", range=[0, 1.05])
    parts = [page.chart(rate_fig, "timeline-hit-chart", 360)]
    reasons: list[str] = []
    for r in reqs:
        for reason in _misses(r):
            if reason not in reasons:
                reasons.append(reason)
    if reasons:
        miss_fig = go.Figure()
        for i, reason in enumerate(reasons):
            ys = [_misses(r).get(reason, 0) for r in reqs]
            miss_fig.add_trace(
                go.Bar(x=xs, y=ys, name=_ptext(reason), uid=f"timeline-miss-{i}", hovertext=labels)
            )
        # Plotly drops the legend of a one-trace chart; here it names the only reason.
        miss_fig.update_layout(barmode="stack", showlegend=True)
        miss_fig.update_xaxes(title="request (arrival order)")
        miss_fig.update_yaxes(title="missed tokens")
        parts.append(page.chart(miss_fig, "timeline-miss-chart", 360))
    else:
        parts.append(_missing("Miss reasons"))
    parts.append(_timeline_table(reqs, reasons, rates))
    return "\n".join(parts)


def _misses(r: dict) -> dict:
    misses = r.get("misses")
    return misses if isinstance(misses, dict) else {}


def _hit_rate(r: dict) -> float | None:
    prompt, hits = _number(r.get("prompt_tokens")), _number(r.get("hit_tokens"))
    return hits / prompt if prompt and hits is not None else None


def _timeline_table(reqs: list[dict], reasons: list[str], rates: list[float | None]) -> str:
    columns = ["request", "label", "prompt_tokens", "hit_tokens", "hit_rate", *reasons]
    rows = [
        [r.get("request"), r.get("label"), r.get("prompt_tokens"), r.get("hit_tokens"), rate]
        + [_misses(r).get(m, 0) for m in reasons]
        for r, rate in zip(reqs, rates)
    ]
    # Folded: twenty-odd rows would push the findings off the first screen.
    return (
        f"<details><summary>Every request ({len(rows)})</summary>"
        f"{_table(columns, rows, 'timeline-table')}</details>"
    )


def _findings(findings: Any) -> str:
    if not isinstance(findings, list) or not findings:
        return _missing("Findings")
    items = []
    ranked = sorted(
        (f for f in findings if isinstance(f, dict)),
        key=lambda f: (_number(f.get("rank")) is None, _number(f.get("rank")) or 0),
    )
    for f in ranked:
        gain = f.get("gain_tokens")
        gain_text = "—" if gain is None else f"{_plain(gain)} tokens"
        items.append(
            f'<li data-rank="{_raw(f.get("rank"))}" '
            f'data-tokens-lost="{_raw(f.get("tokens_lost"))}" '
            f'data-gain-tokens="{_raw(gain)}">'
            f"<p><b>#{_esc(f.get('rank'))} {_esc(f.get('kind'))}</b>: {_esc(f.get('cause'))}</p>"
            f"<p>Fix: {_esc(f.get('fix'))}</p>"
            f"<p>Tokens lost: {_esc(f.get('tokens_lost'))}; expected gain: "
            f"{html.escape(gain_text)}</p>"
            f'<div class="sides"><pre data-side="left">{_esc(f.get("left") or "")}</pre>'
            f'<pre data-side="right">{_esc(f.get("right") or "")}</pre></div></li>'
        )
    return f'<ol class="findings">{"".join(items)}</ol>'


def _grid(page: _Page, grid: Any) -> str:
    columns = grid.get("columns") if isinstance(grid, dict) else None
    rows = grid.get("rows") if isinstance(grid, dict) else None
    if not isinstance(columns, list) or not columns or not rows:
        return _missing("Grid")
    columns = [str(c) for c in columns]
    rows = _rows_as_lists(columns, rows)
    fig = _heatmap(columns, rows)
    chart = (
        page.chart(fig, "grid-heatmap", 400)
        if fig is not None
        else _missing("Heatmap (needs block_size, a cache column and hit_rate)")
    )
    return f"{chart}\n{_table(columns, rows, 'grid-table')}"


def _heatmap(columns: list[str], rows: list[list[Any]]) -> go.Figure | None:
    cache_col = next((c for c in CACHE_COLUMNS if c in columns), None)
    if "block_size" not in columns or "hit_rate" not in columns or cache_col is None:
        return None
    b, c, h = columns.index("block_size"), columns.index(cache_col), columns.index("hit_rate")
    # Cells are keyed by the shown text, not the value: NaN never equals itself, and a list
    # cannot key a dict, yet both must land somewhere without an error.
    blocks: dict[str, Any] = {}
    caches: dict[str, Any] = {}
    cells: dict[tuple[str, str], float | None] = {}
    for r in rows:
        bk, ck = _plain(r[b]), _plain(r[c])
        blocks.setdefault(bk, r[b])
        caches.setdefault(ck, r[c])
        # The first row of a (block, cache) pair wins; others (another match mode, say)
        # are in the table below.
        cells.setdefault((bk, ck), _number(r[h]))
    ys = sorted(blocks, key=lambda k: _sort_key(blocks[k]))
    xs = sorted(caches, key=lambda k: _sort_key(caches[k]))
    z = [[cells.get((y, x)) for x in xs] for y in ys]
    text = [[_pct(v) if v is not None else "" for v in row] for row in z]
    fig = go.Figure(
        go.Heatmap(
            x=[_ptext(v) for v in xs],
            y=[_ptext(v) for v in ys],
            z=z,
            text=text,
            texttemplate="%{text}",
            zmin=0,
            zmax=1,
            colorscale="Viridis",
            uid="grid-heatmap",
            colorbar={"title": "hit rate", "tickformat": ".0%"},
            hovertemplate="block %{y}, cache %{x}: %{text}<extra></extra>",
        )
    )
    # Categories, not numbers: the grid's sizes are few and uneven, and every one gets a cell.
    fig.update_xaxes(type="category", title=cache_col)
    fig.update_yaxes(type="category", title="block_size")
    return fig


def _sort_key(v: Any) -> tuple[int, float, str]:
    # Numbers first, in order (NaN last of them, where sorted() would leave it anywhere),
    # then everything else by its text.
    n = _number(v)
    if n is None or math.isnan(n):
        return (1 if n is None else 0, math.inf, _plain(v))
    return (0, n, "")


# ---- replay --dry-run ----


def replay_page(grid: dict) -> str:
    """The whole HTML document for ``nanokv replay --dry-run --html``: a comparison grid."""
    grid = grid if isinstance(grid, dict) else {}
    page = _Page(str(grid.get("title") or "nanokv replay --dry-run"))
    columns, rows = grid.get("columns"), grid.get("rows")
    if isinstance(columns, list) and columns and rows:
        columns = [str(c) for c in columns]
        rows = _rows_as_lists(columns, rows)
        fig = _replay_bars(columns, rows)
        chart = (
            page.chart(fig, "replay-bars", 400)
            if fig is not None
            else _missing("Chart (needs a hit_rate column)")
        )
        page.section("Runs", "runs", f"{chart}\n{_table(columns, rows, 'replay-table')}")
    else:
        page.section("Runs", "runs", _missing("Grid"))
    notes = grid.get("notes")
    if isinstance(notes, list) and notes:
        items = "".join(f"<li>{_esc(n)}</li>" for n in notes)
        page.section("Notes", "notes", f'<ul id="notes-list">{items}</ul>')
    else:
        page.section("Notes", "notes", _missing("Notes"))
    return page.document(grid)


def _replay_bars(columns: list[str], rows: list[list[Any]]) -> go.Figure | None:
    if "hit_rate" not in columns:
        return None
    h = columns.index("hit_rate")
    named = next((c for c in ("label", "name", "run") if c in columns), None)
    if named is not None:
        labels = [_ptext(r[columns.index(named)]) for r in rows]
    else:
        # No name column: a row is named by its settings, the columns that are not rates.
        keys = [i for i, c in enumerate(columns) if i != h and not c.endswith("_rate")][:3]
        # One setting a line: side by side they push the plot into a sliver.
        labels = ["<br>".join(f"{_ptext(columns[i])} {_ptext(r[i])}" for i in keys) for r in rows]
    # Plotly merges bars with equal category names; a row number keeps every row its own bar.
    labels = [f"#{i + 1}<br>{lb}" for i, lb in enumerate(labels)]
    ys = [_number(r[h]) for r in rows]
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=ys,
            text=[_pct(y) for y in ys],
            uid="replay-hit-rate",
            textposition="outside",
            hoverinfo="x+text",
        )
    )
    fig.update_xaxes(type="category", title="run", tickangle=0, automargin=True)
    fig.update_yaxes(title="hit rate", tickformat=".0%", range=[0, 1.1])
    return fig
