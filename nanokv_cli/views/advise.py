"""Rendering for ``nanokv advise``: the hit rate against its bounds, what limits it, where
prompts part, the changes ranked by measured gain (a layout finding's with its cause and both
texts where they part), the capacity curve, the hit rate over the requests, the whole grid,
and the notes: all that ``advise --html`` draws (``views/pages.py``), as text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from .inspect import append_divergence_sides


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _points(gain: float) -> str:
    return f"{gain * 100:+.1f} points"


def render_advice(advice: dict[str, Any]) -> RenderableType:
    parts: list[RenderableType] = [_headline(advice), Text()]
    parts += [_limits(advice["limits"]), Text()]
    unit = "request" if advice["input"]["kind"] == "trace" else "line"
    parting = _divergence_points(advice["divergence_points"], unit)
    if parting is not None:
        parts += [parting, Text()]
    parts += [_changes(advice), Text()]
    unmeasured = _no_gain(advice.get("findings") or [])
    if unmeasured is not None:
        parts += [unmeasured, Text()]
    for part in (_capacity(advice.get("capacity_curve")), _timeline(advice.get("timeline"))):
        if part is not None:
            parts += [part, Text()]
    parts += [_grid(advice["grid"]), Text(), _notes(advice["notes"])]
    return Group(*parts)


def _settings(s: dict[str, Any]) -> str:
    words = [f"block size {s['block_size']}", f"{s['num_blocks']:,} blocks"]
    if not s["prefix_caching"]:
        words.append("prefix caching off")
    elif "prefix_match" in s:
        words.append(f"prefix match {s['prefix_match']}")
    return ", ".join(words)


def _headline(advice: dict[str, Any]) -> Text:
    inp = advice["input"]
    text = Text()
    text.append(f"advise {Path(inp['source']).name}", "bold")
    text.append(f": {inp['requests']:,} requests, {_settings(advice['settings'])}\n")
    rec = advice.get("recorded")
    if rec:
        text.append(
            f"recorded run: hit rate {_pct(rec['hit_rate'])} "
            f"({rec['cache_hits']:,} of {rec['cache_queries']:,} prompt tokens)\n"
        )
    now = advice["now"]
    text.append("hit rate now ")
    text.append(_pct(advice["hit_rate"]), "bold yellow")
    text.append(f" ({now['cache_hits']:,} of {now['cache_queries']:,} prompt tokens)")
    bounds = advice["bounds"]
    pieces = []
    if bounds["infinite_cache"]:
        pieces.append(
            f"{_pct(bounds['infinite_cache']['hit_rate'])} with a cache that never evicts"
        )
    if bounds["token_level"]:
        pieces.append(f"{_pct(bounds['token_level']['hit_rate'])} token-level (block size 1)")
    else:
        pieces.append("token-level not run (see the notes)")
    text.append("\nbounds for these prompts: " + " · ".join(pieces))
    return text


def _limits(limits: list[dict[str, Any]]) -> RenderableType:
    if not limits:
        return Text("nothing missed but what no cache can serve", "dim")
    table = Table(
        title="What limits it (missed prompt tokens, by the engine's reasons)",
        title_justify="left",
        header_style="bold",
        box=None,
        expand=True,
    )
    table.add_column("reason", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("of all", justify="right", no_wrap=True)
    table.add_column("meaning", ratio=1)
    for lim in limits:
        meaning = lim["explanation"]
        if "prompts" in lim:
            n = lim["prompts"]
            meaning = (
                f"{n:,} prompt{'s' if n != 1 else ''} shorter than one block: whole-block "
                f"reuse can never serve {'them' if n != 1 else 'it'}"
            )
        table.add_row(lim["reason"], f"{lim['tokens']:,}", _pct(lim["share"]), meaning)
    return table


def _divergence_points(points: list[dict[str, Any]], unit: str) -> RenderableType | None:
    if not points:
        return None
    text = Text()
    text.append("Where prompts part from earlier ones", "bold")
    text.append(" (‖: the first token that differs)\n")
    for p in points:
        lo, hi = p["at_tokens"]
        at = f"token {lo:,}" if lo == hi else f"tokens {lo:,}-{hi:,}"
        where = f"in line {p['line']}, at {at}" if "line" in p else f"at {at}"
        many = "request parts" if p["requests"] == 1 else "requests part"
        text.append(f"  {p['requests']:,} {many} {where}")
        text.append(f" (e.g. {unit} {p['example']} from {unit} {p['shared_with']})\n", "dim")
        append_divergence_sides(text, p, "    ", 30)
    text.rstrip()
    return text


def _changes(advice: dict[str, Any]) -> Text:
    text = Text()
    text.append("Changes, ranked by measured gain", "bold")
    text.append(" (each a dry run of the change)\n")
    if not advice["changes"]:
        text.append("  none of the grid's changes raises the hit rate", "dim")
        if advice.get("verdict"):
            text.append(f"\n  {advice['verdict']}")
        return text
    now = advice["hit_rate"]
    for i, c in enumerate(advice["changes"], 1):
        text.append(f"  {i}. {c['change']}: ")
        text.append(f"{_pct(now)} → {_pct(c['hit_rate'])}", "bold green")
        text.append(f" ({_points(c['gain'])}, {c['tokens_saved']:,} more tokens from the cache)")
        text.append("\n")
        if c.get("cause"):
            text.append("     cause: ", "bold")
            text.append(f"{c['cause']}\n")
        if c.get("finding"):
            _finding_body(text, c["finding"])
    text.rstrip()
    return text


def _finding_body(text: Text, f: dict[str, Any]) -> None:
    """A layout finding's two texts where they part (▸), and what it costs."""
    for label, side in (("this:    ", f["left"]), ("earlier: ", f["right"])):
        text.append(f"     {label}", "bold")
        text.append(f"{side}\n")
    this, earlier = f["example"]
    text.append(
        f"     {f['tokens_lost']:,} shared prompt tokens not reused (e.g. line {this} against "
        f"line {earlier}, parting at token {f['part_at']:,}); measured: "
        f"{f['gain_tokens']:+,} tokens from the cache with the fix\n",
        "dim",
    )


