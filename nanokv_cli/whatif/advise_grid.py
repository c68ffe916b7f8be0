"""The dry runs behind ``nanokv advise``: one run of a workload at a setting, the grid of
settings advise measures (now, the bounds, each change) and running it, in a pool of
processes for big workloads (grid points are independent runs). A point may run a rewrite of
the prompts (a layout finding's) instead of the workload as given, and the run now also
keeps each request's hits and misses (its timeline)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from ..engine.config import PREFIX_MATCH_MODES, EngineConfig
from ..engine.core.dry_run import StepCostModel
from ..engine.core.events import CacheLookup
from ..run.loop import Arrivals, Driver, Request, dry_run_engine
from ..workload.mooncake import MOONCAKE_BLOCK_SIZE
from .advise_workload import Workload

# The block-size bound runs every token as a block: past this many tokens in all (prompts and
# outputs) its books would take minutes and gigabytes, and it is left out with a note.
TOKEN_LEVEL_MAX_TOKENS = 4_000_000
# Block sizes tried for a prompt file (besides half and twice the current one).
BLOCK_SIZES = (16, 64, 256)
# Below this many tokens in all a run takes milliseconds: a process pool would cost more.
POOL_MIN_TOKENS = 1_000_000
# Where a suggested disk tier would live (a dry run never touches it).
TIER_PATH = "~/.cache/nanokv/kv"


# -- one dry run -------------------------------------------------------------------------------------


def below_block(requests: list[Request], config: EngineConfig) -> tuple[int, int]:
    """Prompts (and their tokens) of at most one block, which whole-block reuse can never
    serve: the engine counts their lookups as ``last-block`` (every one of them: no full block
    comes before the last), advise as ``below-block``."""
    if not config.enable_prefix_caching or getattr(config, "prefix_match", "block") != "block":
        return 0, 0
    short = [n for n in map(prompt_len, requests) if n <= config.block_size]
    return len(short), sum(short)


def dry_run(
    requests: list[Request], config: EngineConfig, timeline: bool = False
) -> dict[str, Any]:
    """One dry run of ``requests`` at ``config``, as ``replay --dry-run`` runs it (the same
    driver loop and arrivals), and the engine's cache counters at its end; with ``timeline``,
    each request's lookups too (``Timeline``).

    Without ``timeline`` nobody listens to the engine's events: its books and counters are the
    same either way, and building an event for every block change takes a share of the run."""
    engine, clock = dry_run_engine(config)
    lookups = Timeline(requests, config) if timeline else None
    rejected = 0
    first_rejection = None

    def on_rejected(req: Request, error: Exception) -> None:
        nonlocal rejected, first_rejection
        rejected += 1
        if first_rejection is None:
            first_rejection = f"line {req.tag}: {error}" if req.tag is not None else str(error)

    t0 = time.perf_counter()
    steps = 0
    driver = Driver(engine, clock, on_rejected=on_rejected)
    if lookups is not None:
        driver.on_added = lookups.added
        engine.events.subscribe(lookups)
    for _ in driver.run(Arrivals(requests, start=clock())):
        steps += 1
    s = engine.block_manager.stats
    prompts, tokens = below_block(requests, config)
    return {
        **({"timeline": lookups.requests()} if lookups is not None else {}),
        **settings_of(config),
        "hit_rate": s.hit_rate,
        "cache_hits": s.hits,
        "cache_queries": s.queries,
        "miss_tokens": {k: v for k, v in s.miss_tokens.items() if v},
        "evictions": s.evictions,
        "preemptions": s.preemptions,
        "requests": len(requests) - rejected,
        "rejected": rejected,
        "first_rejection": first_rejection,  # why (the engine's words), or None
        "steps": steps,
        "wall_time_s": time.perf_counter() - t0,
        "below_block_prompts": prompts,
        "below_block_tokens": min(tokens, s.miss_tokens.get("last-block", 0)),
    }


class Timeline:
    """Each request's prompt lookups in a run, in arrival order: prompt tokens, hits, and the
    missed tokens by the engine's reason (``below-block`` told apart from ``last-block``, as
    ``advise.limits`` tells them). A re-admission after preemption adds its misses (the
    engine counts them under ``miss_tokens`` too), not its tokens: those are the hit rate's."""

    def __init__(self, requests: list[Request], config: EngineConfig) -> None:
        self.index = {id(r): i for i, r in enumerate(requests)}
        self.seq: dict[int, int] = {}  # seq_id -> index of its request
        self.rows: dict[int, dict[str, Any]] = {}
        block_mode = config.enable_prefix_caching and config.prefix_match == "block"
        self.block = config.block_size if block_mode else 0

    def added(self, seq_id: int, request: Request) -> None:
        self.seq[seq_id] = self.index[id(request)]

    def __call__(self, event: Any) -> None:
        if type(event) is not CacheLookup or event.seq_id not in self.seq:
            return
        i = self.seq[event.seq_id]
        missed = event.num_tokens - event.num_hit_tokens
        reason = event.reason
        if reason == "last-block" and event.num_tokens <= self.block:
            reason = "below-block"
        if event.first:
            self.rows[i] = {"request": i, "prompt_tokens": event.num_tokens,
                            "hit_tokens": event.num_hit_tokens, "misses": {}}  # fmt: skip
        row = self.rows.get(i)
        if row is not None and missed:
            row["misses"][reason] = row["misses"].get(reason, 0) + missed

    def requests(self) -> list[dict[str, Any]]:
        return [self.rows[i] for i in sorted(self.rows)]


