"""``nanokv top``: the cache of running servers, read from their cache streams.

Each server's ``GET /v1/nanokv/events`` (``cache_stream.py``) is read by a ``Feed``, a thread
of its own that keeps a ``ServerView``: the server's identity, its block map (one code per
block) and its last stats. A feed reconnects whenever its stream ends or stalls (no frame for
``read_timeout`` seconds, where the server sends one at least every second); meanwhile the
server shows as down. A server that comes back with another ``instance_id`` was restarted: its
view starts over from the new instance's snapshot. A 401 (the API key) or 404 (no cache
stream: not a nanokv server) is final for that server: retrying would not change the answer.

``Top`` runs one feed per URL; ``server_json`` and ``fleet_json`` are the numbers every view
(and ``--json``) shows, named as ``report.cache_numbers`` and /metrics name them.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from ..engine.core.cache_numbers import cache_numbers
from ..engine.core.cache_stats import MISS_REASONS
from ..engine.core.events import StepSnapshot, event_from_dict
from ..trace.checks import _check_event
from .cache_stream import CACHED, EVENTS_PATH, PROTOCOL, decode_codes

MAX_LINE = 64 << 20  # a frame's data line: a snapshot of millions of blocks fits many times
MAX_DATA = MAX_LINE  # a frame's data lines together: one line or many, the same bound
# Control characters (C0, DEL, C1) and the bidi controls: a server's text reaching the
# terminal raw could retitle it, clear it or reorder what it shows. They are shown escaped.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
RETRY_S = (0.5, 1.0, 2.0)  # waits between reconnections, then the last one again


class TopError(ValueError):
    """A bad URL, or a server that answered in a way that cannot be watched."""


class _Refused(Exception):
    """The server said no in a way that retrying will not change (401, 404, 400)."""


class _ProtocolError(Exception):
    """The stream broke the cache stream's rules: reconnect and start from a snapshot."""


@dataclass(frozen=True)
class Target:
    """Where a server's cache stream is: ``scheme://host:port`` and any path before /v1."""

    url: str  # as given
    scheme: str
    host: str
    port: int
    base_path: str

    @property
    def name(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}{self.base_path}"


def parse_url(url: str) -> Target:
    """``http://host:port`` (or ``host:port``; a trailing ``/v1``, as OpenAI clients are
    given, is dropped). TopError says what is wrong."""
    text = url.strip()
    if not text:
        raise TopError("a server URL is empty")
    parts = urlsplit(text if "://" in text else f"http://{text}")
    if parts.scheme not in ("http", "https"):
        raise TopError(f"{url}: not an http:// or https:// URL")
    if parts.query or parts.fragment:
        raise TopError(f"{url}: a server URL takes no query or fragment")
    try:
        port = parts.port
    except ValueError:
        raise TopError(f"{url}: the port is not a number from 0 to 65535") from None
    if not parts.hostname:
        raise TopError(f"{url}: no host (e.g. http://127.0.0.1:8000)")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    default = 443 if parts.scheme == "https" else 80
    return Target(url, parts.scheme, parts.hostname, port or default, path)


# -- one server ---------------------------------------------------------------------------------