def _no_gain(findings: list[dict[str, Any]]) -> Text | None:
    """The layout findings not among the changes listed (their fix measured no gain, or less
    than the changes'), ranked after them."""
    rest = [f for f in findings if f.get("rank") is None]
    if not rest:
        return None
    text = Text()
    text.append("Other layout findings", "bold")
    text.append(" (each fix a dry run of the prompts with it; no gain, or less than above)\n")
    for f in rest:
        text.append(f"  - {f['kind']}: ", "bold")
        text.append(f"{f['cause']}\n     fix: {f['fix']} ({_points(f['gain'])})\n")
        _finding_body(text, f)
    text.rstrip()
    return text


BAR = 30  # characters of a full bar (a hit rate of 100%)


def _bar(rate: float, ceiling: float | None) -> Text:
    """A hit rate as a bar, the ceiling marked ┊ where the bar does not reach it."""
    filled = round(rate * BAR)
    cells = ["█"] * filled + [" "] * (BAR - filled)
    if ceiling is not None and round(ceiling * BAR) > filled:
        cells[min(BAR - 1, round(ceiling * BAR))] = "┊"
    return Text("".join(cells), "green")


def _capacity(curve: dict[str, Any] | None) -> RenderableType | None:
    """The capacity curve as rows: cache size, hit rate as a bar, ideal prefill speedup.
    Numbers are never cut (``AtLeast``), as in the grid."""
    if not curve or not curve.get("points"):
        return None
    per_token = curve.get("kv_bytes_per_token")
    model = Path(str(curve.get("model") or "")).name or "the model"
    kv = (
        f"GiB of {curve['kv_dtype']} K/V for {model}, {per_token:,} bytes a token"
        if per_token
        else f"no GiB: {curve.get('kv_note')}"
    )
    ceiling = curve.get("ceiling")
    rows = []
    for p in curve["points"]:
        gib = _gib(p.get("cache_gib"))
        speed = f"{p['ideal_speedup']:.2f}×" if p["ideal_speedup"] is not None else "∞"
        rows.append([f"{p['cache_tokens']:,}", gib, _pct(p["hit_rate"]), speed])
    header = ["cache tokens", "GiB", "hit rate", "ideal speedup"]
    table = Table(
        title=f"Hit rate by cache size (block size {curve['block_size']}; {kv})",
        title_justify="left", header_style="bold", box=None,
    )  # fmt: skip
    needed = BAR + 8  # the bar and the mark, with their padding
    for i, name in enumerate(header):
        width = max(len(name), *(len(r[i]) for r in rows))
        table.add_column(name, justify="right", no_wrap=True, min_width=width)
        needed += width + 2
        if name == "hit rate":
            table.add_column("", no_wrap=True, min_width=BAR)
    table.add_column("", no_wrap=True, min_width=5)
    for p, cells in zip(curve["points"], rows):
        bar = _bar(p["hit_rate"], ceiling)
        table.add_row(*cells[:3], bar, cells[3], "◀ now" if p["now"] else "",
                      style="bold" if p["now"] else None)  # fmt: skip
    if ceiling is not None:
        what = "block size 1" if curve["ceiling_kind"] == "token-level" else "this block size"
        table.caption = f"┊ ceiling {_pct(ceiling)} (a cache that never evicts, {what})"
        table.caption_justify = "left"
    return AtLeast(table, needed)


