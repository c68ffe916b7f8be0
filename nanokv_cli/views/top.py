"""``nanokv top``'s frames: one server as the live view draws it, several as a fleet table.

One server: a status line (up or down, its instance and uptime), then the live view's own
cache panel and counters (``LiveView``, fed from the stream instead of an engine's events:
the block map, hit rate by kind, miss reasons, throughput). Several: one row per server and a
merged row, then the fleet's missed tokens by reason. ``watch`` redraws while the feeds read:
in place on a terminal (at most ``max_fps`` a second), as successive plain frames when piped.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..serve.cache_stream import CACHED
from ..serve.top import ServerView, Top, fleet_json, server_json
from .live import LiveView, miss_text

IDLE_AFTER_S = 1.0  # no step for this long: the counters say "idle", not the last step's kind


class _StreamMap:
    """A block map as ``render_block_map`` reads a ``CacheState``, made from the stream's
    codes (ref counts, and a hash mark for cached-free blocks; no block tables)."""

    def __init__(self, codes: bytes | bytearray) -> None:
        a = np.frombuffer(bytes(codes), np.uint8)
        self.num_blocks = len(a)
        self.ref_count = np.where(a == CACHED, 0, a).astype(np.uint8).tobytes()
        self.block_hash = np.where(a == CACHED, 1, -1)
        self.block_tables: dict[int, list[int]] = {}


class StreamLiveView(LiveView):
    """The live view of a server, drawn from its stream: no events, no sequence table."""

    def __init__(self, view: ServerView, console: Console) -> None:
        ident = view.identity or {}
        super().__init__(
            ident["num_blocks"],
            ident["block_size"],
            console=console,
            title=view.name,
        )
        self.rate = 0.0

    def show(self, view: ServerView) -> None:
        stats = view.stats or {}
        self.state = _StreamMap(view.codes)
        snap = view.snapshot()
        if snap is not None and stats.get("idle_s", 0.0) >= IDLE_AFTER_S:
            snap = replace(snap, kind="idle")
        self.snapshot = snap
        self.num_finished = stats.get("finished", 0)
        self.rate = float(stats.get("tokens_per_s", 0.0))

    def _tokens_per_s(self) -> float:
        return self.rate  # the server's own: the stream carries it


class Frames:
    """Renders frames, keeping each server's ``StreamLiveView`` while its instance lasts."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.views: dict[str, tuple[str, StreamLiveView]] = {}  # name -> (instance, view)

    def render(self, views: list[ServerView]) -> RenderableType:
        if len(views) == 1:
            return self.server(views[0])
        return fleet_frame(views, self.console.size.width)

    def server(self, view: ServerView) -> RenderableType:
        line = status_line(view)
        if view.codes is None or view.identity is None:
            return line
        instance = view.instances[-1]
        kept = self.views.get(view.name)
        if kept is None or kept[0] != instance:  # a restart: the new instance's cache
            kept = self.views[view.name] = (instance, StreamLiveView(view, self.console))
        live = kept[1]
        live.show(view)
        body = live.render()
        if view.status != "up":
            body = Group(Text("last seen:", style="dim"), body)
        return Group(line, body)


def status_line(view: ServerView) -> Text:
    text = Text()  # wrapped, not cut: an error is read in full
    if view.status == "up":
        ident, stats = view.identity or {}, view.stats or {}
        text.append("● up", "bold green")
        text.append(f" {view.name} · {ident.get('model', '?')}")
        text.append(f" · instance {str(ident.get('instance_id'))[:8]}")
        text.append(f" · uptime {duration(stats.get('uptime_s', 0.0))}")
        if len(view.instances) > 1:
            text.append(f" · restarted {len(view.instances) - 1}×", "yellow")
    elif view.status == "refused":
        text.append("✗ refused", "bold red")
        text.append(f" {view.name}: {view.error}")
    elif view.status == "down":
        text.append("● down", "bold red")
        text.append(f" {view.name}: {view.error} · retrying")
    else:
        text.append("… connecting", "dim")
        text.append(f" {view.name}")
    return text


