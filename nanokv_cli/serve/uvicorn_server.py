"""uvicorn as nanokv runs it: an HTTP protocol with the bounds uvicorn lacks, and a server with
nanokv's signal handling."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .cache_stream import EVENTS_PATH
from .limits import ServeLimits

_log = logging.getLogger("uvicorn.error")  # uvicorn's handlers: the server's log, its format
# The kernel's send buffer of a cache-stream connection (it doubles it): a few seconds of frames.
WATCHER_SEND_BUFFER = 32 << 10


def uvicorn_config(app, limits: ServeLimits, *, live: bool, shutdown_timeout: float):
    """The server's settings; made inside the live view, so uvicorn's log handlers write above
    it (and quieter under it: no access log)."""
    config = uvicorn.Config(
        app,
        log_level="warning" if live else "info",
        access_log=not live,
        timeout_graceful_shutdown=shutdown_timeout,
        lifespan="off",
        ws="none",
        http=functools.partial(BoundedHttp, limits, limits.max_connections()),
        timeout_keep_alive=limits.timeout_keep_alive,
    )
    errors = logging.getLogger("uvicorn.error")  # configured by the Config just made
    if not any(isinstance(f, CancelledAtShutdown) for f in errors.filters):
        errors.addFilter(CancelledAtShutdown())
    return config


class CancelledAtShutdown(logging.Filter):
    """A request still running when ``--shutdown-timeout`` runs out is cancelled: the
    documented way down, so one line says so instead of uvicorn's traceback of every layer."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, asyncio.CancelledError):
            record.msg = (
                "nanokv: a request in flight was cancelled: the shutdown timeout "
                "(--shutdown-timeout) ran out before it finished"
            )
            record.args = ()
            record.exc_info = record.exc_text = None
        return True


class BoundedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds uvicorn lacks: a connection beyond
    ``max_connections`` is closed as it is accepted (the descriptors stay bounded), a request's
    headers must arrive within ``timeout_header`` of its first byte (or of the connection's
    start: a silent connection is a slow header) and its body within ``timeout_body`` of them.
    A slow header gets a 408; a slow body is closed, and the handler logs it in one line.

    A response its client takes nothing of for ``timeout_write`` (the kernel's buffer full and
    writing paused) is closed too, with one line: else a cache-stream watcher that never reads
    would hold its place (of ``max_watchers``) for good. A watcher's stream has no buffer of
    ours and a small kernel one, so one that reads nothing stalls once the kernel's fill (the
    stream fills them fast while a watcher is being refused: ``CacheStream.open``)."""

    def __init__(self, limits: ServeLimits, max_connections: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.max_connections = max_connections
        self.deadline: asyncio.TimerHandle | None = None
        self.stalled: asyncio.TimerHandle | None = None  # set while writing is paused

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()  # the descriptor is freed now; connection_lost forgets it
            return
        self._arm(self.limits.timeout_header, self._slow_header)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unstall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.stalled is None:
            self.stalled = self.loop.call_later(self.limits.timeout_write, self._slow_reader)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def _unstall(self) -> None:
        if self.stalled is not None:
            self.stalled.cancel()
            self.stalled = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.deadline is None:  # the header clock runs from the connection's start
            self._arm(self.limits.timeout_header, self._slow_header)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.limits.timeout_body, self._slow_body)
        if self.scope["path"].rstrip("/") == EVENTS_PATH:
            # A watcher's frames wait in the kernel only, a bounded amount of it: one that
            # reads nothing pauses writing once that is full.
            self.transport.set_write_buffer_limits(high=0)
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, WATCHER_SEND_BUFFER)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _slow_header(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # no response is being written
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            )
        self.transport.close()

    def _slow_reader(self) -> None:
        self.stalled = None
        if self.transport.is_closing():
            return
        who = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        path = self.scope["path"] if self.cycle is not None else "?"
        _log.warning(
            'nanokv: %s took nothing of "%s" for %g s; closed',
            who,
            path,
            self.limits.timeout_write,
        )
        self.transport.abort()  # close() would wait for the buffer to drain: never

    def _slow_body(self) -> None:
        self.deadline = None
        if self.cycle is not None and not self.transport.is_closing():
            self.cycle.scope["nanokv.body_timeout"] = self.limits.timeout_body
            self.transport.close()  # the handler sees a disconnect


class UvicornServer(uvicorn.Server):
    """uvicorn's server with nanokv's signal handling: the first SIGTERM drains, SIGINT (or a
    second signal) aborts what is in flight; the signals are not re-raised afterwards."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int, bool], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal
        self.signals: list[int] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_start: Callable[[], None] | None = None  # called in the loop, before serving
        self.on_shutdown: Callable[[], None] | None = None  # ...as shutting down begins

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        if self.on_start is not None:
            self.on_start()
        await super().serve(sockets=sockets)

    async def shutdown(self, sockets=None) -> None:
        if self.on_shutdown is not None:  # on a signal or an engine failure alike
            self.on_shutdown()
        await super().shutdown(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        again = self.should_exit
        self.signals.append(sig)
        self.should_exit = True
        if again:
            self.force_exit = True
        if self.loop is not None:  # locks are taken in the loop, not in the signal handler
            self.loop.call_soon_threadsafe(self.on_signal, sig, again)
