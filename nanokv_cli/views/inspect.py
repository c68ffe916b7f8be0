"""Renderings for ``nanokv inspect``: a recorded cache state, and prompts laid onto blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..engine.core.cache_numbers import miss_label
from ..engine.core.events import CacheState
from .blockmap import FREE, USED, block_cell, blocks_per_cell, legend, render_block_map, shared_cell


def _hash(h: int | None) -> str:
    return "-" if h is None else f"{h:016x}"


def _snippet(block: dict[str, Any]) -> Text:
    if block.get("text") is not None:
        return Text(repr(block["text"])[1:-1], style="italic")
    if block.get("token_ids") is not None:
        return Text(" ".join(map(str, block["token_ids"])), style="dim")
    return Text("(tokens not recorded)", style="dim")


def render_trace_state(
    header: dict[str, Any], state: CacheState, info: dict[str, Any], width: int
) -> RenderableType:
    """Header line, block map, sequences with their block tables, and the non-free blocks."""
    snap = info["snapshot"] or {}
    c = info["counts"]
    head = Text()
    head.append(f"step {info['step']}", "bold")
    head.append(f" ({snap.get('kind', '?')})  ·  ")
    head.append(f"{header['num_blocks']} blocks × {header['block_size']} tokens\n")
    model = header.get("model")
    head.append(f"model: {Path(model).name if model else '(none: token ids only)'}\n")
    head.append(
        f"blocks: used {c['used']} · shared {c['shared']} · cached-free {c['cached']} · free {c['free']}\n"
        f"sequences: running {snap.get('num_running', 0)} · waiting {snap.get('num_waiting', 0)}\n"
        f"so far: evictions {snap.get('evictions', 0)} · preemptions {snap.get('preemptions', 0)}"
    )
    cache = info["cache"]
    head.append(
        f"\nprefix cache so far: hit rate {cache['hit_rate']:.1%} "
        f"({cache['cache_hits']:,} of {cache['cache_queries']:,} tokens)"
    )
    misses = {k: v for k, v in cache["miss_tokens"].items() if v}
    if misses:
        head.append(" · missed: " + " · ".join(f"{k} {v:,}" for k, v in misses.items()))
    rows = 16
    cells = blocks_per_cell(state.num_blocks, width, rows)
    parts: list[RenderableType] = [
        head,
        Text(),
        render_block_map(state, width, rows),
        legend(cells),
        Text(),
    ]
    parts.append(_sequences_table(info, state))
    if info["waiting"]:
        parts.append(Text(f"waiting without blocks: {', '.join(map(str, info['waiting']))}"))
    parts.append(_blocks_table(info))
    return Group(*parts)


def _sequences_table(info: dict[str, Any], state: CacheState) -> RenderableType:
    if not info["sequences"]:
        return Text("no sequence holds blocks at this step", style="dim")
    table = Table(title="Block tables", title_justify="left", header_style="bold", expand=True)
    table.add_column("seq", justify="right", no_wrap=True)
    table.add_column("prompt", justify="right", no_wrap=True)
    table.add_column("blocks", justify="right", no_wrap=True)
    table.add_column(
        "block table: logical → physical (shared blocks coloured)", overflow="fold", ratio=1
    )
    more = info.get("sequences_total", len(info["sequences"])) - min(
        MAX_ROWS, len(info["sequences"])
    )
    if more > 0:
        table.caption = f"… {more:,} more sequences not shown (--json --all lists them all)"
    for seq in info["sequences"][:MAX_ROWS]:
        cells = Text()
        for b in seq["block_table"]:
            rc = state.ref_count[b]
            cells.append(str(b), shared_cell(rc)[1] if rc > 1 else None)
            cells.append(" ")
        table.add_row(
            str(seq["seq_id"]), str(seq["num_prompt_tokens"]), str(len(seq["block_table"])), cells
        )
    return table


# A terminal shows this many rows of a table (a screenful); --json --all has them all (a cache
# can hold 10^4 blocks, and laying out 200 rows took most of inspect's second).
MAX_ROWS = 50


def _blocks_table(info: dict[str, Any]) -> RenderableType:
    if not info["blocks"]:
        return Text("every block is free and clean", style="dim")
    blocks = info["blocks"]
    more = info.get("blocks_total", len(blocks)) - min(MAX_ROWS, len(blocks))
    table = Table(
        title="Blocks (all but free-and-clean)",
        title_justify="left",
        header_style="bold",
        expand=True,
    )
    table.add_column("block", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("refs", justify="right", no_wrap=True)
    table.add_column("hash", no_wrap=True)
    table.add_column("seqs", no_wrap=True, max_width=16, overflow="ellipsis")
    table.add_column("text", no_wrap=True, overflow="ellipsis", ratio=1)
    if more > 0:
        table.caption = f"… {more:,} more blocks not shown (--json --all lists them all)"
    for b in blocks[:MAX_ROWS]:
        glyph, style = block_cell(b["ref_count"], -1 if b["hash"] is None else b["hash"])
        table.add_row(
            str(b["block_id"]),
            Text(f"{glyph} {b['state']}", style=style if b["ref_count"] > 1 else None),
            str(b["ref_count"]),
            _hash(b["hash"]),
            ",".join(map(str, b["seq_ids"])),
            _snippet(b),
        )
    return table


def render_prompt_map(
    info: dict[str, Any], texts: list[str] | None, width: int, decode=None, token_lists=None
) -> RenderableType:
    """Each prompt as a row of blocks: shared blocks show how many prompts hold them."""
    bs = info["block_size"]
    head = Text()
    head.append(f"{len(info['prompts'])} prompts on {bs}-token blocks: ", "bold")
    head.append(
        f"{info['total_blocks']} blocks, {info['unique_full_blocks']} distinct full blocks, "
        f"{info['shared_full_blocks']} shared by several prompts; "
    )
    head.append(f"prefix-cache hit rate {info['hit_rate']:.1%}", "bold yellow")
    head.append(" with a cache that never evicts, in file order")
    misses = info.get("miss_tokens") or {}
    if misses:
        total = sum(misses.values())
        head.append(
            "\nmissed tokens: "
            + " · ".join(f"{k} {v:,} ({v / total:.0%})" for k, v in misses.items())
        )
    key = Text()
    key.append(*USED)
    key.append(" only this prompt  ")
    for n in (2, 3, 5):
        key.append(*shared_cell(n))
        key.append(" ")
    key.append("full block shared by n prompts (underlined: a prefix-cache hit)  ")
    key.append("▏", FREE[1])
    key.append(" partial last block\nmissed: why the first block that missed did (@ block index)")
    table = Table(header_style="bold", box=None, pad_edge=False, expand=True)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("hit", justify="right", no_wrap=True)
    table.add_column("blocks", no_wrap=True, overflow="ellipsis", ratio=1)
    table.add_column("missed", no_wrap=True, overflow="ellipsis", max_width=26)
    if texts is not None:
        table.add_column("prompt", no_wrap=True, overflow="ellipsis", max_width=40)
    for p in info["prompts"]:
        cells = Text()
        for block in p["blocks"]:
            if block["hash"] is None:
                cells.append("▏", FREE[1])
                continue
            glyph, style = USED if block["shared_by"] == 1 else shared_cell(block["shared_by"])
            if block["hit"]:
                style = f"{style} underline"
            cells.append(glyph, style)
        why = Text(miss_label(p, bs), style="dim") if "miss_reason" in p else Text("")
        # The lookup's own count, copied tokens included: what the headline's rate adds up.
        hits = p["cached_tokens"]
        row = [str(p["index"]), f"{p['num_tokens']:,}", f"{hits:,}", cells, why]
        if texts is not None:
            row.append(repr(texts[p["index"]])[1:-1])
        table.add_row(*row)
    parts: list[RenderableType] = [head, key, Text(), table]
    parting = divergence_table([(p["index"], p.get("divergence")) for p in info["prompts"]])
    if parting is not None:
        parts += [Text(), parting]
    shared = _shared_blocks(info, decode, token_lists)
    if shared is not None:
        parts += [Text(), shared]
    return Group(*parts)


def divergence_table(rows: list[tuple[Any, dict[str, Any] | None]]) -> RenderableType | None:
    """Where each prompt parts from the earlier prompt it shares the most with: that prompt,
    the token, and the text on both sides (marked ‖), this prompt's above the earlier one's."""
    rows = [(who, d) for who, d in rows if d is not None]
    if not rows:
        return None
    table = Table(
        title="Where prompts part from earlier ones (‖: the first token that differs)",
        title_justify="left",
        header_style="bold",
        expand=True,
    )
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("with", justify="right", no_wrap=True)
    table.add_column("at token", justify="right", no_wrap=True)
    table.add_column("this prompt / the earlier one", overflow="ellipsis", ratio=1)
    for who, d in rows[:MAX_ROWS]:
        table.add_row(str(who), str(d["shared_with"]), f"{d['at_token']:,}", divergence_text(d))
    if len(rows) > MAX_ROWS:
        table.caption = f"… {len(rows) - MAX_ROWS:,} more (--json lists them all)"
    return table


def divergence_text(d: dict[str, Any], width: int = 40) -> Text:
    """A divergence record's two sides (``width`` characters each side of the mark at most),
    or what stands for them where there is no text."""
    from ..run.divergence import marked

    sides = marked(d, width)
    if sides is None:
        ids = d.get("hash_ids") or [None, None]
        if ids[0] is None:
            return Text("one prompt ends inside the other's block (no text: hash ids only)", "dim")
        return Text(
            f"hash id {ids[0]} against {ids[1]} in 512-token block {d['hash_block']} "
            "(no text: hash ids only)",
            "dim",
        )
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(sides[0], "italic")
    text.append("\n")
    text.append(sides[1], "dim italic")
    return text


def _shared_blocks(info: dict[str, Any], decode, token_lists) -> RenderableType | None:
    seen: dict[int, dict[str, Any]] = {}
    for p in info["prompts"]:
        for block in p["blocks"]:
            h = block["hash"]
            if h is not None and block["shared_by"] > 1 and h not in seen:
                seen[h] = {"block": block, "prompt": p["index"], "users": []}
            if h in seen:
                seen[h]["users"].append(p["index"])
    if not seen:
        return None
    bs = info["block_size"]
    table = Table(title="Shared blocks", title_justify="left", header_style="bold", expand=True)
    table.add_column("hash", no_wrap=True)
    table.add_column("position", justify="right", no_wrap=True)
    table.add_column("prompts", no_wrap=True, max_width=24, overflow="ellipsis")
    table.add_column("text", no_wrap=True, overflow="ellipsis", ratio=1)
    for h, entry in list(seen.items())[:200]:
        i = entry["block"]["index"]
        text = Text("")
        if decode is not None and token_lists is not None:
            tokens = token_lists[entry["prompt"]][i * bs : (i + 1) * bs]
            text = Text(repr(decode(list(tokens)))[1:-1], style="italic")
        table.add_row(_hash(h), f"block {i}", ",".join(map(str, entry["users"])), text)
    return table


def render_request(info: dict[str, Any], block_size: int) -> RenderableType:
    """One request's lookups: a line per block, hits with who shared them, then the miss."""
    text = Text()
    text.append(f"request {info['seq_id']}", "bold")
    text.append(f": {info['num_prompt_tokens']:,} prompt tokens, {block_size}-token blocks\n")
    _append_divergence(text, info.get("divergence"))
    if not info["lookups"]:
        text.append("never admitted in this trace (it was still waiting when it ended)", "dim")
    for look in info["lookups"]:
        kind = "first admission" if look["first_admission"] else "re-admission after preemption"
        n, hit = look["num_tokens"], look["cached_tokens"]
        text.append(f"\n{kind} at step {look['step']}: ", "bold")
        text.append(f"{hit:,} of {n:,} tokens from the prefix cache ({hit / n:.1%})\n")
        restored = [b for b in look["blocks"] if b["hit"] == "restored"]
        if restored:  # the second tier's share (kv_tier), named as the report names it
            text.append(
                f"  restored {len(restored) * block_size:,} tokens from {restored[0]['medium']}"
                " (evicted earlier, read back instead of recomputed)\n"
            )
        missed = False
        for i, b in enumerate(look["blocks"]):
            text.append(f"  block {i:>4} → {b['block_id']:>5}  ")
            if b["hit"] == "shared":
                others = ", ".join(map(str, b["held_by"])) or "?"
                text.append("hit, shared", "green")
                text.append(f" with seq {others}\n")
            elif b["hit"] == "revived":
                text.append("hit, revived", "blue")
                text.append(" from the free queue (cached, no one was using it)\n")
            elif b["hit"] == "restored":
                text.append(f"hit, restored from {b['medium']}", "magenta")
                text.append(" (the second tier kept it when the cache evicted it)\n")
            elif b["hit"] == "copied":
                text.append(f"hit, copied {b['num_tokens']:,} tokens", "cyan")
                text.append(f" from block {b['source_block_id']} (same prefix), then ")
                missed = True
                text.append(f"miss: {look['miss_reason']}", "bold red")
                text.append(f" — {look['explanation']}\n")
            elif not missed:
                missed = True
                text.append(f"miss: {look['miss_reason']}", "bold red")
                text.append(f" — {look['explanation']}\n")
            else:
                text.append("miss", "red")
                text.append(
                    " (follows the first miss: a block hits only after its whole prefix)\n", "dim"
                )
    return text


def _append_divergence(text: Text, d: dict[str, Any] | None) -> None:
    """The earlier request this one shares the most with, and where they part."""
    if d is None:
        text.append("no earlier request shares its first token\n", "dim")
        return
    text.append(f"shares its first {d['at_token']:,} tokens with request {d['shared_with']}")
    if d["prompt_ends_here"]:
        text.append(" (all of this prompt)\n")
        return
    text.append(f", then parts at token {d['at_token']:,}:\n")
    append_divergence_sides(text, d, "  ")


def append_divergence_sides(text: Text, d: dict[str, Any], indent: str, width: int = 40) -> None:
    """A divergence's two sides on two lines, labelled; one line where there is no text."""
    lines = divergence_text(d, width).split("\n")
    if len(lines) == 1:
        text.append(indent)
        text.append_text(lines[0])
        text.append("\n")
        return
    for label, line in zip(("this:    ", "earlier: "), lines):
        text.append(indent + label, "bold")
        text.append_text(line)
        text.append("\n")
