"""The dry runs behind ``nanokv advise``: one run of a workload at a setting, the grid of
settings advise measures (now, the bounds, each change) and running it, in a pool of
processes for big workloads (grid points are independent runs)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace
from typing import Any

from .advise_workload import Workload
from .driver import Arrivals, Driver, Request, dry_run_engine
from .engine.config import EngineConfig
from .engine.mooncake import MOONCAKE_BLOCK_SIZE

# The block-size bound runs every token as a block: past this many tokens in all (prompts and
# outputs) its books would take minutes and gigabytes, and it is left out with a note.
TOKEN_LEVEL_MAX_TOKENS = 4_000_000
# Block sizes tried for a prompt file (besides half and twice the current one).
BLOCK_SIZES = (16, 64, 256)
# Below this many tokens in all a run takes milliseconds: a process pool would cost more.
POOL_MIN_TOKENS = 1_000_000
HAS_PREFIX_MATCH = "prefix_match" in {f.name for f in dataclasses.fields(EngineConfig)}
PREFIX_MATCH_MODES = ("token", "block")


# -- one dry run -------------------------------------------------------------------------------------


def below_block(requests: list[Request], config: EngineConfig) -> tuple[int, int]:
    """Prompts (and their tokens) of at most one block, which whole-block reuse can never
    serve: the engine counts their lookups as ``last-block`` (every one of them: no full block
    comes before the last), advise as ``below-block``."""
    if not config.enable_prefix_caching or getattr(config, "prefix_match", "block") != "block":
        return 0, 0
    short = [n for n in map(prompt_len, requests) if n <= config.block_size]
    return len(short), sum(short)


def dry_run(requests: list[Request], config: EngineConfig) -> dict[str, Any]:
    """One dry run of ``requests`` at ``config``, as ``replay --dry-run`` runs it (the same
    driver loop and arrivals), and the engine's cache counters at its end.

    Nobody listens to the engine's events: its books and counters are the same either way,
    and building an event for every block change takes about half of a listened run."""
    engine, clock = dry_run_engine(config)
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
    for _ in driver.run(Arrivals(requests, start=clock())):
        steps += 1
    s = engine.block_manager.stats
    prompts, tokens = below_block(requests, config)
    return {
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


def settings_of(config: EngineConfig) -> dict[str, Any]:
    """The settings a grid point changes, under ``replay``'s flag names."""
    out = {
        "block_size": config.block_size,
        "num_blocks": config.num_blocks,
        "prefix_caching": config.enable_prefix_caching,
    }
    if HAS_PREFIX_MATCH:
        out["prefix_match"] = config.prefix_match
    return out


# -- the grid ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One run of the grid: what it changes (``kind``: now, bound, block_size, cache,
    prefix_match, prefix_caching, layout) and its settings."""

    kind: str
    label: str  # a few words, for the grid's table
    change: str  # what to do, with the flags
    config: EngineConfig
    layout: bool = False  # on the requests with the varying first lines moved


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
    bs, n = base.block_size, base.num_blocks
    biggest = 4 * bs * n + max(block_sizes(workload, bs), default=bs)
    return max(n, never_evicting_blocks(workload.requests, bs, biggest))


def prompt_len(r: Request) -> int:
    p = r.prompt_token_ids
    n = getattr(p, "input_length", None)
    if n is not None:
        return n
    return len(p) if hasattr(p, "__len__") else 0


def grid(workload: Workload, base: EngineConfig, layout_moved: int = 0) -> list[Point]:
    """The runs advise needs: now, the bounds, then each change it can measure."""
    bs, n = base.block_size, base.num_blocks
    requests = workload.requests
    infinite = never_evicting_size(workload, base)
    points = [
        Point("now", "now", "as given", base),
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
    for size in block_sizes(workload, bs):
        # The same cache in tokens: a comparison of layouts, not of memory (as replay's).
        blocks = -(-bs * n // size)
        change = f"--block-size {size} (--num-blocks {blocks:,}: the same cache in tokens)"
        config = replace(base, block_size=size, num_blocks=blocks)
        points.append(Point("block_size", f"block size {size}", change, config))
    for factor in (2, 4):
        change = f"a cache ×{factor} (--num-blocks {n * factor:,})"
        config = replace(base, num_blocks=n * factor)
        points.append(Point("cache", f"cache ×{factor}", change, config))
    if not base.enable_prefix_caching:
        config = replace(base, enable_prefix_caching=True)
        points.append(Point("prefix_caching", "prefix caching on", "prefix caching on", config))
    if HAS_PREFIX_MATCH and base.enable_prefix_caching:
        for mode in PREFIX_MATCH_MODES:
            if mode != base.prefix_match:
                config = replace(base, prefix_match=mode)
                change = f"--prefix-match {mode}"
                points.append(Point("prefix_match", f"prefix match {mode}", change, config))
    if layout_moved:
        change = f"move each varying first line after the shared text ({layout_moved:,} prompts)"
        points.append(Point("layout", "first line moved last", change, base, layout=True))
    return points


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

_INPUTS: dict[bool, list[Request]] = {}  # layout? -> requests; set before the pool forks


def _run_point(layout: bool, config: EngineConfig) -> dict[str, Any]:
    return dry_run(_INPUTS[layout], config)


def evaluate(
    points: list[Point], inputs: dict[bool, list[Request]], jobs: int = 1
) -> list[dict[str, Any]]:
    """Each point's dry run, in order. A point at least as big as a never-evicting cache of the
    same settings is that run (both never evict, and never wait for blocks): run once."""
    keys = [(p.layout, _canonical(p.config, inputs[p.layout])) for p in points]
    unique = list(dict.fromkeys(keys))
    _INPUTS.clear()
    _INPUTS.update(inputs)
    tokens = sum(prompt_len(r) for r in inputs[False])
    try:
        if jobs > 1 and len(unique) > 1 and tokens >= POOL_MIN_TOKENS:
            results = _in_pool(unique, jobs)
        else:
            results = [_run_point(layout, config) for layout, config in unique]
    finally:
        _INPUTS.clear()
    by_key = dict(zip(unique, results))
    return [by_key[k] for k in keys]


def _canonical(config: EngineConfig, requests: list[Request]) -> EngineConfig:
    enough = never_evicting_blocks(requests, config.block_size)
    return replace(config, num_blocks=enough) if config.num_blocks > enough else config


def _in_pool(unique: list[tuple[bool, EngineConfig]], jobs: int) -> list[dict[str, Any]]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # Forked workers inherit the requests (no pickling of 10^4 prompts); the most costly
    # runs (the biggest caches) start first, so the pool's last run is a short one.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    if method is None:
        return [_run_point(layout, config) for layout, config in unique]
    order = sorted(range(len(unique)), key=lambda i: -(unique[i][1].num_blocks or 0))
    context = multiprocessing.get_context(method)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {i: pool.submit(_run_point, *unique[i]) for i in order}
        return [futures[i].result() for i in range(len(unique))]
