"""The one request loop, shared by ``generate``, ``replay``, ``serve``, ``LLM`` and the benchmarks.

* **One request loop.** ``Driver.run(source)`` admits the requests a source says have arrived,
  steps the engine while it has work, and lets time pass (``source.wait``) when it has none,
  yielding each step's outputs. A source is ``Arrivals`` (requests known in advance, by
  timestamp, at a rate or all at once: ``generate``, ``replay``, the benchmarks) or
  ``RequestQueue`` (requests submitted from other threads, plus aborts: ``serve``).
* **One clock abstraction.** A clock is called for the engine's time and offers
  ``wait_until(t)``: ``EngineClock`` is a model run's wall clock (the engine's own), the dry
  run's ``VirtualClock`` jumps.

The engine is not thread-safe: the thread that iterates ``Driver.run`` owns it for the run.
``RequestQueue`` is the only object here other threads may touch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from ..engine.config import EngineConfig
from ..engine.core.llm_engine import LLMEngine, RequestOutput, RequestRejected
from ..engine.core.requests import Request
from .record import RunError

# -- clocks ------------------------------------------------------------------------------------


class Clock(Protocol):
    def __call__(self) -> float:
        """The engine's time, in (wall or virtual) seconds."""
        ...

    def wait_until(self, t: float) -> None:
        """Let time pass until ``t``."""
        ...


# The longest a model run waits for the next arrival; time.sleep itself overflows past
# ~292 years, and a wait this long is a mistake (a --rate of 1e-300), not a replay.
MAX_WAIT_S = 365 * 24 * 3600.0


