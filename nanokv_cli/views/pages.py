"""The HTML pages of ``advise --html`` and ``replay --dry-run --html``: what each page is drawn
from (``html_page.py`` draws it), taken from the command's ``--json`` output key by key, so the
page holds the JSON's numbers and texts and nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The advise grid's columns on the page: every run's settings and numbers (each row is the
# JSON's row; the page reads the columns it names).
ADVISE_GRID = (
    "label", "kind", "block_size", "num_blocks", "cache_tokens", "prefix_match", "hit_rate",
    "gain", "cache_hits", "tokens_saved", "evictions", "rejected",
)  # fmt: skip
REPLAY_GRID = (
    "block_size", "num_blocks", "cache_tokens", "prefix_match", "hit_rate",
    "infinite_cache_hit_rate", "cache_hits", "cache_queries", "evictions", "preemptions",
    "rejected",
)  # fmt: skip


def advise_report(advice: dict[str, Any]) -> dict[str, Any]:
    """The advise page's input (``html_page.advise_page``), from ``advise --json``."""
    inp, settings = advice["input"], advice["settings"]
    return {
        "title": f"nanokv advise {Path(inp['source']).name}",
        "settings": {
            "file": inp["source"],
            "requests": inp["requests"],
            "arrivals": inp["arrivals"],
            **settings,
            "cache_tokens": settings["block_size"] * settings["num_blocks"],
            "hit_rate": advice["hit_rate"],
        },
        "capacity_curve": advice.get("capacity_curve"),
        "timeline": advice.get("timeline"),
        "findings": page_findings(advice),
        "grid": {"columns": list(ADVISE_GRID), "rows": advice["grid"]},
    }


def page_findings(advice: dict[str, Any]) -> list[dict[str, Any]]:
    """The ranked changes (a layout finding's with its texts), then the layout findings that
    are not among them, ranked after them."""
    out = []
    for c in advice["changes"]:
        f = c.get("finding") or {}
        out.append({
            "rank": c["rank"],
            "kind": f.get("kind", c["label"]),  # a layout finding's kind, else the run's name
            "cause": c["cause"],
            "fix": c["fix"],
            "tokens_lost": f.get("tokens_lost"),
            "gain_tokens": c["tokens_saved"],
            "gain": c["gain"],
            "hit_rate": c["hit_rate"],
            "left": f.get("left", ""),
            "right": f.get("right", ""),
        })  # fmt: skip
    rest = [f for f in advice.get("findings") or [] if f.get("rank") is None]
    for rank, f in enumerate(rest, len(out) + 1):
        keys = ("kind", "cause", "fix", "tokens_lost", "gain_tokens", "gain", "hit_rate")
        out.append({"rank": rank, **{k: f[k] for k in keys}, "left": f["left"],
                    "right": f["right"]})  # fmt: skip
    return out


def advise_html(advice: dict[str, Any]) -> str:
    from .html_page import advise_page

    return advise_page(advise_report(advice))


def replay_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The replay page's input (``html_page.replay_page``): a dry run's reports (one per
    block size and cache size of its grid), from ``replay --dry-run --json``."""
    rows = [
        [r["block_size"] * r["num_blocks"] if c == "cache_tokens" else r.get(c)
         for c in REPLAY_GRID]
        for r in reports
    ]  # fmt: skip
    first = reports[0] if reports else {}
    notes = [f"{first.get('file')}: arrivals {first.get('arrivals')}; dry runs (no model)"]
    for r in reports:
        notes += [n for n in r.get("notes") or [] if n not in notes]
        if r.get("interrupted"):
            notes.append(f"interrupted: block size {r['block_size']}, "
                         f"{r['num_blocks']:,} blocks counts what finished")  # fmt: skip
    return {
        "title": f"nanokv replay --dry-run {Path(str(first.get('file'))).name}",
        "columns": list(REPLAY_GRID),
        "rows": rows,
        "notes": notes,
    }


def replay_html(reports: list[dict[str, Any]]) -> str:
    from .html_page import replay_page

    return replay_page(replay_report(reports))