@dataclass
class ServerView:
    """What is known of one server. ``status``: connecting, up, down, or refused (final)."""

    target: Target
    status: str = "connecting"
    error: str | None = None
    identity: dict[str, Any] | None = None
    codes: bytearray | None = None
    stats: dict[str, Any] | None = None
    frame: int = -1
    instances: list[str] = field(default_factory=list)  # instance ids seen, oldest first
    attempts: int = 0  # connections tried (one per failure, the first included)
    received: float = 0.0  # time.monotonic() of the last frame

    @property
    def name(self) -> str:
        return self.target.name

    def copy(self) -> ServerView:
        codes = None if self.codes is None else bytearray(self.codes)
        return replace(self, codes=codes, instances=list(self.instances))

    def apply(self, event: str, data: Any) -> None:
        """One frame of the stream (``cache_stream.py`` names them); _ProtocolError if it
        breaks the stream's rules."""
        if not isinstance(data, dict):
            raise _ProtocolError("a frame is not a JSON object")
        if event == "snapshot":
            self._apply_snapshot(data)
        elif event == "delta":
            self._apply_delta(data)
        elif event == "bye":
            raise _ProtocolError(str(data.get("reason") or "the server ended the stream"))
        else:
            return  # a newer server's event: skip it
        self.stats = checked_stats(data.get("stats"))
        self.status, self.error = "up", None

    def _apply_snapshot(self, data: dict[str, Any]) -> None:
        ident = data.get("server")
        if not isinstance(ident, dict) or ident.get("protocol") != PROTOCOL:
            raise _ProtocolError(f"not a cache stream of protocol {PROTOCOL}")
        n, bs = ident.get("num_blocks"), ident.get("block_size")
        if not (type(n) is int and n > 0 and type(bs) is int and bs > 0):
            raise _ProtocolError("a snapshot without num_blocks and block_size")
        if not isinstance(data.get("blocks"), str) or type(data.get("frame")) is not int:
            raise _ProtocolError("a snapshot without its blocks and frame")
        try:
            self.codes = decode_codes(data["blocks"], n)
        except ValueError as e:
            raise _ProtocolError(str(e)) from None
        instance = str(ident.get("instance_id"))
        if not self.instances or self.instances[-1] != instance:
            self.instances.append(instance)  # a restart (or the first time)
        self.identity, self.frame = ident, data["frame"]

    def _apply_delta(self, data: dict[str, Any]) -> None:
        codes = self.codes
        if codes is None or data.get("frame") != self.frame + 1:
            raise _ProtocolError(f"frame {data.get('frame')} does not follow {self.frame}")
        blocks = data.get("blocks")
        if not isinstance(blocks, list):
            raise _ProtocolError("a delta without its blocks")
        n = len(codes)
        for pair in blocks:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise _ProtocolError("a delta's block is not [block_id, code]")
            b, code = pair
            if not (type(b) is int and 0 <= b < n and type(code) is int and 0 <= code <= 255):
                raise _ProtocolError(f"a delta's block {pair!r} is out of range")
            codes[b] = code
        self.frame += 1

    def snapshot(self) -> StepSnapshot | None:
        """The server's last step, as the engine emitted it (without ``scheduled``)."""
        step = (self.stats or {}).get("step")
        if not isinstance(step, dict):
            return None
        try:
            return event_from_dict({"type": "StepSnapshot", **step})
        except TypeError:
            return None


# A frame's stats (cache_stream.py): each figure a number when present, so what computes with
# them (views, --json, the fleet's sums) never meets a string or a list from the wire.
_STAT_NUMBERS = ("idle_s", "finished", "tokens_total", "tokens_per_s", "uptime_s", "time")


def checked_stats(stats: Any) -> dict[str, Any] | None:
    """A frame's ``stats`` if every figure in it has its type; _ProtocolError names the first
    that has not (the server is then shown down with that reason, not a traceback)."""
    if stats is None:
        return None
    if not isinstance(stats, dict):
        raise _ProtocolError("a frame's stats are not a JSON object")
    for name in _STAT_NUMBERS:
        value = stats.get(name)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
            raise _ProtocolError(f"a frame's stats.{name} is not a number: {str(value)[:40]}")
    step = stats.get("step")
    if step is not None:
        _check_step(step)
    return stats


def _check_step(step: Any) -> None:
    """The last step's counters, as the engine's StepSnapshot types them."""
    if not isinstance(step, dict):
        raise _ProtocolError("a frame's stats.step is not a JSON object")
    try:
        snapshot = event_from_dict({"type": "StepSnapshot", **step, "scheduled": []})
        _check_event(snapshot, num_blocks=1)  # the type tests a trace's readers use
    except (TypeError, ValueError) as e:
        raise _ProtocolError(f"a frame's stats.step is malformed ({str(e)[:80]})") from None


