"""uvicorn as nanokv runs it: an HTTP protocol with the bounds uvicorn lacks, and a server with
nanokv's signal handling."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .limits import ServeLimits


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
    A slow header gets a 408; a slow body is closed, and the handler logs it in one line."""

    def __init__(self, limits: ServeLimits, max_connections: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.max_connections = max_connections
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()  # the descriptor is freed now; connection_lost forgets it
            return
        self._arm(self.limits.timeout_header, self._slow_header)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.deadline is None:  # the header clock runs from the connection's start
            self._arm(self.limits.timeout_header, self._slow_header)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.limits.timeout_body, self._slow_body)

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