def settings_of(config: EngineConfig) -> dict[str, Any]:
    """The settings a grid point changes, under ``replay``'s flag names."""
    return {**config.describe(), "num_blocks": config.num_blocks}


# -- the grid ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One run of the grid: what it changes (``kind``: now, bound, block_size, cache, tier,
    prefix_match, prefix_caching, layout, capacity) and its settings."""

    kind: str
    label: str  # a few words, for the grid's table
    change: str  # what to do, with the flags
    config: EngineConfig
    input: str | None = None  # the requests of a rewrite of the prompts; None: as given
    timeline: bool = False  # keep each request's lookups (the run now)


def never_evicting_blocks(
    requests: list[Request], block_size: int, most_tokens: int | None = None
) -> int:
    """A cache no run of ``requests`` can fill: every block each request may hold (prompt and
    outputs), added up. The free queue hands out clean blocks first, so it never evicts.
    Requests of more than ``most_tokens`` (prompt + max_tokens) are left out: no cache of the
    grid admits them, so they hold nothing (and one with max_tokens 10^9 sizes nothing)."""
    total = 0
    for r in requests:
        tokens = prompt_len(r) + r.sampling_params.max_tokens
        if most_tokens is None or tokens <= most_tokens:
            total += -(-tokens // block_size) + 1
    return total


def never_evicting_size(workload: Workload, base: EngineConfig) -> int:
    """The never-evicting bound's cache (blocks of ``base.block_size``): room for every request
    that fits the grid's biggest cache (a cache x4, or the same tokens in bigger blocks)."""
    return max(base.num_blocks, never_evicting_need(workload, base))


def never_evicting_need(workload: Workload, base: EngineConfig) -> int:
    """The blocks the never-evicting bound's requests can hold at most (a cache this big
    never evicts), however small the cache now."""
    bs, n = base.block_size, base.num_blocks
    biggest = 4 * bs * n + max(block_sizes(workload, bs), default=bs)
    return never_evicting_blocks(workload.requests, bs, biggest)


def prompt_len(r: Request) -> int:
    p = r.prompt_token_ids
    n = getattr(p, "input_length", None)
    if n is not None:
        return n
    return len(p) if hasattr(p, "__len__") else 0


def grid(workload: Workload, base: EngineConfig) -> list[Point]:
    """The runs advise needs: now, the bounds, then each change of the settings it can
    measure (``advise_layout`` adds the prompts' layout, ``advise_capacity`` cache sizes)."""
    bs, n = base.block_size, base.num_blocks
    requests = workload.requests
    infinite = never_evicting_size(workload, base)
    points = [
        Point("now", "now", "as given", base, timeline=True),
        Point(
            "bound",
            "never-evicting cache",
            f"a cache that never evicts (--num-blocks {infinite:,})",
            replace(base, num_blocks=infinite),
        ),
    ]
    if token_level_possible(workload):
        blocks = never_evicting_blocks(requests, 1)
        points.append(
            Point(
                "bound",
                "token-level",
                "token-level: block size 1, never evicting",
                replace(base, block_size=1, num_blocks=blocks),
            )
        )
    points += [block_size_point(base, size) for size in block_sizes(workload, bs)]
    for factor in (2, 4):
        change = f"a cache ×{factor} (--num-blocks {n * factor:,})"
        config = replace(base, num_blocks=n * factor)
        points.append(Point("cache", f"cache ×{factor}", change, config))
    if base.kv_tier is None and base.enable_prefix_caching and infinite > n:
        points.append(tier_point(base, infinite))
    if not base.enable_prefix_caching:
        config = replace(base, enable_prefix_caching=True)
        points.append(Point("prefix_caching", "prefix caching on", "prefix caching on", config))
    if base.enable_prefix_caching:
        for mode in PREFIX_MATCH_MODES:
            if mode != base.prefix_match:
                config = replace(base, prefix_match=mode)
                change = f"--prefix-match {mode}"
                points.append(Point("prefix_match", f"prefix match {mode}", change, config))
    return points


