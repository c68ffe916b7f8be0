"""How to raise a workload's prefix-cache hit rate, with every figure measured by a dry run.

``advise(workload, config)`` runs the workload through the dry-run engine (``dry_run_engine``,
driven by the same ``Driver`` and ``Arrivals`` as ``nanokv replay --dry-run``, so each figure
is the one that command prints for that setting) at the given settings, then at its bounds and
at each change it can suggest, and puts together:

* the hit rate now, against two bounds: the same run on a cache that never evicts, and on
  token-sized blocks (block size 1) that never evict either;
* what limits it: the missed tokens by the engine's reasons, with ``below-block`` (prompts too
  short to fill one block, which whole-block reuse can never serve) told apart;
* the points where many prompts part from the earlier ones (``divergence.PrefixIndex``), with
  the text there;
* the changes in one list, ranked by measured gain (prompt tokens more from the cache, then
  hit-rate points): block size, cache size, prefix-match mode, and the fixes of the prompts'
  layout that ``layout.py`` finds (each a run of the prompts rewritten with it, and with its
  cause and both texts where they part), the layout findings themselves, gain or none;
* the capacity curve: the hit rate from a tiny cache to a never-evicting one, in tokens and
  GiB of K/V, with the ideal prefill speedup (``advise_capacity``);
* the run now request by request (the timeline: prompt tokens, hits, misses by reason);
* what the input cannot show (a Mooncake trace's 512-token hash ids).

No typer or rich here: the CLI, ``serve`` and scripts call it; ``views/advise.py`` draws it in
the terminal, ``views/pages.py`` as a page. The workload is ``advise_workload``'s, the dry runs
and their grid ``advise_grid``'s (grid points are independent runs, so ``jobs > 1`` runs them
in a pool of processes), the layout findings' runs ``advise_layout``'s.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import xxhash

from ..engine.config import EngineConfig
from ..run.divergence import Decode, PrefixIndex
from ..run.record import RunError
from ..workload.mooncake import MOONCAKE_BLOCK_SIZE, SynthesizedPrompt
from .advise_capacity import capacity_curve, curve_points, curve_sizes, kv_sizes
from .advise_grid import (
    TOKEN_LEVEL_MAX_TOKENS,
    Point,
    evaluate,
    grid,
    settings_of,
    token_level_possible,
)
from .advise_layout import Layout, finding_record
from .advise_workload import Workload
from .layout import Finding

TOP_POINTS = 5  # divergence points listed
TOP_CHANGES = 5  # changes in the ranked list


# -- the advice ----------------------------------------------------------------------------------------

LIMITS = {
    "cold": "no earlier prompt had these tokens: content seen for the first time",
    "partial": "an earlier prompt shared part of the block, not all of it: smaller blocks "
    "or token-granular reuse serve the shared part",
    "evicted": "cached once, then evicted before it was asked for again: a bigger cache keeps it",
    "last-block": "the block holding each prompt's last token is always computed",
    "last-token": "only each prompt's last token, which is always computed",
    "below-block": "prompts shorter than one block: whole-block reuse can never serve them",
    "in-flight": "another sequence was computing the same block in the same step",
    "preempted": "recomputed after a preemption (a bigger cache avoids it)",
    "disabled": "prefix caching is off",
}


def advise(workload: Workload, base: EngineConfig, jobs: int = 1) -> dict[str, Any]:
    """The advice for ``workload`` at settings ``base`` (``num_blocks`` given): see the
    module's docstring. Every hit rate in it is a dry run's. ``jobs > 1`` forks worker
    processes for big workloads: call it so only from a process without other threads."""
    if base.num_blocks is None:
        raise ValueError("advise needs a cache size: set num_blocks")
    t0 = time.perf_counter()
    points, runs, layout, sizes = _run_all(workload, base, jobs)
    now = runs[0]
    requests = now.pop("timeline")  # shared by the points that share the run now
    if workload.requests and not now["requests"]:
        # Nothing to advise on; say why as replay does, not with a hit rate of 0 of 0.
        raise RunError(f"every request was rejected; the first: {now['first_rejection']}")
    found = layout.findings(points, runs) if layout is not None else []
    kinds = layout.kinds if layout is not None else {}
    rows = [_row(p, r, now, kinds.get(p.input)) for p, r in zip(points, runs)]
    bounds = {r["label"]: r for r in rows if r["kind"] == "bound"}
    findings = [_finding(f, layout, now, workload) for f in found]
    changes = ranked_changes(rows, findings, base)
    for f in findings:  # its place among the changes listed, if it is one
        f["rank"] = next((c["rank"] for c in changes[:TOP_CHANGES] if c["finding"] is f), None)
    return {
        "input": {
            "source": workload.source,
            "kind": workload.kind,
            "requests": len(workload.requests),
            "arrivals": workload.arrivals,
        },
        "settings": settings_of(base),
        "recorded": workload.recorded,
        "hit_rate": now["hit_rate"],
        "now": now,
        "bounds": {
            "infinite_cache": bounds.get("never-evicting cache"),
            "token_level": bounds.get("token-level"),
        },
        "limits": limits(now),
        "divergence_points": divergence_points(workload),
        "changes": changes[:TOP_CHANGES],
        "findings": findings,
        "verdict": verdict(now, list(bounds.values()), changes),
        "capacity_curve": capacity_curve(sizes, base, points, runs, kv_sizes(workload.model)),
        "timeline": timeline(workload, requests),
        "grid": rows,
        "notes": notes(workload, base, now, layout is not None),
        "wall_time_s": time.perf_counter() - t0,
    }


def _run_all(
    workload: Workload, base: EngineConfig, jobs: int
) -> tuple[list[Point], list[dict[str, Any]], Layout | None, list[int]]:
    """Every dry run advise needs, in one ``evaluate`` (one pool): the grid, the runs its
    layout findings ask for, the capacity curve's."""
    points = grid(workload, base)
    inputs: dict[str | None, list] = {None: workload.requests}
    layout = None
    if workload.texts is not None and workload.decode is not None and base.enable_prefix_caching:
        layout = Layout(workload, base)
        points += layout.points(points)
        inputs.update(layout.inputs)
    sizes = curve_sizes(workload, base, points)
    points += curve_points(sizes, base, points)
    return points, evaluate(points, inputs, jobs), layout, sizes