class EngineClock:
    """A model run's wall clock: the engine's own clock (seconds since it was built)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def __call__(self) -> float:
        return self.engine.clock

    def wait_until(self, t: float) -> None:
        delay = t - self.engine.clock
        if not delay <= MAX_WAIT_S:  # NaN included
            raise RunError(
                f"the next request arrives {delay:.3g} s from now, more than a year: a model "
                "run waits for arrivals in real time (give a higher --rate, or use --dry-run)"
            )
        if delay > 0:
            time.sleep(delay)


def dry_run_engine(config: EngineConfig):
    """An engine on the model-free executor and its virtual clock; ``config`` must give
    ``num_blocks`` (there is no memory to size the cache from). Model settings are ignored."""
    from ..engine.core.dry_run import DryRunExecutor, VirtualClock

    clock = VirtualClock()
    engine = LLMEngine(DryRunExecutor(config, clock=clock), config, clock=clock)
    return engine, clock


# How often a real-time run's idle loop tells its observers so (``Driver``'s idle_interval, in
# seconds): a live view then shows the engine as it is, not its last busy step, within this and
# a frame's interval.
IDLE_TICK_S = 0.25

# -- request sources ---------------------------------------------------------------------------


class Abort:
    """A source item: abort ``request`` (or, for None, every request the driver holds)."""

    __slots__ = ("request",)

    def __init__(self, request: Request | None) -> None:
        self.request = request


class Arrivals:
    """Requests known in advance, in order of ``arrival_time`` (seconds after ``start`` on the
    engine's clock)."""

    def __init__(self, requests: Iterable[Request], start: float = 0.0) -> None:
        self._pending = iter(requests)
        self._next = next(self._pending, None)
        self.start = start
        self._last = float("-inf")

    def poll(self, now: float) -> tuple[Request, float] | None:
        """The next request if it has arrived by ``now``, with its arrival time; else None."""
        req = self._next
        if req is None:
            return None
        arrival = req.arrival_time + self.start
        if arrival > now:
            return None
        if req.arrival_time < self._last:
            raise ValueError("requests must come in order of arrival time")
        self._last = req.arrival_time
        self._next = next(self._pending, None)
        return req, arrival

    def wait(self, clock: Clock, timeout: float | None = None) -> bool:
        """Nothing is running: wait for the next arrival, or ``timeout`` seconds if sooner.
        False when none is left."""
        if self._next is None:
            return False
        t = self._next.arrival_time + self.start
        # A wait too long to be meant is left whole, for the clock to refuse.
        if timeout is not None and t - clock() <= MAX_WAIT_S:
            t = min(t, clock() + timeout)
        clock.wait_until(t)
        return True


class QueueClosed(RuntimeError):
    """The queue takes no more requests (the server is shutting down)."""


class RequestQueue:
    """Requests submitted by other threads as they arrive, and aborts.

    Thread-safe; the driver's thread polls it, others ``submit`` / ``abort``. A request's arrival
    time is when it was submitted. After ``close()`` no request is accepted and the driver's run
    ends once everything submitted has finished (aborts still go through).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: deque[Any] = deque()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._items)

    def submit(self, req: Request) -> None:
        with self._cond:
            if self._closed:
                raise QueueClosed("not accepting requests")
            self._items.append((req, time.perf_counter()))
            self._cond.notify()

    def abort(self, req: Request | None) -> None:
        """Abort ``req`` wherever it is; None aborts everything submitted so far."""
        with self._cond:
            self._items.append(Abort(req))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def poll(self, now: float) -> tuple[Request, float] | Abort | None:
        with self._cond:
            if not self._items:
                return None
            item = self._items.popleft()
        if type(item) is Abort:
            return item
        req, submitted = item
        # Arrival on the engine's clock: as long before ``now`` as it was submitted.
        return req, now - (time.perf_counter() - submitted)

    def wait(self, clock: Clock, timeout: float | None = None) -> bool:
        """Until something is submitted (or ``timeout`` seconds pass); False once closed and
        empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return True
                self._cond.wait(left)
            return bool(self._items)


class Source(Protocol):
    def poll(self, now: float) -> tuple[Request, float] | Abort | None: ...

    def wait(self, clock: Clock, timeout: float | None = None) -> bool: ...


# -- the request loop --------------------------------------------------------------------------


class Driver:
    """Runs one engine over a source of requests: the request loop of every command.

    Arrived requests beyond ``max_waiting`` (default: twice the engine's batch limit) wait in
    the source, not in the engine: under first-come-first-served the scheduler never looks past
    that many, and it keeps a long trace's tokens out of memory. Their arrival time is kept, so
    their queueing still shows in time to first token. ``on_added(seq_id, request)``,
    ``on_rejected(request, error)`` (without it, a rejection raises) and
    ``on_aborted(seq_id, request)`` are called from the loop's thread. So is ``on_idle()``,
    each time the engine runs out of work, before the loop waits for the source, and then every
    ``idle_interval`` seconds while it waits (a real-time run's observers, such as a live view,
    show the idle engine instead of its last busy step); ``waiting`` is true while it waits.
    """

    def __init__(
        self,
        engine: LLMEngine,
        clock: Clock,
        *,
        max_waiting: float | None = None,
        on_added: Callable[[int, Request], None] | None = None,
        on_rejected: Callable[[Request, RequestRejected], None] | None = None,
        on_aborted: Callable[[int, Request], None] | None = None,
        on_idle: Callable[[], None] | None = None,
        idle_interval: float | None = None,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.max_waiting = 2 * engine.scheduler.max_num_seqs if max_waiting is None else max_waiting
        self.on_added = on_added
        self.on_rejected = on_rejected
        self.on_aborted = on_aborted
        self.on_idle = on_idle
        self.idle_interval = idle_interval
        self.waiting = False
        self.requests: dict[int, Request] = {}  # seq_id -> request, until it finishes
        self._seq_ids: dict[int, int] = {}  # id(request) -> seq_id, for aborts
        self._freed = False  # an abort freed blocks since the last step

    def admit(self, source: Source) -> None:
        """Admit every request that has arrived (up to ``max_waiting``) and apply aborts."""
        engine = self.engine
        now = self.clock()
        while engine.num_waiting < self.max_waiting:
            item = source.poll(now)
            if item is None:
                return
            if type(item) is Abort:
                self._abort(item.request)
                continue
            req, arrival = item
            tokens = req.prompt_token_ids
            # A synthesized prompt knows its recipe: traces store that instead of its tokens.
            recipe = getattr(tokens, "recipe", None)
            extra = {"prompt_recipe": recipe()} if callable(recipe) else {}
            try:
                seq_id = engine.add_request(req.tokens(), req.sampling_params, arrival, **extra)
            except RequestRejected as e:
                if self.on_rejected is None:
                    raise
                self.on_rejected(req, e)
                continue
            self.requests[seq_id] = req
            self._seq_ids[id(req)] = seq_id
            if self.on_added is not None:
                self.on_added(seq_id, req)

    def run(self, source: Source) -> Iterator[list[RequestOutput]]:
        """Drive the engine until the source is exhausted and every request has finished."""
        engine = self.engine
        requests, seq_ids = self.requests, self._seq_ids
        while True:
            self.admit(source)
            if engine.has_unfinished_requests() or self._freed:
                # After an abort an idle engine steps once more, so every listener sees a
                # snapshot with the blocks freed.
                self._freed = False
                outputs = engine.step()
                yield outputs
                # Forgotten after the yield, so the consumer can still map outputs to requests.
                for out in outputs:
                    if out.finished:
                        req = requests.pop(out.seq_id, None)
                        if req is not None:
                            seq_ids.pop(id(req), None)
            elif not self._wait(source):
                return

    def _wait(self, source: Source) -> bool:
        """The engine has no work: tell ``on_idle`` and let the source's time pass."""
        if self.on_idle is not None:
            self.on_idle()
        self.waiting = True
        try:
            if self.idle_interval is None:  # one wait, however long: no one to tell meanwhile
                return source.wait(self.clock)
            return source.wait(self.clock, timeout=self.idle_interval)
        finally:
            self.waiting = False

    def abort_all(self) -> None:
        self._abort(None)

    def _abort(self, req: Request | None) -> None:
        if req is None:
            targets = list(self.requests.items())
        else:
            seq_id = self._seq_ids.get(id(req))
            targets = [] if seq_id is None else [(seq_id, req)]
        for seq_id, r in targets:
            self.engine.abort_request(seq_id)
            self.requests.pop(seq_id, None)
            self._seq_ids.pop(id(r), None)
            self._freed = True
            if self.on_aborted is not None:
                self.on_aborted(seq_id, r)