def _gib(gib: float | None) -> str:
    if gib is None:
        return "—"
    return f"{gib:,.0f}" if gib >= 100 else f"{gib:.3g}"


TIMELINE_ROWS = 10


def _timeline(timeline: list[dict[str, Any]] | None) -> Text | None:
    """The run now over its requests, in up to TIMELINE_ROWS runs of consecutive ones: the hit
    rate and what missed most."""
    if not timeline:
        return None
    text = Text()
    text.append("Hit rate over the requests", "bold")
    text.append(" (the run now, in arrival order)\n")
    size = -(-len(timeline) // TIMELINE_ROWS)
    unit = timeline[0]["label"].split()[0].rstrip("s")  # line, or request
    spans = []
    for k in range(0, len(timeline), size):
        part = timeline[k : k + size]
        first, last = part[0].get("first"), part[-1].get("last")
        spans.append(part[0]["label"] if first == last else f"{unit}s {first}-{last}")
    width = max(map(len, spans))
    for k, span in zip(range(0, len(timeline), size), spans):
        part = timeline[k : k + size]
        prompt = sum(r["prompt_tokens"] for r in part)
        hits = sum(r["hit_tokens"] for r in part)
        misses: dict[str, int] = {}
        for r in part:
            for reason, n in r["misses"].items():
                misses[reason] = misses.get(reason, 0) + n
        rate = hits / prompt if prompt else 0.0
        text.append(f"  {span:<{width}} ")
        text.append_text(_bar(rate, None))
        text.append(f" {_pct(rate):>6}")
        top = sorted(misses.items(), key=lambda kv: -kv[1])[:2]
        if top:
            text.append("  missed: " + ", ".join(f"{r} {n:,}" for r, n in top), "dim")
        text.append("\n")
    text.rstrip()
    return text


def _grid(rows: list[dict[str, Any]]) -> RenderableType:
    """Every run's settings and numbers. A narrow terminal or pipe wraps the run's name, never
    a number: each number column is as wide as its widest cell."""
    has_mode = any("prefix_match" in r for r in rows)
    header = ["block", "blocks", *(["match"] if has_mode else []), "hit rate", "gain", "evictions"]
    body = []
    for r in rows:
        cells = [str(r["block_size"]), f"{r['num_blocks']:,}"]
        if has_mode:
            cells.append(r.get("prefix_match", "") if r["prefix_caching"] else "off")
        gain = "" if r["kind"] == "now" else f"{r['gain'] * 100:+.1f}"
        cells += [_pct(r["hit_rate"]), gain, f"{r['evictions']:,}"]
        body.append(cells)
    table = Table(title="Every run", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    label_width = 10
    table.add_column("run", min_width=label_width, overflow="fold")
    needed = label_width + 2
    for i, name in enumerate(header):
        width = max(len(name), *(len(cells[i]) for cells in body))
        justify = "left" if name == "match" else "right"
        table.add_column(name, justify=justify, no_wrap=True, min_width=width)
        needed += width + 2  # a column's padding
    for r, cells in zip(rows, body):
        style = "bold" if r["kind"] == "now" else "dim" if r["kind"] == "bound" else None
        table.add_row(r["label"], *cells, style=style)
    return AtLeast(table, needed + 2)


class AtLeast:
    """A renderable laid out at least ``width`` columns wide, however narrow the console: past
    the terminal's width its lines run on (print it with ``crop=False``) instead of losing
    cells."""

    def __init__(self, renderable: RenderableType, width: int) -> None:
        self.renderable, self.width = renderable, width

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(options.max_width, self.width)
        yield from console.render(self.renderable, options.update(width=width))

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(self.width, max(self.width, options.max_width))


def _notes(notes: list[str]) -> Text:
    text = Text()
    text.append("Notes\n", "bold")
    for note in notes:
        text.append(f"  - {note}\n")
    text.rstrip()
    return text
