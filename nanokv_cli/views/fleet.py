"""The fleet what-if's tables: one row per instance, the fleet, its bounds, and its misses."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _pct(x: float) -> str:
    return f"{x:.1%}"


def fleet_table(report: dict[str, Any]) -> Group:
    """``fleet.what_if``'s report as text: each instance's numbers and the fleet's, its hit
    rate against the one-cache and infinite-cache bounds, then the missed tokens by reason
    with those another instance held (``elsewhere``)."""
    return Group(
        _title(report), _instances(report), Text(), _bounds(report), Text(), _misses(report)
    )


def _title(r: dict[str, Any]) -> Text:
    router = r["router"]
    if r.get("overlap_score_weight") is not None:
        router += f" (Dynamo's KV router cost, overlap_score_weight {r['overlap_score_weight']})"
    text = Text()
    text.append("Fleet what-if (dry run)", "bold")
    text.append(
        f": {r['instances']} instances × {r['num_blocks']:,} blocks of {r['block_size']} tokens\n"
    )
    text.append(f"router: {router}\n")
    return text


def _instances(r: dict[str, Any]) -> Table:
    table = Table(header_style="bold underline", box=None, pad_edge=False)
    columns = ("instance", "requests", "prompt tokens", "hit rate", "elsewhere", "evictions")
    for name in (*columns, "preemptions"):
        table.add_column(name, justify="right", no_wrap=True)
    for p in r["per_instance"]:
        table.add_row(
            str(p["instance"]),
            f"{p['requests']:,}",
            f"{p['prompt_tokens']:,}",
            _pct(p["hit_rate"]),
            _share(p["elsewhere_tokens"], p["cache_queries"]),
            f"{p['evictions']:,}",
            f"{p['preemptions']:,}",
        )
    table.add_row(
        *(
            Text(cell, style="bold")
            for cell in (
                "fleet",
                f"{r['requests']:,}",
                f"{r['prompt_tokens']:,}",
                _pct(r["hit_rate"]),
                _share(r["elsewhere_tokens"], r["cache_queries"]),
                f"{r['evictions']:,}",
                f"{r['preemptions']:,}",
            )
        )
    )
    return table


def _bounds(r: dict[str, Any]) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(style="dim")
    one = r["one_cache"]
    table.add_row(
        "fleet hit rate",
        _pct(r["hit_rate"]),
        f"{r['cache_hits']:,} of {r['cache_queries']:,} prompt tokens from cache",
    )
    table.add_row(
        "one-cache bound",
        _pct(one["hit_rate"]),
        f"one engine, {one['num_blocks']:,} blocks ({r['instances']} × {r['num_blocks']:,}), "
        "same requests",
    )
    table.add_row("infinite cache", _pct(r["infinite_cache_hit_rate"]), "a cache that never evicts")
    table.add_row(
        "cached elsewhere",
        _share(r["elsewhere_tokens"], r["cache_queries"]),
        f"{r['elsewhere_tokens']:,} missed tokens another instance held then",
    )
    return table


def _share(n: int, total: int) -> str:
    return _pct(n / total) if total else _pct(0.0)


def _misses(r: dict[str, Any]) -> Table:
    table = Table(
        title="Missed tokens by reason (fleet)",
        title_justify="left",
        header_style="bold underline",
        box=None,
        pad_edge=False,
    )
    for name in ("reason", "tokens", "cached elsewhere"):
        table.add_column(name, justify="right" if name != "reason" else "left", no_wrap=True)
    elsewhere = r["elsewhere_by_reason"]
    for reason, n in r["miss_tokens"].items():
        if n:
            table.add_row(reason, f"{n:,}", f"{elsewhere.get(reason, 0):,}")
    table.add_row(
        Text("all", style="bold"),
        f"{sum(r['miss_tokens'].values()):,}",
        Text(f"{r['elsewhere_tokens']:,}", style="bold"),
    )
    return table
