"""Replaying a prompt file or request trace, as ``nanokv replay`` does: one model run, a dry
run per (block size, cache size) of a grid, or the fleet what-if, each to its report.

The command parses its flags into a ``ReplayPlan``, calls ``model_run``, ``dry_runs`` or
``fleet_what_if`` and prints what comes back. Progress (a bar on stderr, the live view on
stdout) and skipped requests are shown here, as the run goes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from ..engine.config import EngineConfig
from ..engine.model.loader import default_model_path
from ..engine.sampling_params import SamplingParams
from ..run.encode import PromptEncoder, build_requests
from ..run.loop import EngineClock, dry_run_engine
from ..run.record import RunError
from ..workload.mooncake import MOONCAKE_BLOCK_SIZE
from ..workload.prompts import PromptFile

# Dry-run cache when --num-blocks is not given: the same number of tokens for every block
# size, so a block-size comparison compares layouts, not memory.
DRY_RUN_CACHE_TOKENS = 1 << 18


# Beside a dry run's row whose block size is below a Mooncake trace's hash-id blocks: its hit
# rate cannot differ from another such row's (``nanokv advise`` says the same).
HASH_BLOCKS_NOTE = (
    f"below the trace's {MOONCAKE_BLOCK_SIZE}-token hash-id blocks: equal ids are equal blocks "
    f"and nothing finer is known, so the hit rate is what {MOONCAKE_BLOCK_SIZE}-token sharing "
    "gives and a smaller block size cannot be measured (real text may share more)"
)


class ReplayInterrupted(Exception):
    """Ctrl-C during a replay; carries the reports of the runs so far, the interrupted one's
    (what had finished by then) last."""

    def __init__(self, reports: list[dict[str, Any]]) -> None:
        super().__init__("interrupted")
        self.reports = reports


@dataclass(frozen=True)
class ReplayPlan:
    """What one replay runs: the requests' defaults and arrivals, the engine settings (a
    dry run's grid replaces block size and cache size), what to show and to write."""

    engine_config: EngineConfig
    block_sizes: list[int]
    sizes: list[int] | None  # cache sizes in blocks; None: a model run sizes from memory
    sampling: SamplingParams
    rate: float | None = None  # requests per second; None: the file's timestamps
    model: str | None = None
    chat: bool = False
    live: bool = False
    progress: bool = False
    record: Path | None = None
    per_request: Path | None = None

    @property
    def several(self) -> bool:
        return len(self.block_sizes) > 1 or (self.sizes is not None and len(self.sizes) > 1)

    @property
    def grid(self) -> list[tuple[int, int]]:
        """A dry run's (block size, cache size) pairs; the default cache is the same tokens."""
        return [
            (bs, n)
            for bs in self.block_sizes
            for n in (self.sizes or [-(-DRY_RUN_CACHE_TOKENS // bs)])
        ]


def model_label(model: str | None) -> str:
    return str(Path(model).expanduser().resolve()) if model else default_model_path()


def run_config(pf: PromptFile, rate: float | None, *, dry_run: bool) -> dict[str, Any]:
    """The report's description of the input and its arrivals."""
    timing = "rate" if rate is not None else ("timestamps" if pf.has_timestamps else "all at once")
    return {
        "file": str(pf.path),
        "format": pf.format,
        "dry_run": dry_run,
        "arrivals": timing,
        "rate": None if rate is None or math.isinf(rate) else rate,
    }


def model_run(llm, pf: PromptFile, plan: ReplayPlan) -> list[dict[str, Any]]:
    """The replay on ``llm`` (built with ``plan.engine_config``): its one report."""
    config = plan.engine_config
    encoder = PromptEncoder(
        plan.model, plan.chat, tokenizer=llm.tokenizer, max_prompt_tokens=llm.max_model_len
    )
    requests = build_requests(pf, encoder, plan.sampling, plan.rate)
    described = run_config(pf, plan.rate, dry_run=False)
    described["model"] = llm.model_path
    described.update(config.describe())
    described["quantization"] = llm.quantization or "none"
    report = run_replay(
        llm.engine,
        EngineClock(llm.engine),
        requests,
        config=described,
        latencies=True,
        live=plan.live,
        progress=plan.progress,
        record=plan.record,
        per_request=plan.per_request,
    )
    return [report]


def dry_run_requests(pf: PromptFile, plan: ReplayPlan) -> tuple[list, dict[str, Any]]:
    """The requests of a dry run (no model; a tokenizer for text) and the report's config."""
    # The longest prompt any run of the grid admits.
    longest = plan.engine_config.max_model_len or max(bs * n for bs, n in plan.grid)
    encoder = PromptEncoder(plan.model, plan.chat, max_prompt_tokens=longest)
    requests = build_requests(pf, encoder, plan.sampling, plan.rate)
    config = run_config(pf, plan.rate, dry_run=True)
    config["model"] = model_label(plan.model) if encoder.loaded else None
    return requests, config


def dry_runs(pf: PromptFile, plan: ReplayPlan) -> list[dict[str, Any]]:
    """One dry run per (block size, cache size) of the grid on the plan's other settings,
    with the infinite-cache bound of each; their reports in grid order."""
    from ..run.stats import InfiniteCache

    requests, config = dry_run_requests(pf, plan)
    settings = plan.engine_config
    reports: list[dict[str, Any]] = []
    grid, several = plan.grid, plan.several
    for i, (bs, n) in enumerate(grid):
        point = replace(settings, block_size=bs, num_blocks=n)
        engine, clock = dry_run_engine(point)
        # Per run, not per block size: rejected requests (too big for this cache) stay out of
        # both the hit rate and its bound.
        infinite = InfiniteCache(bs, settings.prefix_match)
        label = f"block size {bs}, {n:,} blocks"
        if several and not plan.live and plan.progress:
            print(f"nanokv: configuration {i + 1}/{len(grid)}: {label}", file=sys.stderr)
        described = {**config, **point.describe()}
        try:
            report = run_replay(
                engine,
                clock,
                requests,
                config=described,
                # On the virtual clock: per-request lines carry them, labelled (their "clock").
                latencies=plan.per_request is not None,
                live=plan.live,
                progress=plan.progress,
                record=plan.record,
                per_request=plan.per_request,
                infinite=infinite,
                transient=several,
                label=label if several else None,
            )
        except ReplayInterrupted as e:
            raise ReplayInterrupted(reports + _noted(pf, e.reports)) from None
        reports.extend(_noted(pf, [report]))
    return reports


def _noted(pf: PromptFile, reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``reports``, with a note on those whose block size the input cannot tell apart."""
    for r in reports:
        if pf.format == "mooncake" and r["block_size"] < MOONCAKE_BLOCK_SIZE:
            r["notes"] = [HASH_BLOCKS_NOTE]
    return reports


def fleet_what_if(
    pf: PromptFile, plan: ReplayPlan, instances: int, router: str | None
) -> dict[str, Any]:
    """``replay --dry-run --instances N --router R``: the fleet what-if's report (fleet.py)
    on the grid's one (block size, cache size)."""
    from .fleet import DEFAULT_ROUTER
    from .fleet_report import SkippedPrinter, what_if

    requests, config = dry_run_requests(pf, plan)
    bs, n = plan.grid[0]
    skipped = SkippedPrinter(config["file"])
    total = len(requests) * (2 if instances > 1 else 1)  # the fleet, then the one-cache bound
    with progress_bar(total, plan.progress) as advance:
        result = what_if(
            requests,
            replace(plan.engine_config, block_size=bs, num_blocks=n),
            instances,
            router or DEFAULT_ROUTER,
            run_config=config,
            on_progress=advance,
            on_rejected=skipped,
        )
    skipped.finish()
    # Its runs are dry runs: the same note where their block size is below the trace's.
    _noted(pf, [result, *result.get("per_instance", [])])
    return result


@contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr; yields the function that sets how many are done."""
    if not enabled:
        yield lambda done: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    console = Console(stderr=True, highlight=False)
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("replay", total=total)
        yield lambda done: bar.update(task, completed=done)


def run_replay(
    engine,
    clock,
    requests: list,
    *,
    config: dict[str, Any],
    latencies: bool,
    live: bool,
    progress: bool,
    record: Path | None,
    per_request: Path | None = None,
    infinite=None,
    transient: bool = False,
    label: str | None = None,
) -> dict[str, Any]:
    """Replay ``requests`` on ``engine`` to the end; return the run's report."""
    from ..run.record import Run

    with Run(
        engine,
        clock,
        config=config,
        latencies=latencies,
        record=record,
        per_request=per_request,
        infinite=infinite,
    ) as run:
        return _run_replay(
            run, requests, live=live, progress=progress, transient=transient, label=label
        )


def _run_replay(
    run, requests: list, *, live: bool, progress: bool, transient: bool, label: str | None
) -> dict[str, Any]:
    from ..run.interrupt import StepInterrupt
    from ..run.loop import IDLE_TICK_S, Arrivals, Driver

    config = run.config
    rejected: list[str] = []
    where = f" ({label})" if label else ""

    def on_rejected(req, error: Exception) -> None:
        rejected.append(f"line {req.tag}: {error}")
        if len(rejected) <= 3:
            print(
                f"nanokv: skipped {config['file']} line {req.tag}{where}: {error}", file=sys.stderr
            )

    driver = Driver(
        run.engine,
        run.clock,
        on_added=lambda seq_id, req: run.tag(seq_id, line=req.tag),
        on_rejected=on_rejected,
        # A model run waits for arrivals in real time: an idle view is drawn meanwhile.
        idle_interval=None if config.get("dry_run") else IDLE_TICK_S,
    )
    interrupted = False
    with ExitStack() as stack:
        tick = None
        if live:
            view = stack.enter_context(
                _live_view(run.engine, _title(config), len(requests), transient)
            )
            tick, driver.on_idle = view.tick, view.idle
        advance = stack.enter_context(progress_bar(len(requests), progress and not live))
        # Ctrl-C stops between steps (run/interrupt.py), so the view's last frame, the summary
        # and the report count the same requests.
        stop = stack.enter_context(StepInterrupt(lambda: driver.waiting))
        # Arrival times count from the run's start (a model engine's clock has run since it
        # was built).
        steps = stack.enter_context(closing(driver.run(Arrivals(requests, start=run.start))))
        try:
            for outputs in steps:
                run.observe(outputs)
                if outputs:
                    advance(run.stats.finished)
                if tick is not None:
                    tick()
                if stop.requested:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            interrupted = True  # left here: the view and the bar end as after a whole run
    if interrupted:
        raise ReplayInterrupted([run.report(rejected=len(rejected), interrupted=True)])
    if len(rejected) > 3:
        print(f"nanokv: skipped {len(rejected)} requests in all{where}", file=sys.stderr)
    if rejected and not run.stats.requests:
        raise RunError(f"every request was rejected; the first: {rejected[0]}")
    return run.report(rejected=len(rejected), interrupted=False)


def _title(config: dict[str, Any]) -> str:
    return f"nanokv replay {Path(config['file']).name}"


def _live_view(engine, title: str, total: int, transient: bool):
    from ..views.live import live_view

    console = Console(highlight=False)
    return live_view(engine, console, title=title, total_requests=total, transient=transient)


def write_report(path: Path, reports: list[dict[str, Any]], several: bool) -> None:
    """The report file: a list of reports for a grid, else the one report."""
    from ..run.stats import write_json_atomic

    write_json_atomic(path, reports if several else reports[0])