def _row(
    point: Point, run: dict[str, Any], now: dict[str, Any], layout: str | None
) -> dict[str, Any]:
    return {
        "kind": point.kind,
        "label": point.label,
        "change": point.change,
        "layout": layout,  # the layout finding whose rewrite of the prompts it ran
        **run,
        **settings_of(point.config),  # a cache past never-evicting ran as never-evicting
        "cache_tokens": point.config.block_size * point.config.num_blocks,
        "gain": run["hit_rate"] - now["hit_rate"],
        "tokens_saved": run["cache_hits"] - now["cache_hits"],  # fewer computed at admission
    }


def _finding(f: Finding, layout: Layout, now: dict[str, Any], workload: Workload) -> dict:
    """A layout finding with the numbers of the run that measured its fix."""
    run = layout.run_of(f)
    return {
        "rank": None,  # its place among the changes listed, where it is one
        **finding_record(f, workload.labels),
        "hit_rate": run["hit_rate"],
        "gain": run["hit_rate"] - now["hit_rate"],
    }


# What a change of the settings works on, for the ranked list (a layout finding says its own).
CAUSES = {
    "bound": LIMITS["evicted"],
    "cache": LIMITS["evicted"],
    "tier": LIMITS["evicted"] + "; a second tier keeps it to restore",
    "prefix_caching": LIMITS["disabled"],
    "prefix_match": "prompts share part of a block: token-granular reuse serves the shared part "
    "of a block, whole-block reuse none of it",
}


