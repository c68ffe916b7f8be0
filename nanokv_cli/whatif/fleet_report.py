"""The fleet what-if's run and report: ``replay --dry-run --instances N --router R``.

``what_if`` replays requests through a ``fleet.Fleet`` (see fleet.py for the timeline, what
the router knows and the policies), then the same admitted requests through the one-cache
bound: ONE dry-run engine with N times an instance's blocks and every other setting the same
(batch limits and step cost too, so it has one instance's compute: it measures what splitting
the cache costs, not a strict ceiling). The report holds each instance's own report (as a
plain dry run's), the fleet's sums, both bounds (one cache; infinite cache, from the one
engine's run) and the ``elsewhere`` miss class with the engine's reasons for the same tokens.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

from ..engine.config import EngineConfig
from ..run.loop import Request
from ..run.record import Run, RunError
from ..run.stats import InfiniteCache
from .fleet import DEFAULT_ROUTER, OVERLAP_SCORE_WEIGHT, ROUTERS, Fleet


class FleetOptionError(ValueError):
    """Options a fleet what-if cannot take; ``flag`` names the one to change."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(message)
        self.flag = flag


def check_fleet_options(
    instances: int,
    router: str | None,
    *,
    dry_run: bool,
    several: bool,
    record: object,
    per_request: object,
    live: bool | None,
) -> bool:
    """Whether these replay options ask for a fleet what-if (``--instances`` above 1 or a
    ``--router``); FleetOptionError for a combination it cannot run."""
    if instances < 1:
        raise FleetOptionError(f"need at least 1 instance, got {instances}", "--instances")
    if router is not None and router not in ROUTERS:
        raise FleetOptionError(f"choose from {', '.join(ROUTERS)}", "--router")
    fleet = instances > 1 or router is not None
    if not fleet:
        return False
    flag = "--instances" if instances > 1 else "--router"
    if not dry_run:
        raise FleetOptionError("a fleet what-if runs on the dry run: add --dry-run", flag)
    if several:
        raise FleetOptionError(
            "a fleet what-if takes one --block-size and one --num-blocks (per instance)",
            "--block-size/--num-blocks",
        )
    for value, name in ((record, "--record"), (per_request, "--per-request")):
        if value is not None:
            raise FleetOptionError(f"{name} describes one engine, not a fleet", name)
    if live:
        raise FleetOptionError("the live view shows one engine, not a fleet", "--live")
    return True