def duration(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


_COLUMNS = ("server", "state", "hit", "s/r/c", "u/c/f", "run", "wait", "done", "tok/s",
            "misses")  # fmt: skip
_LEGEND = (
    "hit: hit rate · s/r/c: hit tokens shared, revived, copied (% of those looked up) · "
    "u/c/f: blocks used, cached-free, free · tok/s: prefill + decode, last 2 s"
)


def fleet_frame(views: list[ServerView], width: int) -> RenderableType:
    """One row per server, the fleet's merged row, what is wrong with the servers that are
    not up, then the fleet's misses by reason."""
    rows = [server_json(v) for v in views]
    fleet = fleet_json(rows)
    table = Table(header_style="bold underline", box=None, pad_edge=False, width=width)
    names = max(len("server"), *(len(v.name) for v in views))
    for name in _COLUMNS:
        table.add_column(
            name,
            justify="left" if name in ("server", "state", "misses") else "right",
            no_wrap=True,
            overflow="ellipsis",
            min_width=names if name == "server" else len(name),
            ratio=1 if name == "misses" else None,
        )
    for view, row in zip(views, rows):
        table.add_row(view.name, _state_cell(view), *_number_cells(row))
    up = f"{fleet['servers_up']}/{fleet['servers']} up"
    table.add_row(*(Text(c, style="bold") for c in ("fleet", up, *_number_cells(fleet))))
    title = Text("nanokv top", style="bold")
    title.append(f" · {len(views)} servers · {fleet['num_blocks']:,} blocks", style="")
    legend = Text(_LEGEND, style="dim", no_wrap=True, overflow="ellipsis")
    parts: list[RenderableType] = [title, table, legend, Text()]
    parts += [status_line(v) for v in views if v.status != "up"]
    misses = Text("fleet misses  ", style="bold", no_wrap=True, overflow="ellipsis")
    misses.append_text(miss_text(fleet["miss_tokens"]))
    return Group(*parts, misses)


def _state_cell(view: ServerView) -> Text:
    if view.status == "up":
        uptime = duration((view.stats or {}).get("uptime_s", 0.0))
        more = f" ↻{len(view.instances) - 1}" if len(view.instances) > 1 else ""  # restarts
        return Text(f"up {uptime}{more}", style="green")
    return Text(view.status, style="dim" if view.status == "connecting" else "bold red")


def _number_cells(row: dict[str, Any]) -> list[str]:
    if "blocks" not in row:
        return [""] * (len(_COLUMNS) - 2)
    q = row["cache_queries"]
    kinds = (row["shared_hit_tokens"], row["revived_hit_tokens"], row["copied_hit_tokens"])
    blocks = row["blocks"]
    misses = row["miss_tokens"]
    total = sum(misses.values())
    top = sorted(((n, r) for r, n in misses.items() if n), reverse=True)[:3]
    return [
        f"{row['hit_rate']:.1%}" if q else "-",
        "/".join(f"{100 * n / q:.0f}" for n in kinds) + "%" if q else "-",
        f"{blocks['used']:,}/{blocks['cached']:,}/{blocks['free']:,}",
        f"{row['running']:,}",
        f"{row['waiting']:,}",
        f"{row['finished']:,}",
        f"{row['tokens_per_s']:,.0f}",
        " · ".join(f"{r} {n / total:.0%}" for n, r in top) if total else "none",
    ]


def watch(top: Top, console: Console, interval: float, max_fps: float = 4.0) -> None:
    """Draw frames until Ctrl-C (KeyboardInterrupt, left to the caller), or until every
    server has refused (401, 404: nothing to wait for). On a terminal a frame is redrawn in
    place when a feed brings news (at most ``max_fps`` a second) and at least every
    ``interval``; piped, a plain frame is printed every ``interval``."""
    frames = Frames(console)
    if not console.is_terminal:
        while True:
            views = top.views()
            console.rule(time.strftime("%H:%M:%S"), style="dim")
            console.print(frames.render(views))
            if all(v.status == "refused" for v in views):
                return
            time.sleep(interval)
    gap = 1.0 / max_fps
    with Live(console=console, auto_refresh=False, vertical_overflow="crop") as live:
        while True:
            views = top.views()
            live.update(frames.render(views), refresh=True)
            if all(v.status == "refused" for v in views):
                return
            time.sleep(gap)
            top.changed.wait(max(0.0, interval - gap))
            top.changed.clear()
