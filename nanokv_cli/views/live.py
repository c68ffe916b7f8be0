"""The live view: block map, counters, sequences and streamed text, redrawn while the engine runs.

Its event listener is a ``CacheState``'s (the one applier of events to ref counts, hashes and
block tables), with the view's own few books (prompt lengths, hit counts, the last snapshot)
kept by the hook it hands the rest of the events to; it keeps no event. Keeping them for a
batch costs more than applying them: a dry run emits a few hundred thousand a second, and
events that are still alive when the garbage collector runs make it run more often and
promote them, so whole-heap collections follow (``scripts/BENCHMARKS.md``, "Live view cost").
The driver calls ``tick()`` once per step, and a frame is drawn only when one is due: at most
``max_fps`` a second, and never more often than keeps drawing under ``budget`` (default 2%) of
the elapsed time, however slow a frame is on this terminal (~2.5 ms at 120x40, so about 8
frames a second). ``scripts/bench/live_view.py`` measures what the view costs a replay.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.text import Span, Text

from ..engine.core.cache_stats import MISS_REASONS
from ..engine.core.events import (
    CacheLookup,
    CacheState,
    Event,
    EventBus,
    SequenceAdded,
    SequenceFinished,
    SequencePreempted,
    StepSnapshot,
)

if TYPE_CHECKING:
    from ..engine.core.llm_engine import LLMEngine

from .blockmap import blocks_per_cell, legend, render_block_map, shared_cell


class LiveView:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        console: Console | None = None,
        title: str = "nanokv",
        total_requests: int | None = None,
        show_text: bool = False,
        transient: bool = False,
        max_fps: float = 12.0,
        budget: float = 0.02,
        max_seq_rows: int = 8,
    ) -> None:
        self.console = console or Console()
        self.block_size = block_size
        self.title = title
        self.total_requests = total_requests
        self.show_text = show_text
        self.transient = transient
        self.min_interval = 1.0 / max_fps
        self.budget = budget
        self.max_seq_rows = max_seq_rows
        # Ref counts, hashes and block tables only: the view keeps no block tokens or prompts.
        self.state = CacheState(num_blocks, keep_tokens=False)
        self.snapshot: StepSnapshot | None = None
        self.prompt_len: dict[int, int] = {}
        self.hit_blocks: dict[int, int] = {}  # prefix-cache hits at the current admission
        self.texts: dict[int, str] = {}
        self.num_finished = 0
        self.tokens_total = 0
        self.frames = 0
        self.draw_time = 0.0  # seconds spent drawing frames
        self.on_event = self._make_listener()
        self._rate_samples: deque[tuple[float, int]] = deque()
        self._next_frame = 0.0
        self._live: Live | None = None
        self._started = time.perf_counter()
        self._ended: float | None = None  # set for the final frame
        self._idle = False  # the engine ran out of work since the last step

    # -- listening ---------------------------------------------------------------------------

    def attach(self, events: EventBus) -> Callable[[], None]:
        """Follow ``events`` from now on; returns the unsubscribe function."""
        return events.subscribe(self.on_event)

    def _make_listener(self) -> Callable[[Event], None]:
        """The listener: the state's own applier (per-block events, ~97% of a dry run's, go
        no further), which hands every other event to ``_track``. Call it from the thread that
        steps the engine."""
        return self.state.listener(self._track)

    def _track(self, event: Event) -> None:
        """The view's own books, from the events that are not per-block (after the state's)."""
        t = type(event)
        if t is StepSnapshot:
            self.snapshot = event
            self.tokens_total += event.num_prefill_tokens + event.num_decode_tokens
        elif t is CacheLookup:
            self.hit_blocks[event.seq_id] = event.num_hit_tokens // self.block_size
        elif t is SequenceAdded:
            self.prompt_len[event.seq_id] = len(event.prompt_token_ids)
        elif t is SequenceFinished:
            self.num_finished += 1
            self.prompt_len.pop(event.seq_id, None)
            self.hit_blocks.pop(event.seq_id, None)
        elif t is SequencePreempted:
            self.hit_blocks.pop(event.seq_id, None)

    def tick(self) -> None:
        """Call once per engine step: draws a frame when one is due."""
        self._idle = False
        if time.perf_counter() >= self._next_frame:
            self.refresh()

    def idle(self) -> None:
        """Call (from the engine's thread) while the engine has no work, again and again in real
        time: draws the idle state when a frame is due. Without it the screen keeps the last
        frame drawn, which the frame rate may have left steps behind, until the next request."""
        self._idle = True
        if time.perf_counter() >= self._next_frame:
            self.refresh()

    def update(self) -> None:
        """Nothing to do: events are applied as they arrive. Kept for callers that still
        bring the view up to date before rendering it themselves."""

    def set_text(self, seq_id: int, text: str) -> None:
        """The text generated so far for ``seq_id`` (shown when ``show_text``)."""
        self.texts[seq_id] = text

    # -- drawing -------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Draw a frame now."""
        t0 = time.perf_counter()
        if self._live is not None:
            self._live.update(self.render(), refresh=True)
        self._drawn(t0)

    def _drawn(self, t0: float) -> None:
        t1 = time.perf_counter()
        self.frames += 1
        self.draw_time += t1 - t0
        # Drawing, not event bookkeeping (which any rate would pay), is what the budget bounds.
        self._next_frame = t1 + max(self.min_interval, (t1 - t0) / self.budget)

    def __enter__(self) -> LiveView:
        t0 = self._started = time.perf_counter()
        self._live = Live(
            self.render(),
            console=self.console,
            auto_refresh=False,
            transient=self.transient,
            vertical_overflow="crop",
        )
        self._live.__enter__()  # draws the first frame, which the rate and budget count too
        self._drawn(t0)
        return self

    def __exit__(self, *exc: object) -> None:
        live, self._live = self._live, None
        if live is None:
            return
        t0 = time.perf_counter()
        try:
            if exc[0] is None:
                self._ended = t0
                live.update(self.render())  # Live's exit draws it: one final frame, not two
        finally:
            live.__exit__(*exc)  # shows the cursor again, whatever happened
            if not self.console.is_terminal and not self.transient:
                self.console.line()  # Rich ends a terminal's last frame with a newline, not a file's
        if exc[0] is None:
            self._drawn(t0)

    def render(self) -> RenderableType:
        width = max(20, self.console.size.width - 4)
        parts: list[RenderableType] = [self._cache_panel(width), self._counters()]
        if self.state.block_tables:
            parts.append(self._sequence_table(width + 4))
        if self.show_text and self.texts:
            parts.extend(self._text_panels(width))
        return Group(*parts)

    def _map_rows(self) -> int:
        height = self.console.size.height
        return max(2, min(16, height // 3))

    def _cache_panel(self, width: int) -> Panel:
        rows = self._map_rows()
        n = self.state.num_blocks
        body = Group(
            render_block_map(self.state, width, rows),
            legend(blocks_per_cell(n, width, rows)),
        )
        snap = self.snapshot
        step = f"step {snap.step} · {snap.kind}" if snap else "starting"
        title = f"[b]{self.title}[/b] · {n} blocks × {self.block_size} tokens · {step}"
        return Panel(body, title=title, title_align="left", border_style="cyan")

    def _tokens_per_s(self) -> float:
        now = time.perf_counter()
        samples = self._rate_samples
        samples.append((now, self.tokens_total))
        while len(samples) > 2 and now - samples[1][0] >= 2.0:
            samples.popleft()
        (t0, n0), (t1, n1) = samples[0], samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def _counters(self) -> Text:
        s = self.snapshot
        text = Text(no_wrap=True, overflow="ellipsis")
        if s is None:
            return text.append("waiting for the first step…", "dim")
        total = f"/{self.total_requests}" if self.total_requests else ""
        text.append("blocks  ", "bold")
        text.append(f"{s.num_used_blocks:,} used", "green")
        text.append(" · ")
        text.append(f"{s.num_cached_free_blocks:,} cached-free", "blue")
        text.append(f" · {s.num_free_blocks - s.num_cached_free_blocks:,} free")
        if s.tier_blocks:  # the second tier (--kv-tier): evicted blocks it keeps
            text.append(f" · {s.tier_blocks:,} in the tier", "magenta")
        queue = (
            f"running {s.num_running} · waiting {s.num_waiting} · done {self.num_finished}{total}"
        )
        text.append(self._fit(len(text.plain), queue, gap=5) + "\n")
        text.append("cache   ", "bold")
        if s.queries:
            # First admissions only (cache_stats.CacheStats): the headline everywhere.
            headline = f"hit rate {s.hits / s.queries:.1%}"
            text.append(headline, "bold yellow")
            sources = (
                f"(shared {s.shared_hits / s.queries:.1%} · revived {s.revived_hits / s.queries:.1%}"
                f" · copied {s.copied_hits / s.queries:.1%}"
                + (f" · restored {s.restored_hits / s.queries:.1%}" if s.restored_hits else "")
                + f" of {s.queries:,} tokens looked up)"
            )
            text.append(self._fit(8 + len(headline), sources))
        else:
            text.append("no lookups yet", "dim")
        text.append("\nmisses  ", "bold")
        text.append_text(miss_text(s.miss_tokens, self.console.size.width))
        text.append(f"\n        evictions {s.evictions:,} · preemptions {s.preemptions:,}")
        if s.readmission_queries:
            text.append(
                f" · re-admissions: {s.readmission_hits:,} of {s.readmission_queries:,} tokens hit"
            )
        used = len(text.plain) - text.plain.rfind("\n") - 1
        if self._idle and self._ended is None:
            text.append(self._fit(used, "idle", gap=5), "dim")
        elif self._ended is None:
            text.append(self._fit(used, f"{s.kind} step · {self._tokens_per_s():,.0f} tokens/s", 5))
        else:  # the final frame: the run's own rate, not the last two seconds' (often none)
            elapsed = self._ended - self._started
            rate = self.tokens_total / elapsed if elapsed > 0 else 0.0
            done = f"done · {self.tokens_total:,} tokens in {elapsed:,.1f} s ({rate:,.0f} tokens/s)"
            text.append(self._fit(used, done, gap=5))
        return text

    def _fit(self, used: int, part: str, gap: int = 1) -> str:
        """``part`` after ``gap`` spaces on a line ``used`` columns long, or on a line of its own
        (indented under the labels) where it would not fit: a cut line would hide its end."""
        if used + gap + len(part) <= self.console.size.width:
            return " " * gap + part
        return "\n" + " " * 8 + part

    def _sequence_table(self, width: int) -> Text:
        """Live sequences and their block tables, as plain columns: a Rich Table would cost
        more to lay out than everything else in the frame. Built as one string and its spans
        (an ``append`` per block id cost more than drawing them)."""
        header = f"{'seq':>5} {'this step':>11} {'prompt':>7} {'hit':>4} {'blocks':>6}  block table"
        pieces = [header]
        spans = [Span(0, len(header), "bold")]
        pos = len(header)
        scheduled = dict(self.snapshot.scheduled) if self.snapshot else {}
        tables = self.state.block_tables
        holders = heapq.nsmallest(self.max_seq_rows, tables)
        room = max(8, width - 40)
        for seq_id in holders:
            blocks = tables[seq_id]
            n = scheduled.get(seq_id, 0)
            step = "decode" if n == 1 else (f"prefill {n}" if n else "-")
            row = (
                f"\n{seq_id:>5} {step:>11} {self.prompt_len.get(seq_id, 0):>7} "
                f"{self.hit_blocks.get(seq_id, 0):>4} {len(blocks):>6}  "
            )
            pieces.append(row)
            pos += len(row)
            labels, label_spans = self._block_labels(blocks, room, pos)
            pieces.append(labels)
            spans += label_spans
            pos += len(labels)
        if len(tables) > self.max_seq_rows:
            more = f"\n{'…':>5} {len(tables) - self.max_seq_rows} more sequences"
            pieces.append(more)
            spans.append(Span(pos, pos + len(more), "dim"))
        return Text("".join(pieces), no_wrap=True, overflow="ellipsis", spans=spans)

    def block_table_text(self, blocks: list[int], room: int) -> Text:
        """Physical block ids, shared ones coloured by ref count, cut to ``room`` columns."""
        labels, spans = self._block_labels(blocks, room, 0)
        return Text(labels, no_wrap=True, overflow="ellipsis", spans=spans)

    def _block_labels(self, blocks: list[int], room: int, pos: int) -> tuple[str, list[Span]]:
        """``block_table_text`` as a string and its spans, which start at ``pos``."""
        rc = self.state.ref_count
        pieces: list[str] = []
        spans: list[Span] = []
        used = 0
        for b in blocks:
            label = f"{b} "
            if used + len(label) > room:
                pieces.append("…")
                break
            if rc[b] > 1:
                spans.append(Span(pos + used, pos + used + len(label), shared_cell(rc[b])[1]))
            pieces.append(label)
            used += len(label)
        return "".join(pieces), spans

    def _text_panels(self, width: int) -> list[Panel]:
        lines_each = max(3, min(12, self.console.size.height // (2 * len(self.texts))))
        panels = []
        for seq_id, text in list(self.texts.items())[-4:]:
            lines = Text(text[-4000:]).wrap(self.console, width)
            tail = Text("\n").join(lines[-lines_each:])
            panels.append(Panel(tail, title=f"seq {seq_id}", title_align="left"))
        return panels


def miss_text(miss_tokens: dict[str, int], width: int | None = None) -> Text:
    """Missed tokens by reason, in ``MISS_REASONS`` order, with each one's share of the misses:
    ``cold 1,024 (60%) · partial 512 (30%) · last-block 160 (10%)``. With ``width``, after the
    8-column label: a reason that would pass it starts a new line, indented under the first."""
    reasons = [r for r in MISS_REASONS if miss_tokens.get(r)]
    reasons += [r for r, n in miss_tokens.items() if n and r not in MISS_REASONS]
    total = sum(miss_tokens[r] for r in reasons)
    text = Text()
    if not total:
        return text.append("none", "dim")
    column = 8
    for i, reason in enumerate(reasons):
        n = miss_tokens[reason]
        figure = f" {n:,} ({n / total:.0%})"
        if i:
            wrap = width is not None and column + 3 + len(reason) + len(figure) > width
            text.append("\n" + " " * 8 if wrap else " · ")
            column = 8 if wrap else column + 3
        text.append(reason, "magenta")
        text.append(figure)
        column += len(reason) + len(figure)
    return text


@contextmanager
def live_view(
    engine: LLMEngine, console: Console | None = None, **options: Any
) -> Iterator[LiveView]:
    """The live cache view following ``engine``'s events; call its ``tick()`` once per step
    from the engine's thread. Commands pass it to the request loop as an observer."""
    view = LiveView(
        engine.num_blocks, engine.block_size, console=console or Console(highlight=False), **options
    )
    unsubscribe = view.attach(engine.events)
    try:
        with view:
            yield view
    finally:
        unsubscribe()
