"""The block map: one cell per physical KV block, or per group of blocks when they don't fit.

Cells: ``·`` free (clean), ``▒`` free but still cached (reusable until evicted), ``█`` used by
one sequence, and a shared block shows its ref count (``2``-``9``, ``+`` above) on a background
that darkens with it. Glyphs differ, so the map reads without colour too (piped, NO_COLOR).
"""

from __future__ import annotations

from rich.text import Text

from ..engine.events import CacheState

FREE, CACHED, USED = ("·", "grey42"), ("▒", "blue"), ("█", "green")
# Shared blocks, shaded by ref count: (upper bound of the band, style).
SHARED_SHADES = ((2, "black on yellow"), (4, "black on dark_orange"), (8, "white on red"))
SHARED_MAX = "white on magenta"


def shared_cell(ref_count: int) -> tuple[str, str]:
    glyph = str(ref_count) if ref_count < 10 else "+"
    for bound, style in SHARED_SHADES:
        if ref_count <= bound:
            return glyph, style
    return glyph, SHARED_MAX


def block_cell(ref_count: int, block_hash: int) -> tuple[str, str]:
    if ref_count == 0:
        return CACHED if block_hash != -1 else FREE
    return USED if ref_count == 1 else shared_cell(ref_count)


def group_cell(ref_counts: list[int], hashes: list[int]) -> tuple[str, str]:
    """The state most blocks of a group are in (ties go to the busier state)."""
    n_used = n_shared = n_cached = 0
    max_rc = 0
    for rc, h in zip(ref_counts, hashes):
        if rc == 1:
            n_used += 1
        elif rc > 1:
            n_shared += 1
            max_rc = max(max_rc, rc)
        elif h != -1:
            n_cached += 1
    n_free = len(ref_counts) - n_used - n_shared - n_cached
    best = max(n_shared, n_used, n_cached, n_free)
    if n_shared == best:
        return shared_cell(max_rc)
    if n_used == best:
        return USED
    return CACHED if n_cached == best else FREE


def blocks_per_cell(num_blocks: int, width: int, max_rows: int) -> int:
    cells = max(1, width) * max(1, max_rows)
    return -(-num_blocks // cells)


def render_block_map(state: CacheState, width: int, max_rows: int = 12) -> Text:
    """The map as rows of at most ``width`` cells, no more than ``max_rows`` of them."""
    n = state.num_blocks
    group = blocks_per_cell(n, width, max_rows)
    rc, hashes = state.ref_count, state.block_hash
    if group == 1:
        cells = [block_cell(rc[b], hashes[b]) for b in range(n)]
    else:
        cells = [group_cell(rc[b : b + group], hashes[b : b + group]) for b in range(0, n, group)]
    return _runs_to_text(cells, width)


def _runs_to_text(cells: list[tuple[str, str]], width: int) -> Text:
    # One span per run of equal cells, not per cell: a few dozen spans instead of thousands.
    text = Text(no_wrap=True, overflow="crop")
    for start in range(0, len(cells), width):
        if start:
            text.append("\n")
        row = cells[start : start + width]
        run_glyph, run_style = row[0]
        run = 0
        for glyph, style in row:
            if style == run_style and glyph == run_glyph:
                run += 1
                continue
            text.append(run_glyph * run, run_style)
            run_glyph, run_style, run = glyph, style, 1
        text.append(run_glyph * run, run_style)
    return text


def legend(blocks_in_cell: int = 1) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    for (glyph, style), label in ((USED, "used"), (CACHED, "cached-free"), (FREE, "free")):
        text.append(glyph, style)
        text.append(f" {label}  ")
    text.append("shared, by ref count: ")
    for rc in (2, 4, 8, 10):
        text.append(*shared_cell(rc))
        text.append(" ")
    if blocks_in_cell > 1:
        text.append(f"   1 cell = {blocks_in_cell} blocks (majority state)", "dim")
    return text
