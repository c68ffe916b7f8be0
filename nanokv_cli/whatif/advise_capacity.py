"""The capacity curve of ``nanokv advise``: the hit rate against the cache's size.

From the smallest cache that admits every request to one that never evicts, on a log scale,
each point a dry run of advise's grid (the settings now with only the cache size changed, so a
point the grid runs anyway, now, a cache x2 or x4, the never-evicting bound, is not run again):
the cache in tokens and in GiB of K/V for the model, the hit rate, and the ideal prefill
speedup 1 / (1 - hit rate) (every hit a prompt token not computed; the speedup of prefill
alone, were it all of a request's time). The ceiling is the token-level never-evicting bound
(block size 1), or where that is not run the never-evicting cache's.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ..engine.config import EngineConfig
from .advise_grid import POOL_MIN_TOKENS, Point, never_evicting_need, prompt_len
from .advise_workload import Workload

# Sizes on a log scale, smallest to never-evicting (now's comes on top), and how close a size
# must be to one the grid runs anyway (now, x2, x4, never-evicting) to take that run instead:
# on a log axis the two sit close. Where a run takes milliseconds (fewer prompt tokens than
# POOL_MIN_TOKENS), eight sizes. Past that each run takes seconds (~16 s of CPU for the 12,000
# requests of the bundled Mooncake trace, whatever the cache size), and four sizes, snapped
# more, add one run there at advise's defaults: eight runs in all, which two processes finish
# in the time of the seven of the grid alone.
CURVE_POINTS, SNAP = 8, 2**0.5
CURVE_POINTS_BIG, SNAP_BIG = 4, 2.5
# K/V bytes per element: float16 (bfloat16 is the same size), the engine's K/V on the CPU
# kernels by default and what GPU servers keep; float32 would double every GiB.
KV_DTYPE, KV_DTYPE_BYTES = "float16", 2
GIB = 1 << 30


def curve_sizes(workload: Workload, base: EngineConfig, grid: list[Point]) -> list[int]:
    """The cache sizes of the curve, in blocks of the block size now, smallest first."""
    bs, n = base.block_size, base.num_blocks
    top = never_evicting_need(workload, base)
    needs = [
        -(-(prompt_len(r) + r.sampling_params.max_tokens - 1) // bs) for r in workload.requests
    ]
    largest = max((k for k in needs if k <= top), default=1)
    lo = max(1, min(n, largest))
    hi = max(lo, top)
    have = {p.config.num_blocks for p in grid if _is_size_of(p, base)}
    big = sum(map(prompt_len, workload.requests)) >= POOL_MIN_TOKENS
    count, snap = (CURVE_POINTS_BIG, SNAP_BIG) if big else (CURVE_POINTS, SNAP)
    sizes = {n}
    for k in range(count):
        target = lo * (hi / lo) ** (k / (count - 1))
        near = [s for s in have if max(s, target) <= snap * min(s, target)]
        if near:
            sizes.add(min(near, key=lambda s: abs(math.log(s / target))))
        else:
            sizes.add(round(target))
    return sorted(sizes | {s for s in have if lo <= s <= hi})


def curve_points(sizes: list[int], base: EngineConfig, grid: list[Point]) -> list[Point]:
    """The runs of the curve (of ``sizes``) that ``grid`` lacks."""
    have = {p.config.num_blocks for p in grid if _is_size_of(p, base)}
    bs = base.block_size
    return [
        Point(
            "capacity",
            f"cache {s * bs:,} tokens",
            f"--num-blocks {s:,}",
            replace(base, num_blocks=s),
        )  # fmt: skip
        for s in sizes
        if s not in have
    ]


def _is_size_of(point: Point, base: EngineConfig) -> bool:
    """Whether a point runs the workload as given at the settings now but the cache size."""
    return point.input is None and point.config == replace(base, num_blocks=point.config.num_blocks)


def capacity_curve(
    sizes: list[int],
    base: EngineConfig,
    points: list[Point],
    runs: list[dict[str, Any]],
    kv: dict[str, Any],
) -> dict[str, Any]:
    """The curve at ``sizes``, from the runs of every point (``points`` with their ``runs``)
    and the K/V sizes of the model (``kv_sizes``)."""
    by_size = {p.config.num_blocks: r for p, r in zip(points, runs) if _is_size_of(p, base)}
    per_token = kv.get("kv_bytes_per_token")
    bs = base.block_size
    out = []
    for size in sizes:
        run = by_size[size]
        tokens = size * bs
        rate = run["hit_rate"]
        out.append({
            "num_blocks": size,
            "cache_tokens": tokens,
            "cache_gib": tokens * per_token / GIB if per_token else None,
            "hit_rate": rate,
            # 1 / (1 - r) has no finite value at r = 1 (nothing computed); JSON has no inf.
            "ideal_speedup": 1 / (1 - rate) if rate < 1 else None,
            "cache_hits": run["cache_hits"],
            "cache_queries": run["cache_queries"],
            "evictions": run["evictions"],
            "rejected": run["rejected"],
            "now": size == base.num_blocks,
        })  # fmt: skip
    bounds = {p.label: r for p, r in zip(points, runs) if p.kind == "bound"}
    ceiling = bounds.get("token-level") or bounds.get("never-evicting cache")
    return {
        **kv,
        "block_size": bs,
        "points": out,
        "ceiling": ceiling["hit_rate"] if ceiling else None,
        "ceiling_kind": "token-level" if "token-level" in bounds else "never-evicting cache",
        "current_tokens": base.num_blocks * bs,
    }


def kv_sizes(model: str | None) -> dict[str, Any]:
    """What a token's K/V takes for ``model`` (None: the default): layers x K and V x KV
    heads x head dim x ``KV_DTYPE_BYTES``; without a model that loads, no bytes and why."""
    from ..engine.model.loader import load_model
    from ..engine.model.model_errors import ModelLoadError

    try:
        loaded = load_model(model)
    except (ModelLoadError, OSError, ValueError) as e:
        return {"model": model, "kv_dtype": KV_DTYPE, "kv_bytes_per_token": None, "kv_note": str(e)}
    c = loaded.config
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * KV_DTYPE_BYTES
    return {"model": loaded.source, "kv_dtype": KV_DTYPE, "kv_bytes_per_token": per_token}
