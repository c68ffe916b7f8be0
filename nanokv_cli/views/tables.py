"""Static tables: run summaries, the dry-run comparison and its hit-rate chart."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:,.1f} ms"  # None: no request gave one


# One line each for the summary; README's "Reading the numbers" says the same at more length.
MISS_HELP = {
    "disabled": "prefix caching off",
    "preempted": "recomputed after preemption",
    "last-block": "block with the prompt's last token, always computed",
    "last-token": "the prompt's last token, always computed",
    "in-flight": "being computed by another sequence",
    "evicted": "was cached, evicted",
    "partial": "shared prefix ends inside the block",
    "cold": "no earlier prompt had this prefix",
}


def summary_table(report: dict[str, Any], title: str = "Summary") -> Table:
    """The replay summary: volume, prefix cache, blocks, throughput and latency."""
    if report.get("interrupted"):
        title += " (interrupted: what ran until Ctrl-C)"
    table = _label_value_table(title)
    r = report
    aborted = r.get("requests_aborted", 0)
    table.add_row(
        "requests finished",
        f"{r['requests']:,}",
        f"of {r['requests_added']:,} added" + (f", {aborted:,} aborted" if aborted else ""),
    )
    more = r.get("prompt_tokens_aborted", 0)
    table.add_row(
        "prompt tokens",
        f"{r['prompt_tokens']:,}",
        "of finished requests" + (f" ({more:,} more of aborted ones)" if more else ""),
    )
    streamed = r.get("output_tokens_aborted", 0)
    table.add_row(
        "output tokens",
        f"{r['output_tokens']:,}",
        f"{streamed:,} of them for aborted requests" if streamed else "",
    )
    table.add_row(
        "prefix-cache hit rate",
        _pct(r["hit_rate"]),
        f"{r['cache_hits']:,} of {r['cache_queries']:,} prompt tokens served from cache "
        "(first admissions)",
    )
    hits = r["cache_hits"]
    if hits:
        table.add_row(
            "  shared / revived / copied",
            f"{r['shared_hit_tokens'] / hits:.0%} / {r['revived_hit_tokens'] / hits:.0%}"
            f" / {r.get('copied_hit_tokens', 0) / hits:.0%}",
            "of hits: block in use / freed block still cached / tokens copied from a block",
        )
    if "hit_rate_by_tier" in r:  # a second tier (--kv-tier): its share, by its JSON names
        medium = next(k for k in r["hit_rate_by_tier"] if k != "device")
        table.add_row(
            f"  restored from {medium}",
            _pct(r["hit_rate_by_tier"][medium]),
            f"restored_hit_tokens {r['restored_hit_tokens']:,}: evicted blocks read back "
            f"instead of recomputed; {r['tier_blocks']:,} blocks in the tier at the end",
        )
    if "infinite_cache_hit_rate" in r:
        table.add_row("  infinite cache", _pct(r["infinite_cache_hit_rate"]), "upper bound")
    misses = {k: v for k, v in r["miss_tokens"].items() if v}
    if misses:
        total = sum(misses.values())
        table.add_row("missed tokens", f"{total:,}", "by reason of the first missed block:")
        for reason, n in misses.items():
            table.add_row(f"  {reason}", f"{n:,}", f"{n / total:.0%} · {MISS_HELP[reason]}")
    if r["readmission_queries"]:
        table.add_row(
            "re-admissions",
            _pct(r["readmission_hits"] / r["readmission_queries"]),
            f"{r['readmission_hits']:,} of {r['readmission_queries']:,} tokens, after "
            "preemption (not in the hit rate)",
        )
    table.add_row(
        "prompt tokens computed",
        f"{r['computed_prompt_tokens']:,}",
        "prefill work: misses plus recomputation",
    )
    table.add_row("evictions", f"{r['evictions']:,}", "cached blocks lost to new data")
    table.add_row("preemptions", f"{r['preemptions']:,}", "sequences recomputed")
    table.add_row("peak blocks in use", f"{r['peak_used_blocks']:,}", f"of {r['num_blocks']:,}")
    clock = "virtual seconds" if r.get("dry_run") else "seconds"
    table.add_row("duration", f"{r['duration_s']:,.2f} s", f"{r['steps']:,} steps, {clock}")
    table.add_row("throughput", f"{r['output_throughput']:,.1f} tok/s", "output tokens")
    table.add_row("", f"{r['total_token_throughput']:,.1f} tok/s", "prompt + output")
    table.add_row("", f"{r['request_throughput']:,.2f} req/s", "")
    for note in r.get("notes", ()):
        table.add_row("note", "", note)
    _latency_rows(table, r)
    return table


def _latency_rows(table: Table, r: dict[str, Any]) -> None:
    latencies = (
        ("ttft_s", "time to first token"),
        ("itl_s", "inter-token latency"),
        ("e2e_latency_s", "request latency"),
    )
    for key, label in latencies:
        if key in r:
            if r.get("dry_run"):
                label += " (virtual)"
            p = r[key]
            spread = f"mean {_ms(p['mean'])} · p90 {_ms(p['p90'])} · p99 {_ms(p['p99'])}"
            table.add_row(label, f"p50 {_ms(p['p50'])}", spread)


def comparison_table(reports: list[dict[str, Any]]) -> Table:
    """One row per dry-run configuration."""
    table = Table(
        title="Cache configurations (dry run)",
        title_justify="left",
        header_style="bold underline",
        box=None,
        pad_edge=False,
    )
    columns = ["block", "blocks", "tokens", "hit rate", "bound", "evictions", "preempt", "peak"]
    rejected = any(r["rejected"] for r in reports)
    if rejected:
        columns.append("rejected")
    for name in columns:
        table.add_column(name, justify="right", no_wrap=True)
    best = max(r["hit_rate"] for r in reports)
    notes = list(dict.fromkeys(n for r in reports for n in r.get("notes", ())))
    for r in reports:
        rate = Text(_pct(r["hit_rate"]), style="bold green" if r["hit_rate"] == best else "")
        marks = "".join("*" * (notes.index(n) + 1) for n in r.get("notes", ()))
        row = [
            f"{marks}{r['block_size']}",
            f"{r['num_blocks']:,}",
            _short(r["block_size"] * r["num_blocks"]),
            rate,
            _pct(r["infinite_cache_hit_rate"]),
            f"{r['evictions']:,}",
            f"{r['preemptions']:,}",
            f"{r['peak_used_blocks']:,}",
        ]
        if rejected:
            row.append(f"{r['rejected']:,}")
        table.add_row(*row)
    table.caption = "bound: hit rate of a cache that never evicts; rejected requests are left out"
    # Under the rows they mark, where a reader comparing them looks: why they cannot differ.
    for i, note in enumerate(notes):
        table.caption += f"\n{'*' * (i + 1)} {note}"
        table.caption_justify = "left"
    return table


def _short(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            # "1000K" not "1e+03K": :g switches to exponent form at 4 significant digits.
            return f"{n / size:.0f}{unit}" if n >= 100 * size else f"{n / size:.3g}{unit}"
    return str(n)


def hit_rate_chart(reports: list[dict[str, Any]], console_width: int = 80) -> Text:
    """Horizontal bars of hit rate per configuration; ``│`` marks the infinite-cache bound."""
    labels = [f"bs {r['block_size']} × {r['num_blocks']:,}" for r in reports]
    pad = max(len(s) for s in labels)
    width = max(10, min(50, console_width - pad - 16))
    text = Text()
    text.append("Prefix-cache hit rate", "bold")
    text.append("  █ achieved  │ infinite-cache bound\n", "dim")
    for label, r in zip(labels, reports):
        filled = round(r["hit_rate"] * width)
        bound = min(width - 1, round(r["infinite_cache_hit_rate"] * width))
        text.append(label.rjust(pad) + " ")
        text.append("█" * filled, "green")
        if bound >= filled:
            text.append("░" * (bound - filled), "grey35")
            text.append("│", "bold red")
            text.append("░" * (width - bound - 1), "grey35")
        else:
            text.append("░" * (width - filled), "grey35")
        text.append(f" {_pct(r['hit_rate']):>6} / {_pct(r['infinite_cache_hit_rate'])}\n")
    return text


def _label_value_table(title: str) -> Table:
    """Three columns: a bold label, its right-aligned value, a dim note."""
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(style="dim")
    return table
