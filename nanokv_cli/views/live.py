"""The live view: block map, counters, sequences and streamed text, redrawn while the engine runs.

Its event listener only records (``list.append``: no Python code per event). The driver calls
``tick()`` once per step: recorded events are applied in small batches (``CacheState.apply_all``)
and a frame is drawn only when one is due: at most ``max_fps`` a second, and never more often
than keeps drawing under ``budget`` (default 2%) of the elapsed time, however slow a frame is
on this terminal. ``scripts/bench_live_view.py`` measures what it costs a replay.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from ..engine.events import (
    BlockHit,
    CacheState,
    Event,
    EventBus,
    SequenceAdded,
    SequenceFinished,
    SequencePreempted,
    StepSnapshot,
)
from .blockmap import blocks_per_cell, legend, render_block_map, shared_cell

# Recorded events are applied once this many pile up, even if no frame is due. Small batches
# matter: events held longer survive garbage-collector passes and get promoted, and the
# resulting full collections cost more than applying the events (measured: +50% vs +12% on a
# dry run with 4096 vs 256).
MAX_PENDING = 256


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
        self.state = CacheState(num_blocks)
        self.snapshot: StepSnapshot | None = None
        self.prompt_len: dict[int, int] = {}
        self.hit_blocks: dict[int, int] = {}
        self.texts: dict[int, str] = {}
        self.num_finished = 0
        self.tokens_total = 0
        self.frames = 0
        self.draw_time = 0.0  # seconds spent drawing frames
        self.apply_time = 0.0  # seconds spent applying recorded events
        self._pending: list[Event] = []
        self._rate_samples: deque[tuple[float, int]] = deque()
        self._next_frame = 0.0
        self._live: Live | None = None

    # -- listening ---------------------------------------------------------------------------

    def attach(self, events: EventBus) -> Callable[[], None]:
        """Record ``events`` from now on; returns the unsubscribe function."""
        return events.subscribe(self._pending.append)

    def tick(self) -> None:
        """Call once per engine step: draws a frame when one is due."""
        if time.perf_counter() >= self._next_frame:
            self.refresh()
        elif len(self._pending) > MAX_PENDING:
            self.update()

    def update(self) -> None:
        """Apply the recorded events to the view's books."""
        t0 = time.perf_counter()
        batch = self._pending[:]
        self._pending.clear()
        for event in self.state.apply_all(batch):
            t = type(event)
            if t is StepSnapshot:
                self.snapshot = event
                self.tokens_total += event.num_prefill_tokens + event.num_decode_tokens
            elif t is BlockHit:
                self.hit_blocks[event.seq_id] = self.hit_blocks.get(event.seq_id, 0) + 1
            elif t is SequenceAdded:
                self.prompt_len[event.seq_id] = len(event.prompt_token_ids)
                # Only the length is needed here; the state need not keep every prompt.
                del self.state.prompts[event.seq_id]
            elif t is SequenceFinished:
                self.num_finished += 1
                self.prompt_len.pop(event.seq_id, None)
                self.hit_blocks.pop(event.seq_id, None)
            elif t is SequencePreempted:
                self.hit_blocks.pop(event.seq_id, None)
        self.apply_time += time.perf_counter() - t0

    def set_text(self, seq_id: int, text: str) -> None:
        """The text generated so far for ``seq_id`` (shown when ``show_text``)."""
        self.texts[seq_id] = text

    # -- drawing -------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Apply what was recorded and draw a frame now."""
        self.update()
        t0 = time.perf_counter()
        if self._live is not None:
            self._live.update(self.render(), refresh=True)
        t1 = time.perf_counter()
        self.frames += 1
        self.draw_time += t1 - t0
        # Drawing, not event bookkeeping (which any rate would pay), is what the budget bounds.
        self._next_frame = t1 + max(self.min_interval, (t1 - t0) / self.budget)

    def __enter__(self) -> LiveView:
        self._live = Live(
            self.render(),
            console=self.console,
            auto_refresh=False,
            transient=self.transient,
            vertical_overflow="crop",
        )
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            if exc[0] is None:
                self.refresh()
            self._live.__exit__(*exc)
            self._live = None

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
        text.append(
            f"     running {s.num_running} · waiting {s.num_waiting} · done {self.num_finished}{total}\n"
        )
        text.append("cache   ", "bold")
        if s.queries:
            text.append(f"hit rate {s.hits / s.queries:.1%}", "bold yellow")
            text.append(
                f" (shared {s.shared_hits / s.queries:.1%} · revived {s.revived_hits / s.queries:.1%}"
                f" of {s.queries:,} tokens looked up)"
            )
        else:
            text.append("no lookups yet", "dim")
        text.append(f"\n        evictions {s.evictions:,} · preemptions {s.preemptions:,}")
        text.append(f"     {s.kind} step · {self._tokens_per_s():,.0f} tokens/s")
        return text

    def _sequence_table(self, width: int) -> Text:
        """Live sequences and their block tables, as plain columns: a Rich Table would cost
        more to lay out than everything else in the frame."""
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(
            f"{'seq':>5} {'this step':>11} {'prompt':>7} {'hit':>4} {'blocks':>6}  block table",
            "bold",
        )
        scheduled = dict(self.snapshot.scheduled) if self.snapshot else {}
        holders = sorted(self.state.block_tables.items())
        room = max(8, width - 40)
        for seq_id, blocks in holders[: self.max_seq_rows]:
            n = scheduled.get(seq_id, 0)
            step = "decode" if n == 1 else (f"prefill {n}" if n else "-")
            text.append(
                f"\n{seq_id:>5} {step:>11} {self.prompt_len.get(seq_id, 0):>7} "
                f"{self.hit_blocks.get(seq_id, 0):>4} {len(blocks):>6}  "
            )
            text.append_text(self.block_table_text(blocks, room))
        if len(holders) > self.max_seq_rows:
            text.append(f"\n{'…':>5} {len(holders) - self.max_seq_rows} more sequences", "dim")
        return text

    def block_table_text(self, blocks: list[int], room: int) -> Text:
        """Physical block ids, shared ones coloured by ref count, cut to ``room`` columns."""
        text = Text(no_wrap=True, overflow="ellipsis")
        rc = self.state.ref_count
        used = 0
        for b in blocks:
            label = f"{b} "
            used += len(label)
            if used > room:
                text.append("…")
                break
            text.append(label, shared_cell(rc[b])[1] if rc[b] > 1 else None)
        return text

    def _text_panels(self, width: int) -> list[Panel]:
        lines_each = max(3, min(12, self.console.size.height // (2 * len(self.texts))))
        panels = []
        for seq_id, text in list(self.texts.items())[-4:]:
            lines = Text(text[-4000:]).wrap(self.console, width)
            tail = Text("\n").join(lines[-lines_each:])
            panels.append(Panel(tail, title=f"seq {seq_id}", title_align="left"))
        return panels