def ranked_changes(
    rows: list[dict[str, Any]], findings: list[dict[str, Any]], base: EngineConfig
) -> list[dict[str, Any]]:
    """The changes that raise the hit rate, settings and prompt layout in one list, ranked by
    measured gain (prompt tokens more from the cache, then hit-rate points). A change a
    layout finding suggests carries it (``finding``), with its cause and the texts."""
    by_run = {(f["kind"], f["setting"]["block_size"] if f["setting"] else None): f
              for f in findings}  # fmt: skip
    out = []
    for r in rows:
        # The never-evicting cache is a setting too (a bigger --num-blocks); block size 1 is
        # not one to run (token-granular prefix matching is how to get near it); the capacity
        # curve's sizes are drawn as one, with the never-evicting cache ranked here.
        if r["kind"] in ("now", "capacity") or r["label"] == "token-level":
            continue
        if r["gain"] <= 0 or r["tokens_saved"] <= 0:
            continue
        finding = by_run.get((r["layout"], None)) if r["kind"] == "layout" else None
        if r["kind"] == "block_size":
            finding = by_run.get(("short-prefix", r["block_size"]))
        cause = finding["cause"] if finding else CAUSES.get(r["kind"])
        if cause is None:  # a block size
            cause = LIMITS["partial"] if r["block_size"] < base.block_size else LIMITS["evicted"]
        out.append({**r, "cause": cause, "fix": finding["fix"] if finding else r["change"],
                    "finding": finding})  # fmt: skip
    out.sort(key=lambda c: (-c["tokens_saved"], -c["gain"], c["change"]))
    for rank, c in enumerate(out, 1):
        c["rank"] = rank
    return out


TIMELINE_MAX = 500  # entries; past that many requests, runs of consecutive ones are summed


