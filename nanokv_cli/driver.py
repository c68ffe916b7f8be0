"""Run orchestration shared by ``generate``, ``replay``, ``serve`` and the benchmark scripts.

* **One request loop.** ``Driver.run(source)`` admits the requests a source says have arrived,
  steps the engine while it has work, and lets time pass (``source.wait``) when it has none,
  yielding each step's outputs. A source is ``Arrivals`` (requests known in advance, by
  timestamp, at a rate or all at once: ``generate``, ``replay``, the benchmarks) or
  ``RequestQueue`` (requests submitted from other threads, plus aborts: ``serve``).
* **One clock abstraction.** A clock is called for the engine's time and offers
  ``wait_until(t)``: ``EngineClock`` is a model run's wall clock (the engine's own), the dry
  run's ``VirtualClock`` jumps.
* **One run record.** ``Run`` subscribes a run's listeners (``RunStats``, the ``--record``
  trace, ``--per-request`` records) and builds its report, with the same numbers every view
  uses.

The engine is not thread-safe: the thread that iterates ``Driver.run`` owns it for the run.
``RequestQueue`` is the only object here other threads may touch. Typer, Rich and the views
are not imported here at module level; the CLI keeps option declarations and output.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any, Protocol

from . import paths
from .engine.config import EngineConfig
from .engine.llm_engine import LLMEngine, RequestOutput, RequestRejected
from .engine.loader import load_tokenizer
from .engine.requests import Request, all_at_once, at_rate
from .engine.sampling_params import SamplingParams
from .prompts import PromptFile, PromptRequest

__all__ = [
    "Abort",
    "Arrivals",
    "Driver",
    "EngineClock",
    "PromptEncoder",
    "QueueClosed",
    "Request",
    "RequestQueue",
    "Run",
    "RunError",
    "build_requests",
    "dry_run_engine",
    "live_view",
    "open_output",
]


class RunError(ValueError):
    """A problem with a run's input or output files; the CLI shows it as one line."""


# -- prompts -----------------------------------------------------------------------------------


# A synthesized prompt longer than this (8 bytes a token) and than the run admits is rejected
# before its tokens are made.
EAGER_REJECT_TOKENS = 1 << 20


