"""One run's record: ``Run`` subscribes its listeners (``RunStats``, the ``--record`` trace,
``--per-request`` records) to the engine's events and builds its report, with the same numbers
every view uses; ``RunError`` is a problem with a run's input or output that the CLI shows as
one line."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .. import paths

if TYPE_CHECKING:
    from ..engine.core.llm_engine import LLMEngine, RequestOutput


class RunError(ValueError):
    """A problem with a run's input or output files; the CLI shows it as one line."""


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
        clock: Callable[[], float],  # the run's clock (run.loop.Clock)
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
        from .stats import RunStats

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
                from ..trace.format import make_header
                from ..trace.writer import TraceWriter

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