def timeline(workload: Workload, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run now request by request, in arrival order: prompt tokens, hits and the misses
    by reason; for a big workload, summed over runs of consecutive requests (``requests``
    says how many), so that a page of it stays small."""
    unit = "request" if workload.kind == "trace" else "line"
    labels = workload.labels
    size = -(-len(requests) // TIMELINE_MAX) if requests else 1
    out = []
    for k in range(0, len(requests), size):
        part = requests[k : k + size]
        first, last = labels[part[0]["request"]], labels[part[-1]["request"]]
        misses: dict[str, int] = {}
        for r in part:
            for reason, n in r["misses"].items():
                misses[reason] = misses.get(reason, 0) + n
        out.append({
            "request": part[0]["request"],
            "requests": len(part),
            "label": f"{unit} {first}" if len(part) == 1 else f"{unit}s {first}-{last}",
            "first": first,  # the labels of its first and last request
            "last": last,
            "prompt_tokens": sum(r["prompt_tokens"] for r in part),
            "hit_tokens": sum(r["hit_tokens"] for r in part),
            "misses": misses,
        })  # fmt: skip
    return out


def verdict(now: dict[str, Any], bounds: list[dict[str, Any]], changes: list) -> str | None:
    """A sentence where no change helps: whether the hit rate already stands at its bounds."""
    if changes:
        return None
    best = max((b["hit_rate"] for b in bounds), default=now["hit_rate"])
    if best - now["hit_rate"] < 0.005:
        top = limits(now)
        what = (
            f": what misses is mostly {top[0]['reason']} ({top[0]['explanation']})" if top else ""
        )
        return f"the hit rate is at its bounds for these prompts{what}"
    return None


def limits(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The missed tokens of a run by reason, most first, with ``below-block`` told apart from
    ``last-block``."""
    misses = dict(run["miss_tokens"])
    below = run["below_block_tokens"]
    if below:
        misses["last-block"] = misses.get("last-block", 0) - below
        misses["below-block"] = below
    queries = run["cache_queries"] or 1
    out = []
    for reason, n in sorted(misses.items(), key=lambda kv: -kv[1]):
        if n > 0:
            rec = {"reason": reason, "tokens": n, "share": n / queries}
            rec["explanation"] = LIMITS.get(reason, reason)
            if reason == "below-block":
                rec["prompts"] = run["below_block_prompts"]
            out.append(rec)
    return out


def divergence_points(workload: Workload, top: int = TOP_POINTS) -> list[dict[str, Any]]:
    """Where many prompts part from the earlier ones, most requests first: the requests that
    part from the same text inside the same line (of prompt text; else at the same token)
    make one point, shown by its first request with the text on both sides."""
    index = PrefixIndex()
    lines = _LineStarts(workload.decode)
    groups: dict[Any, list] = {}  # point -> [requests, first divergence, tokens past, ats]
    for i, r in enumerate(workload.requests):
        p = r.prompt_token_ids
        if isinstance(p, SynthesizedPrompt):
            div = index.add(i, None, p)
        elif isinstance(p, list):
            div = index.add(i, p)
        else:
            continue  # refused before its tokens were made
        if div is None or div.ends_here:
            continue  # nothing shared, or all of it: an earlier prompt repeats it (no parting)
        key = div.group
        if lines.decode is not None and not index.hashed:
            tokens = index.tokens(i)
            start = lines.start(tokens, div.at)
            key = (start, xxhash.xxh64_intdigest(tokens[:start].tobytes()))
        g = groups.setdefault(key, [0, div, 0, set()])
        g[0] += 1
        g[2] += div.length - div.at
        g[3].add(div.at)
    ranked = sorted(groups.values(), key=lambda g: (-g[0], g[1].at))[:top]
    labels = workload.labels
    out = []
    for count, div, past, ats in ranked:
        rec = index.describe(div, workload.decode)
        rec["shared_with"] = labels[div.earlier]
        rec.update(
            requests=count,
            example=labels[div.request],
            at_tokens=[min(ats), max(ats)],
            tokens_after=past,
        )
        if lines.decode is not None and not index.hashed:
            prefix = lines.decode(index.tokens(div.request)[: div.at].tolist())
            rec["line"] = prefix.count("\n") + 1  # of this prompt's text, from 1
        out.append(rec)
    return out


class _LineStarts:
    """Where the line holding a token starts, from which token ids decode to a line break."""

    def __init__(self, decode: Decode | None) -> None:
        self.decode = decode
        self._breaks: dict[int, bool] = {}

    def start(self, tokens: np.ndarray, at: int) -> int:
        prefix = tokens[:at]
        for t in np.unique(prefix).tolist():
            if t not in self._breaks:
                self._breaks[t] = "\n" in (self.decode([t]) or "")
        breaks = np.fromiter((t for t, b in self._breaks.items() if b), dtype=np.int64)
        hits = np.flatnonzero(np.isin(prefix, breaks))
        return int(hits[-1]) + 1 if hits.size else 0


def notes(
    workload: Workload, base: EngineConfig, now: dict[str, Any], layout: bool = False
) -> list[str]:
    """What the input cannot show, and how the figures were made (``layout``: the prompts'
    layout was looked at)."""
    out = list(workload.notes)
    if not layout and not workload.hashed:
        why = "the prompts are not all text (token ids, or a trace's)"
        if not base.enable_prefix_caching:
            why = "prefix caching is off"
        out.append(f"the prompts' layout is not looked at: {why}")
    if workload.hashed:
        m = MOONCAKE_BLOCK_SIZE
        out.append(
            f"this trace names its prompts by hash ids of {m}-token blocks: equal ids are "
            f"equal blocks, and nothing finer is known, so block sizes below {m} cannot be "
            f"evaluated faithfully (they show no sharing inside a {m}-token block, where real "
            "text may share more); the token-level bound is not run and the prompts have no "
            "text"
        )
        if base.block_size < m:
            out.append(
                f"block size {base.block_size} is below the trace's {m}: the hit rate now is "
                f"what {m}-token sharing gives at that block size"
            )
    elif not token_level_possible(workload):
        out.append(
            f"the token-level bound is not run: over {TOKEN_LEVEL_MAX_TOKENS:,} tokens in all "
            "would each be a block"
        )
    if now["rejected"]:
        out.append(
            f"{now['rejected']:,} of {now['rejected'] + now['requests']:,} requests were left "
            f"out, as replay leaves them out (the first: {now['first_rejection']})"
        )
    if workload.kind == "trace" and workload.recorded and not workload.recorded["dry_run"]:
        out.append(
            "the trace is of a model run: its requests are run again as a dry run (same prompts, "
            "output lengths and arrivals), so the hit rate now can differ a little from the "
            "recorded one"
        )
    out.append(
        "every hit rate is a dry run's (the engine's accounting on a virtual clock, "
        f"arrivals {workload.arrivals}); each gain is that run against the run now, and a "
        "layout finding's is a run of the prompts with its fix applied"
    )
    return out


def default_jobs() -> int:
    """Processes for the grid: two where this process may use two CPUs."""
    from ..engine.config import available_cpus

    return max(1, min(2, available_cpus()))