class PromptEncoder:
    """Token ids of prompt-file requests; loads the tokenizer only if some request has text.

    ``max_prompt_tokens``, the longest prompt the run could admit, is checked before any work:
    text with more bytes than that many tokens can hold never reaches the tokenizer, and a
    long synthesized prompt over it is rejected (as the engine would) before its tokens are
    made.
    """

    def __init__(
        self, model: str | None, chat: bool, tokenizer=None, max_prompt_tokens: int | None = None
    ) -> None:
        self.model = model
        self.chat = chat
        self._tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model)
        return self._tokenizer

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def text(self, prompt: str) -> list[int]:
        if self.chat:
            return self.messages([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt, max_tokens=self.max_prompt_tokens)

    def messages(self, messages: list[dict[str, str]]) -> list[int]:
        for m in messages:  # before the template copies them around
            self.tokenizer.check_text(m["content"], self.max_prompt_tokens)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template already wrote every special token the model expects.
        return self.tokenizer.encode(
            text, add_special_tokens=False, max_tokens=self.max_prompt_tokens
        )

    def request(self, req: PromptRequest) -> list[int] | Callable[[], list[int]]:
        if req.token_source is not None:
            n, limit = req.num_prompt_tokens, self.max_prompt_tokens
            # Only where making the tokens would cost real memory: the engine's own rejection
            # of a shorter one says what to change.
            if n is not None and limit is not None and n > max(limit, EAGER_REJECT_TOKENS):
                return _Rejected(
                    f"the prompt ({n:,} tokens) is longer than the {limit:,} this run admits"
                )
            return req.token_source
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        if req.messages is not None:
            return self.messages(req.messages)
        return self.text(req.prompt or "")


class _Rejected:
    """A prompt refused before its tokens were made: asking for them rejects the request."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __call__(self) -> list[int]:
        raise RequestRejected(self.reason)


def encode_prompts(pf: PromptFile, encoder: PromptEncoder) -> list:
    """Each request's token ids (or the callable that makes them), in file order; a request
    that cannot be encoded is reported by its file and line."""
    out = []
    for r in pf.requests:
        try:
            out.append(encoder.request(r))
        except ValueError as e:
            raise RunError(f"{pf.path} line {r.line}: {e}") from None
    return out


def build_requests(
    pf: PromptFile, encoder: PromptEncoder, defaults: SamplingParams, rate: float | None
) -> list[Request]:
    """Engine requests in arrival order: the file's timestamps, a Poisson ``rate``, or all at 0."""
    requests = [
        Request(tokens, r.sampling_params(defaults), r.timestamp or 0.0, tag=r.line)
        for r, tokens in zip(pf.requests, encode_prompts(pf, encoder))
    ]
    if rate is not None:
        if math.isinf(rate):
            return list(all_at_once(requests))
        timed = list(at_rate(requests, rate))
        if timed and not math.isfinite(timed[-1].arrival_time):
            # Gaps of ~1/rate seconds add up past the largest float: no arrival time is left.
            raise RunError(
                f"--rate {rate!r} is too low: the arrival times of {len(timed):,} requests "
                "overflow; give a higher rate"
            )
        return timed
    if pf.has_timestamps:
        return sorted(requests, key=lambda q: q.arrival_time)
    return list(all_at_once(requests))


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
    from .engine.dry_run import DryRunExecutor, VirtualClock

    clock = VirtualClock()
    engine = LLMEngine(DryRunExecutor(config, clock=clock), config, clock=clock)
    return engine, clock


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

    def wait(self, clock: Clock) -> bool:
        """Nothing is running: wait for the next arrival. False when none is left."""
        if self._next is None:
            return False
        clock.wait_until(self._next.arrival_time + self.start)
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

    def wait(self, clock: Clock) -> bool:
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            return bool(self._items)


class Source(Protocol):
    def poll(self, now: float) -> tuple[Request, float] | Abort | None: ...

    def wait(self, clock: Clock) -> bool: ...


# -- the request loop --------------------------------------------------------------------------


class Driver:
    """Runs one engine over a source of requests: the request loop of every command.

    Arrived requests beyond ``max_waiting`` (default: twice the engine's batch limit) wait in
    the source, not in the engine: under first-come-first-served the scheduler never looks past
    that many, and it keeps a long trace's tokens out of memory. Their arrival time is kept, so
    their queueing still shows in time to first token. ``on_added(seq_id, request)``,
    ``on_rejected(request, error)`` (without it, a rejection raises) and
    ``on_aborted(seq_id, request)`` are called from the loop's thread.
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
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.max_waiting = 2 * engine.scheduler.max_num_seqs if max_waiting is None else max_waiting
        self.on_added = on_added
        self.on_rejected = on_rejected
        self.on_aborted = on_aborted
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
            elif not source.wait(self.clock):
                return

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


# -- a run's listeners and report --------------------------------------------------------------


@contextmanager
def open_output(path: Path, flag: str) -> Iterator[IO[str]]:
    """Open an output file before the run starts, so a bad path fails at once, by name; never
    through a symlink or into a FIFO or device (see ``paths.open_output``)."""
    with paths.open_output(path, flag) as f:
        yield f


class Run:
    """The listeners of one run on one engine, and its report.

    ``config`` goes into the report as is (and ``config["model"]``, ``["dry_run"]`` and
    ``trace_source`` into a trace's header). ``latencies``: record token latencies from the
    outputs passed to ``observe`` (model runs; a dry run's are meaningless). Use as a context
    manager: files open (and fail) on entry, listeners are removed and files closed on exit.
    """

    def __init__(
        self,
        engine: LLMEngine,
        clock: Clock,
        *,
        config: dict[str, Any],
        latencies: bool = True,
        record: Path | None = None,
        per_request: Path | None = None,
        infinite=None,
        trace_source: str | None = None,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.config = config
        self.latencies = latencies
        self.record = record
        self.per_request = per_request
        self.infinite = infinite
        self.trace_source = trace_source if trace_source is not None else config.get("file")
        self.stats = None
        self._stack = ExitStack()

    def __enter__(self) -> Run:
        from .report import RunStats

        stack, engine = self._stack, self.engine
        try:
            write_record = None
            if self.per_request is not None:
                records = stack.enter_context(open_output(self.per_request, "--per-request"))

                virtual = self.config.get("dry_run", False)

                def write_record(rec: dict[str, Any]) -> None:
                    if virtual:  # its latencies are the dry run's virtual seconds
                        rec["clock"] = "virtual"
                    records.write(json.dumps(rec) + "\n")
                    records.flush()  # one line per request as it finishes: Ctrl-C loses nothing

            divergence = None
            if self.per_request is not None:  # each line says where its prompt parts
                from .divergence import DivergenceRecorder, lazy_decoder

                divergence = DivergenceRecorder(lazy_decoder(self.config.get("model")))
            self.stats = RunStats(
                self.infinite,
                on_request=write_record,
                latencies=self.latencies,
                divergence=divergence,
            )
            stack.callback(engine.events.subscribe(self.stats))
            if self.record is not None:
                from .trace import TraceWriter, make_header

                header = make_header(
                    block_size=engine.block_size,
                    num_blocks=engine.num_blocks,
                    model=self.config.get("model"),
                    dry_run=self.config.get("dry_run", False),
                    source=self.trace_source,
                )
                writer = stack.enter_context(TraceWriter(self.record, header))
                stack.callback(engine.events.subscribe(writer))
        except BaseException:
            stack.close()
            raise
        self.t0, self.start = time.perf_counter(), self.clock()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.stats is not None:
                self.stats.flush()
        finally:
            self._stack.close()

    def tag(self, seq_id: int, **fields: Any) -> None:
        self.stats.tag(seq_id, **fields)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Record one step's token latencies (only with ``latencies``), and show the
        infinite-cache bound the sequences that finished."""
        if self.latencies:
            self.stats.observe(outputs, self.engine.clock)
        if self.stats.infinite is not None:
            self.stats.learn(outputs)

    def report(self, **extra: Any) -> dict[str, Any]:
        """The run's report so far: ``config``, the cache size, then ``extra``."""
        return self.stats.report(
            duration=self.clock() - self.start,
            wall_time=time.perf_counter() - self.t0,
            **self.config,
            num_blocks=self.engine.num_blocks,
            **extra,
        )


@contextmanager
def live_view(engine: LLMEngine, console=None, **options: Any) -> Iterator[Any]:
    """The live cache view (``views.live.LiveView``) following ``engine``'s events; call its
    ``tick()`` once per step from the engine's thread."""
    from .views.live import LiveView

    if console is None:
        from rich.console import Console

        console = Console(highlight=False)
    view = LiveView(engine.num_blocks, engine.block_size, console=console, **options)
    unsubscribe = view.attach(engine.events)
    try:
        with view:
            yield view
    finally:
        unsubscribe()