def run_fleet(
    fleet: Fleet,
    requests: list[Request],
    run_config: dict[str, Any],
    on_progress: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """Replay ``requests`` through ``fleet``; each instance's report, as a plain dry run's.
    Only one instance (the plain run, or the one-cache bound) gets the infinite-cache bound:
    its books keep every distinct block, which N instances would keep N times over."""
    config = fleet.config
    alone = len(fleet.instances) == 1
    with ExitStack() as stack:
        for inst in fleet.instances:
            inst.run = stack.enter_context(
                Run(
                    inst.engine,
                    inst.clock,
                    config={**run_config, **config.describe()},
                    latencies=False,
                    infinite=InfiniteCache(config.block_size, config.prefix_match)
                    if alone
                    else None,
                )
            )
        fleet.run(requests, on_progress)
        return [
            {
                "instance": inst.index,
                "routed": inst.routed,
                **inst.run.report(rejected=inst.rejected, interrupted=False),
                "elsewhere_tokens": inst.elsewhere,
                "elsewhere_by_reason": dict(inst.elsewhere_by_reason),
            }
            for inst in fleet.instances
        ]


def what_if(
    requests: list[Request],
    config: EngineConfig,
    instances: int,
    router: str = DEFAULT_ROUTER,
    *,
    run_config: dict[str, Any] | None = None,
    overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
    on_progress: Callable[[int], None] | None = None,
    on_rejected: Callable[[Request, Exception], None] | None = None,
) -> dict[str, Any]:
    """The fleet what-if's report: ``instances`` engines of ``config`` (its ``num_blocks`` each)
    behind ``router``, against the one-cache bound (see the module's docstring)."""
    if config.num_blocks is None:
        raise ValueError("a dry run has no memory to size its KV cache from: set num_blocks")
    run_config = dict(run_config or {})
    t0 = time.perf_counter()
    fleet = Fleet(config, instances, router, overlap_score_weight, on_rejected)
    per_instance = run_fleet(fleet, requests, run_config, on_progress)
    fleet_wall = time.perf_counter() - t0
    if fleet.rejected and not any(r["requests_added"] for r in per_instance):
        raise RunError(f"every request was rejected; the first: {fleet.first_rejection}")
    if instances == 1:
        bound = per_instance[0]  # one instance is its own one-cache bound
    else:
        # The same requests as the fleet admitted: one bigger cache admits longer ones.
        refused = {id(r) for r in fleet.rejected}
        admitted = [r for r in requests if id(r) not in refused]
        del fleet  # its books go before the bound's are built (instances and engines
        gc.collect()  # refer to each other: only the collector frees them)
        done = sum(r["requests"] for r in per_instance)
        one = Fleet(replace(config, num_blocks=config.num_blocks * instances), 1)
        progress = None if on_progress is None else (lambda n: on_progress(done + n))
        bound = run_fleet(one, admitted, run_config, progress)[0]
    report = _fleet_report(per_instance, bound, run_config, config, instances, router)
    report["overlap_score_weight"] = overlap_score_weight if router == "prefix" else None
    report["wall_time_s"] = fleet_wall
    return report


def _fleet_report(
    per_instance: list[dict[str, Any]],
    bound: dict[str, Any],
    run_config: dict[str, Any],
    config: EngineConfig,
    instances: int,
    router: str,
) -> dict[str, Any]:
    def total(key: str) -> int:
        return sum(r[key] for r in per_instance)

    queries, hits = total("cache_queries"), total("cache_hits")
    return {
        **run_config,
        "instances": instances,
        "router": router,
        **config.describe(),
        "num_blocks": config.num_blocks,
        "fleet_blocks": config.num_blocks * instances,
        "requests": total("requests"),
        "requests_added": total("requests_added"),
        "rejected": total("rejected"),
        "prompt_tokens": total("prompt_tokens"),
        "output_tokens": total("output_tokens"),
        "cache_queries": queries,
        "cache_hits": hits,
        "hit_rate": hits / queries if queries else 0.0,
        "miss_tokens": _sum_counts(r["miss_tokens"] for r in per_instance),
        "elsewhere_tokens": total("elsewhere_tokens"),
        "elsewhere_by_reason": _sum_counts(r["elsewhere_by_reason"] for r in per_instance),
        "evictions": total("evictions"),
        "preemptions": total("preemptions"),
        "one_cache_hit_rate": bound["hit_rate"],
        "infinite_cache_hit_rate": bound["infinite_cache_hit_rate"],
        "one_cache": {
            key: bound[key]
            for key in (
                "num_blocks",
                "requests",
                "cache_queries",
                "cache_hits",
                "hit_rate",
                "miss_tokens",
                "evictions",
                "preemptions",
                "duration_s",
                "wall_time_s",
            )
        },
        "duration_s": max(r["duration_s"] for r in per_instance),
        "per_instance": per_instance,
    }


def _sum_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


class SkippedPrinter:
    """An ``on_rejected`` that names the first ``shown`` skipped requests on stderr and
    ``finish`` the count, as a plain replay does."""

    def __init__(self, file: str, shown: int = 3) -> None:
        self.file = file
        self.shown = shown
        self.count = 0

    def __call__(self, req: Request, error: Exception) -> None:
        self.count += 1
        if self.count <= self.shown:
            print(f"nanokv: skipped {self.file} line {req.tag}: {error}", file=sys.stderr)

    def finish(self) -> None:
        if self.count > self.shown:
            print(f"nanokv: skipped {self.count} requests in all", file=sys.stderr)