class Feed(threading.Thread):
    """Reads one server's stream into ``view`` (under ``lock``) until ``stop()``."""

    def __init__(
        self,
        target: Target,
        api_key: str | None,
        lock: threading.Lock,
        on_change: Callable[[], None],
        read_timeout: float = 5.0,
    ) -> None:
        super().__init__(name=f"nanokv-top {target.name}", daemon=True)
        self.view = ServerView(target)
        self.api_key = api_key
        self.lock = lock
        self.on_change = on_change
        self.read_timeout = read_timeout
        self._stopped = threading.Event()
        self._conn: http.client.HTTPConnection | None = None

    def stop(self) -> None:
        self._stopped.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:  # wakes the read this thread is blocked in (close alone may not)
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def run(self) -> None:
        failures = 0
        while not self._stopped.is_set():
            try:
                self._read()
            except _Refused as e:
                self._set(status="refused", error=printable(str(e)))
                return
            except (OSError, http.client.HTTPException, _ProtocolError, ValueError) as e:
                if self._stopped.is_set():
                    return
                with self.lock:
                    failures = 0 if self.view.status == "up" else failures + 1
                self._set(status="down", error=printable(_reason(e)))
            finally:
                self._close()
            self._stopped.wait(RETRY_S[min(failures, len(RETRY_S) - 1)])

    def _set(self, **changes: Any) -> None:
        with self.lock:
            for key, value in changes.items():
                setattr(self.view, key, value)
            self.view.attempts += 1
        self.on_change()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _read(self) -> None:
        t = self.view.target
        cls = http.client.HTTPSConnection if t.scheme == "https" else http.client.HTTPConnection
        self._conn = conn = cls(t.host, t.port, timeout=self.read_timeout)
        headers = {"Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn.request("GET", t.base_path + EVENTS_PATH, headers=headers)
        response = conn.getresponse()
        _check_response(response, self.api_key is not None)
        for event, data in _sse_frames(response):
            with self.lock:
                self.view.apply(event, data)
                self.view.received = time.monotonic()
            self.on_change()
            if self._stopped.is_set():
                return
        raise _ProtocolError("the server closed the stream")


def _check_response(response: http.client.HTTPResponse, sent_key: bool) -> None:
    status = response.status
    if status == 200:
        kind = response.getheader("Content-Type", "")
        if not kind.startswith("text/event-stream"):
            raise _Refused(f"not a cache stream (Content-Type {kind or 'none'})")
        return
    message = _error_message(response.read(64 << 10))
    if status == 401:
        why = "refused the API key" if sent_key else "wants an API key"
        raise _Refused(f"401: the server {why} (give --api-key or NANOKV_API_KEY)")
    if status == 404:
        raise _Refused(f"404: no cache stream at {EVENTS_PATH} (not a nanokv server?)")
    if 400 <= status < 500 and status != 429:
        raise _Refused(f"HTTP {status}: {message}")
    raise OSError(f"HTTP {status}: {message}")  # 503 (too many watchers, stopping): retried


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace").strip() or "no message"


def _sse_frames(response: http.client.HTTPResponse) -> Iterable[tuple[str, Any]]:
    """Server-sent events as ``(event, JSON data)``, every string in them ``printable``;
    comments and ids are skipped. A frame's data lines hold ``MAX_DATA`` bytes at most."""
    event, data, size = "message", [], 0
    while True:
        line = response.readline(MAX_LINE + 1)
        if not line:
            return
        if not line.endswith(b"\n"):
            raise _ProtocolError(f"a line longer than {MAX_LINE:,} bytes")
        line = line.rstrip(b"\r\n")
        if not line:
            if data:
                try:
                    yield event, printable_tree(json.loads(b"\n".join(data)))
                except ValueError:
                    raise _ProtocolError("a frame's data is not JSON") from None
                except RecursionError:  # deeper than the parser's stack: not one of ours
                    raise _ProtocolError("a frame's data is nested too deeply") from None
            event, data, size = "message", [], 0
            continue
        name, _, value = line.partition(b":")
        value = value[1:] if value.startswith(b" ") else value
        if name == b"event":
            event = value.decode("utf-8", "replace")
        elif name == b"data":
            size += len(value) + 1
            if size > MAX_DATA:  # many short lines: the buffer grows as fast as with one long
                raise _ProtocolError(f"a frame's data longer than {MAX_DATA:,} bytes")
            data.append(value)


def printable(text: str) -> str:
    """``text`` with every control character escaped (``\\x1b``): safe on a terminal."""
    if text.isprintable():  # the usual case, checked in C (control characters are not)
        return text
    return _UNPRINTABLE.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable_tree(data: Any) -> Any:
    """A decoded frame with its strings (keys too) ``printable``, changed in place; walked
    without recursion, since the server chooses the depth."""
    if isinstance(data, str):
        return printable(data)
    todo = [data]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            items = list(node.items())
            node.clear()
            for key, value in items:
                node[printable(key)] = printable(value) if isinstance(value, str) else value
            todo += [v for v in node.values() if isinstance(v, dict | list)]
        elif isinstance(node, list):
            for i, value in enumerate(node):
                if isinstance(value, str):
                    node[i] = printable(value)
                elif isinstance(value, dict | list):
                    todo.append(value)
    return data


def _reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError):  # socket.timeout too
        return "no answer (timed out)"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the host ({e.strerror})"
    if isinstance(e, http.client.RemoteDisconnected | ConnectionResetError):
        return "the connection was closed"
    text = str(e).strip()
    return text or type(e).__name__


# -- several servers ----------------------------------------------------------------------------


