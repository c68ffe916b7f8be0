"""The block map: one cell per physical KV block, or per group of blocks when they don't fit.

Cells: ``·`` free (clean), ``▒`` free but still cached (reusable until evicted), ``█`` used by
one sequence, and a shared block shows its ref count (``2``-``9``, ``+`` above) on a background
that darkens with it. Glyphs differ, so the map reads without colour too (piped, NO_COLOR).
"""

from __future__ import annotations

import numpy as np
from rich.text import Span, Text

from ..engine.core.events import CacheState

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


# Cell codes: 2-10 a shared block by ref count (10: ten or more), then used, cached-free, free.
_USED, _CACHED, _FREE = 11, 12, 13
_CELLS = [FREE, FREE] + [shared_cell(rc) for rc in range(2, 11)] + [USED, CACHED, FREE]


def render_block_map(state: CacheState, width: int, max_rows: int = 12) -> Text:
    """The map as rows of at most ``width`` cells, no more than ``max_rows`` of them.

    Cells are worked out with numpy over all blocks at once (a live view draws this map several
    times a second over thousands of blocks); the result is ``block_cell`` per block, or
    ``group_cell`` per group of blocks when they do not fit."""
    n = state.num_blocks
    if not n:
        return Text(no_wrap=True, overflow="crop")
    group = blocks_per_cell(n, width, max_rows)
    try:
        rc = np.frombuffer(bytes(state.ref_count), np.uint8)  # fast while ref counts < 256
    except ValueError:
        rc = np.minimum(np.array(state.ref_count), 255).astype(np.uint8)
    hashed = np.array(state.block_hash, object) != -1  # hashes are unsigned 64-bit ints
    if group == 1:
        codes = np.where(
            rc > 1, np.minimum(rc, 10), np.where(rc == 1, _USED, np.where(hashed, _CACHED, _FREE))
        )
    else:
        codes = _group_codes(rc, hashed, group)
    return _runs_to_text(codes, width)


def _group_codes(rc: np.ndarray, hashed: np.ndarray, group: int) -> np.ndarray:
    """``group_cell`` for every group of ``group`` blocks (the last one may be shorter)."""
    n = len(rc)
    cells = -(-n // group)
    pad = cells * group - n
    if pad:  # padding counts as no state at all, so the last group keeps its true majority
        rc = np.concatenate((rc, np.zeros(pad, np.uint8)))
        hashed = np.concatenate((hashed, np.zeros(pad, bool)))
    rc, hashed = rc.reshape(cells, group), hashed.reshape(cells, group)
    n_shared = (rc > 1).sum(1)
    n_used = (rc == 1).sum(1)
    n_cached = ((rc == 0) & hashed).sum(1)
    sizes = np.full(cells, group)
    sizes[-1] = n - (cells - 1) * group
    n_free = sizes - n_shared - n_used - n_cached
    best = np.maximum(np.maximum(n_shared, n_used), np.maximum(n_cached, n_free))
    # Ties go to the busier state: shared, then used, then cached-free.
    return np.where(
        n_shared == best,
        np.minimum(rc.max(1), 10),
        np.where(n_used == best, _USED, np.where(n_cached == best, _CACHED, _FREE)),
    )


def _runs_to_text(codes: np.ndarray, width: int) -> Text:
    # One span per run of equal cells, not per cell (a few dozen instead of thousands), and
    # one string built at once: Text.append per run costs more than the rest of the map.
    n = len(codes)
    starts = np.ones(n, bool)
    starts[1:] = codes[1:] != codes[:-1]
    starts[::width] = True  # every row starts a run
    bounds = np.flatnonzero(starts).tolist()
    kinds = codes[bounds].tolist()
    bounds.append(n)
    pieces: list[str] = []
    spans: list[Span] = []
    pos = 0
    for i, code in enumerate(kinds):
        start = bounds[i]
        if start and start % width == 0:
            pieces.append("\n")
            pos += 1
        glyph, style = _CELLS[code]
        run = bounds[i + 1] - start
        pieces.append(glyph * run)
        spans.append(Span(pos, pos + run, style))
        pos += run
    return Text("".join(pieces), no_wrap=True, overflow="crop", spans=spans)


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