def tier_point(base: EngineConfig, infinite: int) -> Point:
    """A disk tier holding what the never-evicting cache holds beyond this one (in the dry
    run's bytes per block), in whole GiB: evicted blocks restored instead of recomputed."""
    block_bytes = StepCostModel.kv_bytes_per_token * base.block_size
    gib = max(1, -(-(infinite - base.num_blocks) * block_bytes // (1 << 30)))
    tier = f"disk:{TIER_PATH}:{gib}GiB"
    change = f"add a disk tier of {gib:,} GiB (--kv-tier {tier})"
    return Point("tier", f"disk tier {gib:,} GiB", change, replace(base, kv_tier=tier))


def block_size_point(base: EngineConfig, size: int) -> Point:
    """Block size ``size`` with the same cache in tokens: a comparison of layouts, not of
    memory (as replay's)."""
    blocks = -(-base.block_size * base.num_blocks // size)
    change = f"--block-size {size} (--num-blocks {blocks:,}: the same cache in tokens)"
    config = replace(base, block_size=size, num_blocks=blocks)
    return Point("block_size", f"block size {size}", change, config)


def block_sizes(workload: Workload, current: int) -> list[int]:
    """Block sizes to try: a few around the current one; for hash ids, none below them."""
    if workload.hashed:
        sizes = {MOONCAKE_BLOCK_SIZE, 2 * MOONCAKE_BLOCK_SIZE}
    else:
        sizes = set(BLOCK_SIZES) | {max(1, current // 2), current * 2}
    return sorted(s for s in sizes if s != current)


def token_level_possible(workload: Workload) -> bool:
    if workload.hashed:
        return False
    total = sum(prompt_len(r) + r.sampling_params.max_tokens for r in workload.requests)
    return total <= TOKEN_LEVEL_MAX_TOKENS


# -- running the grid ------------------------------------------------------------------------------

# The requests of each input (None: as given; else a rewrite's key); set before the pool forks.
_INPUTS: dict[str | None, list[Request]] = {}
Key = tuple[str | None, EngineConfig]


def _run_point(key: Key, timeline: bool) -> dict[str, Any]:
    return dry_run(_INPUTS[key[0]], key[1], timeline)


def evaluate(
    points: list[Point], inputs: dict[str | None, list[Request]], jobs: int = 1
) -> list[dict[str, Any]]:
    """Each point's dry run, in order. A point at least as big as a never-evicting cache of the
    same settings is that run (both never evict, and never wait for blocks): run once. Points
    that share a run share its dict."""
    keys = [(p.input, _canonical(p.config, inputs[p.input])) for p in points]
    unique = list(dict.fromkeys(keys))
    timelines = {k for p, k in zip(points, keys) if p.timeline}
    jobs_list = [(k, k in timelines) for k in unique]
    _INPUTS.clear()
    _INPUTS.update(inputs)
    tokens = sum(prompt_len(r) for r in inputs[None])
    try:
        if jobs > 1 and len(unique) > 1 and tokens >= POOL_MIN_TOKENS:
            results = _in_pool(jobs_list, jobs)
        else:
            results = [_run_point(key, timeline) for key, timeline in jobs_list]
    finally:
        _INPUTS.clear()
    by_key = dict(zip(unique, results))
    return [by_key[k] for k in keys]


def _canonical(config: EngineConfig, requests: list[Request]) -> EngineConfig:
    enough = never_evicting_blocks(requests, config.block_size)
    return replace(config, num_blocks=enough) if config.num_blocks > enough else config


def _in_pool(unique: list[tuple[Key, bool]], jobs: int) -> list[dict[str, Any]]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # Forked workers inherit the requests (no pickling of 10^4 prompts); the most costly
    # runs (the biggest caches) start first, so the pool's last run is a short one.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    if method is None:
        return [_run_point(key, timeline) for key, timeline in unique]
    order = sorted(range(len(unique)), key=lambda i: -(unique[i][0][1].num_blocks or 0))
    context = multiprocessing.get_context(method)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {i: pool.submit(_run_point, *unique[i]) for i in order}
        return [futures[i].result() for i in range(len(unique))]