class Top:
    """One feed per server, started together; ``views()`` copies what each one knows."""

    def __init__(
        self, urls: list[str], api_key: str | None = None, *, read_timeout: float = 5.0
    ) -> None:
        targets = [parse_url(u) for u in urls]  # every URL checked before anything connects
        if not targets:
            raise TopError("give at least one server URL")
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.feeds = [Feed(t, api_key, self.lock, self.changed.set, read_timeout) for t in targets]

    def __enter__(self) -> Top:
        for feed in self.feeds:
            feed.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for feed in self.feeds:
            feed.stop()
        for feed in self.feeds:
            feed.join(timeout=2.0)

    def views(self) -> list[ServerView]:
        with self.lock:
            return [feed.view.copy() for feed in self.feeds]

    def wait(self, predicate: Callable[[list[ServerView]], bool], timeout: float) -> bool:
        """Wait until ``predicate(views())`` holds (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while not predicate(self.views()):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.wait(min(left, 0.5))
            self.changed.clear()
        return True


def settled(views: list[ServerView]) -> bool:
    """Every server up, or tried at least once: a first frame can be drawn."""
    return all(v.status == "up" or v.attempts > 0 for v in views)


def read_once(urls: list[str], api_key: str | None, timeout: float = 10.0) -> list[ServerView]:
    """Each server's state as its stream's first frame gives it (``--once``)."""
    with Top(urls, api_key) as top:
        top.wait(settled, timeout)
        return top.views()


# -- the numbers --------------------------------------------------------------------------------


def block_counts(codes: bytes | bytearray) -> dict[str, int]:
    """Blocks by state from the map: used (ref count > 0, as /metrics counts them), of which
    shared (> 1), cached (free, hash kept) and free (clean)."""
    counts = [0] * 256
    for code, n in _histogram(codes):
        counts[code] = n
    used = sum(counts[1:CACHED])
    return {"used": used, "shared": used - counts[1], "cached": counts[CACHED], "free": counts[0]}


def _histogram(codes: bytes | bytearray) -> list[tuple[int, int]]:
    import numpy as np

    hist = np.bincount(np.frombuffer(bytes(codes), np.uint8), minlength=256)
    return [(int(c), int(n)) for c, n in enumerate(hist) if n]


def server_json(view: ServerView) -> dict[str, Any]:
    """One server's row: its identity, blocks by state, queue and rate, and cache numbers."""
    ident = view.identity or {}
    out: dict[str, Any] = {
        "url": view.target.url,
        "status": view.status,
        "error": view.error,
        "instance_id": ident.get("instance_id"),
        "restarts": max(0, len(view.instances) - 1),
    }
    if view.status != "up" or view.codes is None:
        return out
    snap, stats = view.snapshot(), view.stats or {}
    out.update(
        model=ident.get("model"),
        block_size=ident.get("block_size"),
        num_blocks=ident.get("num_blocks"),
        started=ident.get("started"),
        uptime_s=stats.get("uptime_s"),
        step=snap.step if snap else 0,
        blocks=block_counts(view.codes),
        running=snap.num_running if snap else 0,
        waiting=snap.num_waiting if snap else 0,
        finished=stats.get("finished", 0),
        tokens_total=stats.get("tokens_total", 0),
        tokens_per_s=stats.get("tokens_per_s", 0.0),
        **cache_numbers(snap),
    )
    return out


_SUMMED = ("num_blocks", "running", "waiting", "finished", "tokens_total", "tokens_per_s")
_SUMMED_CACHE = (
    "cache_queries",
    "cache_hits",
    "shared_hit_tokens",
    "revived_hit_tokens",
    "copied_hit_tokens",
    "readmission_queries",
    "readmission_hits",
    "evictions",
    "preemptions",
)


def fleet_json(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The servers that are up, merged: sums, and the hit rate of all their lookups."""
    up = [r for r in rows if r["status"] == "up" and "blocks" in r]
    out: dict[str, Any] = {"servers": len(rows), "servers_up": len(up)}
    for key in (*_SUMMED, *_SUMMED_CACHE):
        out[key] = sum(r[key] for r in up)
    out["blocks"] = {
        k: sum(r["blocks"][k] for r in up) for k in ("used", "shared", "cached", "free")
    }
    misses = {reason: sum(r["miss_tokens"].get(reason, 0) for r in up) for reason in MISS_REASONS}
    out["miss_tokens"] = misses
    out["hit_rate"] = out["cache_hits"] / out["cache_queries"] if out["cache_queries"] else 0.0
    return out


def top_json(views: list[ServerView]) -> dict[str, Any]:
    rows = [server_json(v) for v in views]
    return {"servers": rows, "fleet": fleet_json(rows)}
