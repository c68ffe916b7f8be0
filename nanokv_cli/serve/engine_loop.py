"""The engine thread: the one owner of the engine, and how tokens get back to the event loop."""

from __future__ import annotations

import asyncio
import math
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..run.loop import IDLE_TICK_S, Driver, Request, RequestQueue
from ..run.record import Run
from .metrics import Metrics


@dataclass
class ServeRequest(Request):
    """An HTTP request on its way through the engine; ``stream`` receives what it produces."""

    stream: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    ended_by: str | None = None  # "stop": the handler found a stop string and let it go
    generated: int = 0  # tokens the engine made for it (the engine thread counts)
    sent: int = 0  # of them, those its client was sent (the handler counts)


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class EngineLoop:
    """The thread that owns the engine: admits, steps and aborts; sends tokens back.

    Items sent to a request's stream, in order: ``("added", seq_id)`` or ``("rejected",
    message)``; then one ``(token_ids, finished, finish_reason, num_prompt_tokens,
    num_cached_tokens)`` per step that gave it tokens; or ``("aborted", message)`` when the
    server aborts it, ``("failed", message)`` if the engine broke.
    """

    def __init__(self, engine, run: Run, metrics: Metrics, *, on_fatal=None) -> None:
        self.engine = engine
        self.run = run
        self.metrics = metrics
        self.queue = RequestQueue()
        self.view = None  # the live view, ticked once per step
        self.after_step: Callable[[], None] | None = None  # the cache stream's, once per step
        self.on_fatal = on_fatal
        self.error: BaseException | None = None
        self.rejected = 0
        self.aborted: list[ServeRequest] = []  # their tokens may not all have reached a client
        self.abort_reason = "the server is shutting down"
        self.driver = Driver(
            engine,
            run.clock,
            max_waiting=math.inf,  # admit at once: a request that can never fit is refused now
            on_added=self._added,
            on_rejected=self._rejected,
            on_aborted=self._aborted,
            on_idle=self._idle,
            idle_interval=IDLE_TICK_S,
        )
        self.thread = threading.Thread(target=self._main, name="nanokv-engine", daemon=True)

    # Called from any thread.
    def start(self) -> None:
        self.thread.start()

    def submit(self, req: ServeRequest) -> None:
        self.queue.submit(req)

    def abort(self, req: ServeRequest) -> None:
        self.queue.abort(req)

    def stop(self, *, abort: bool) -> None:
        """Accept no more requests; with ``abort``, drop the ones in flight too."""
        if abort:
            self.queue.abort(None)
        self.queue.close()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    # The engine thread.
    def _post(self, req: ServeRequest, item: Any) -> None:
        try:
            req.loop.call_soon_threadsafe(req.stream.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def _added(self, seq_id: int, req: ServeRequest) -> None:
        self._post(req, ("added", seq_id))

    def _rejected(self, req: ServeRequest, error: Exception) -> None:
        self.rejected += 1
        self.metrics.rejected.inc()
        self._post(req, ("rejected", str(error)))

    def _aborted(self, seq_id: int, req: ServeRequest) -> None:
        self.metrics.ended(seq_id, req.ended_by or "abort")
        self.aborted.append(req)
        if req.ended_by is None:
            self._post(req, ("aborted", self.abort_reason))

    def _idle(self) -> None:
        if self.view is not None:
            self.view.idle()

    def _main(self) -> None:
        try:
            for outputs in self.driver.run(self.queue):
                self.run.observe(outputs)
                if outputs:
                    self.metrics.observe(outputs, self.engine.clock)
                    self._send(outputs)
                if self.view is not None:
                    self.view.tick()
                if self.after_step is not None:
                    self.after_step()
        except BaseException as e:  # a bug or a broken executor: fail every request, stop
            self.error = e
            traceback.print_exc()
            self._fail_all()
            if self.on_fatal is not None:
                self.on_fatal()

    def _send(self, outputs) -> None:
        """One step's tokens, in one ``call_soon_threadsafe`` per event loop."""
        requests = self.driver.requests
        batches: dict[Any, list] = {}
        for out in outputs:
            req = requests[out.seq_id]
            req.generated += len(out.new_token_ids)
            item = (
                out.new_token_ids,  # a new list every step: safe to hand over
                out.finished,
                out.finish_reason,
                out.num_prompt_tokens,
                out.num_cached_tokens,
            )
            batches.setdefault(req.loop, []).append((req.stream, item))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass

    def undelivered_tokens(self) -> int:
        """Tokens aborted requests generated that never reached their clients (in a queue, or
        generated after the client left): once the handlers are done, a summary leaves them
        out, so it counts what clients received."""
        return sum(max(0, r.generated - r.sent) for r in self.aborted)

    def _fail_all(self) -> None:
        """Close the queue and fail every request: those in the engine and those not yet in."""
        self.queue.close()
        message = "the engine failed; the server's log has the details"
        for req in list(self.driver.requests.values()):
            self._post(req, ("failed", message))
        while (item := self.queue.poll(0.0)) is not None:
            if isinstance(item, tuple):
                self._post(item[0], ("failed", message))
