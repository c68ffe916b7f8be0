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
* the changes, ranked by measured gain: block size, cache size, prefix-match mode (where the
  engine has them), and prompt layout (a varying first line moved after the shared text);
* what the input cannot show (a Mooncake trace's 512-token hash ids).

No typer or rich here: the CLI, ``serve`` and scripts call it; ``views/advise.py`` draws it.
Grid points are independent runs, so ``jobs > 1`` runs them in a pool of processes.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .divergence import Decode, PrefixIndex
from .driver import Arrivals, Driver, PromptEncoder, Request, build_requests, dry_run_engine
from .engine.config import EngineConfig
from .engine.mooncake import MOONCAKE_BLOCK_SIZE, SynthesizedPrompt
from .engine.sampling_params import SamplingParams
from .prompts import PromptFile, PromptRequest

# The block-size bound runs every token as a block: past this many tokens in all (prompts and
# outputs) its books would take minutes and gigabytes, and it is left out with a note.
TOKEN_LEVEL_MAX_TOKENS = 4_000_000
# Block sizes tried for a prompt file (besides half and twice the current one).
BLOCK_SIZES = (16, 64, 256)
TOP_POINTS = 5  # divergence points listed
TOP_CHANGES = 5  # changes in the ranked list
# Below this many tokens in all a run takes milliseconds: a process pool would cost more.
POOL_MIN_TOKENS = 1_000_000
HAS_PREFIX_MATCH = "prefix_match" in {f.name for f in dataclasses.fields(EngineConfig)}
PREFIX_MATCH_MODES = ("token", "block")


# -- the input -----------------------------------------------------------------------------------


@dataclass
class Workload:
    """The requests advise re-runs (in arrival order) and what it knows of their prompts."""

    source: str
    kind: str  # "prompts", "mooncake" (a Mooncake trace file) or "trace" (a nanokv trace)
    requests: list[Request]
    labels: list[Any]  # a request's name for people: its file line, or a trace's seq id
    decode: Decode | None = None
    # The requests with each varying first line moved after the shared text, and how many
    # prompts that moves; None where the prompts have no text.
    relayout: Callable[[], tuple[list[Request], int]] | None = None
    recorded: dict[str, Any] | None = None  # a trace's own cache numbers
    arrivals: str = "all at once"
    notes: list[str] = field(default_factory=list)

    @property
    def hashed(self) -> bool:
        """Prompts synthesized from 512-token hash ids (a Mooncake trace)."""
        return bool(self.requests) and isinstance(
            self.requests[0].prompt_token_ids, SynthesizedPrompt
        )


def prompt_file_workload(
    pf: PromptFile,
    encoder: PromptEncoder,
    defaults: SamplingParams,
    rate: float | None = None,
) -> Workload:
    """A prompt file's requests as ``replay`` builds them (same encoder, defaults, arrivals)."""
    requests = build_requests(pf, encoder, defaults, rate)
    relayout = None
    if any(_text_of(r) is not None for r in pf.requests):

        def relayout() -> tuple[list[Request], int]:
            moved, n = move_varying_first_lines(pf.requests)
            changed = PromptFile(pf.path, pf.format, moved)
            return build_requests(changed, encoder, defaults, rate), n

    decode = None
    if encoder.loaded:

        def decode(ids: Sequence[int]) -> str:
            return encoder.tokenizer.decode(list(ids), skip_special_tokens=False)

    arrivals = "rate" if rate is not None else "timestamps" if pf.has_timestamps else "all at once"
    return Workload(
        source=str(pf.path),
        kind="mooncake" if pf.format == "mooncake" else "prompts",
        requests=requests,
        labels=[r.tag for r in requests],
        decode=decode,
        relayout=relayout,
        arrivals=arrivals,
    )


def trace_workload(path: str | Path) -> Workload:
    """A nanokv trace's requests, to run again: each prompt as recorded, its recorded number
    of output tokens (EOS ignored), its arrival time from the first one's."""
    from .trace import TraceReader

    reader = TraceReader(path)
    v1 = reader.num_requests() is None  # a format 1 trace: its prompts are in its events
    added: dict[int, tuple[int, float]] = {}
    produced: dict[int, int] = {}
    prompts: dict[int, Any] = {}
    for event in reader.events(tokens=v1):
        name = type(event).__name__
        if name == "SequenceAdded":
            added[event.seq_id] = (event.max_tokens, event.arrival_time)
            if v1:
                prompts[event.seq_id] = _prompt_of(event.prompt_token_ids, event.prompt_recipe)
        elif name == "SequenceFinished" and event.reason != "abort":
            produced[event.seq_id] = event.num_completion_tokens
    if not added:
        raise ValueError(f"{path}: the trace holds no requests")
    start = min(t for _, t in added.values())
    requests = []
    for seq_id in sorted(added, key=lambda s: (added[s][1], s)):
        max_tokens, arrival = added[seq_id]
        if seq_id not in prompts:
            tokens, recipe = reader.prompt(seq_id)
            prompts[seq_id] = _prompt_of(tokens, recipe)
        params = SamplingParams(
            temperature=0.0, max_tokens=max(1, produced.get(seq_id, max_tokens)), ignore_eos=True
        )
        requests.append(Request(prompts.pop(seq_id), params, arrival - start, tag=seq_id))
    model, _ = reader.model_path()
    from .divergence import lazy_decoder

    summary = reader.summary()
    return Workload(
        source=str(path),
        kind="trace",
        requests=requests,
        labels=[r.tag for r in requests],
        decode=lazy_decoder(model),
        recorded={
            "block_size": reader.block_size,
            "num_blocks": reader.num_blocks,
            "dry_run": bool(reader.header.get("dry_run")),
            **summary["cache"],
        },
        arrivals="as recorded",
    )


def _prompt_of(tokens: Sequence[int], recipe: Any) -> Any:
    if recipe is not None:
        return SynthesizedPrompt.from_recipe(recipe)
    return list(tokens)


def is_trace(path: str | Path) -> bool:
    """Whether ``path`` is a nanokv trace (format 2, or a format 1 JSONL one)."""
    from .trace import MAGIC, TRACE_FORMAT

    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(MAGIC):
        return True
    return head.startswith(b"{") and f'"format": "{TRACE_FORMAT}"'.encode() in head


# -- prompt layout ---------------------------------------------------------------------------------


def _text_of(r: PromptRequest) -> str | None:
    if r.prompt is not None:
        return r.prompt
    if r.messages:
        return r.messages[0]["content"]
    return None


def _split(text: str | None) -> tuple[str, str] | None:
    if text is None:
        return None
    first, sep, rest = text.partition("\n")
    return (first, rest) if sep and rest.strip() else None


def move_varying_first_lines(
    requests: Sequence[PromptRequest],
) -> tuple[list[PromptRequest], int]:
    """The requests with each varying first line moved to the end of its text
    (``rest + "\\n" + first``), and how many moved.

    A first line varies when no other prompt starts with it, while the line after it opens
    some other prompt (as its first or second line): the text after it is shared, so putting
    the varying line last lets the shared text be a common prefix. Chat requests: their first
    message."""
    splits = [_split(_text_of(r)) for r in requests]
    firsts = Counter(s[0] for s in splits if s)
    openings: Counter[str] = Counter()
    for r, s in zip(requests, splits):
        lines = {s[0], s[1].partition("\n")[0]} if s else {(_text_of(r) or "").partition("\n")[0]}
        openings.update(lines)
    out, moved = [], 0
    for r, s in zip(requests, splits):
        if s is None or firsts[s[0]] > 1:
            out.append(r)
            continue
        opening = s[1].partition("\n")[0]
        own = {s[0], opening}
        if openings[opening] - (opening in own) < 1:
            out.append(r)
            continue
        text = s[1] + "\n" + s[0]
        if r.prompt is not None:
            out.append(replace(r, prompt=text))
        else:
            messages = [dict(m) for m in r.messages]
            messages[0]["content"] = text
            out.append(replace(r, messages=messages))
        moved += 1
    return out, moved


# -- one dry run -------------------------------------------------------------------------------------


def below_block(requests: list[Request], config: EngineConfig) -> tuple[int, int]:
    """Prompts (and their tokens) of at most one block, which whole-block reuse can never
    serve: the engine counts their lookups as ``last-block`` (every one of them: no full block
    comes before the last), advise as ``below-block``."""
    if not config.enable_prefix_caching or getattr(config, "prefix_match", "block") != "block":
        return 0, 0
    short = [n for n in map(_prompt_len, requests) if n <= config.block_size]
    return len(short), sum(short)


def dry_run(requests: list[Request], config: EngineConfig) -> dict[str, Any]:
    """One dry run of ``requests`` at ``config``, as ``replay --dry-run`` runs it (the same
    driver loop and arrivals), and the engine's cache counters at its end.

    Nobody listens to the engine's events: its books and counters are the same either way,
    and building an event for every block change takes about half of a listened run."""
    engine, clock = dry_run_engine(config)
    rejected = 0

    def on_rejected(req: Request, error: Exception) -> None:
        nonlocal rejected
        rejected += 1

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


def never_evicting_blocks(requests: list[Request], block_size: int) -> int:
    """A cache no run of ``requests`` can fill: every block each request may hold (prompt and
    outputs), added up. The free queue hands out clean blocks first, so it never evicts."""
    return sum(
        -(-(_prompt_len(r) + r.sampling_params.max_tokens) // block_size) + 1 for r in requests
    )


def _prompt_len(r: Request) -> int:
    p = r.prompt_token_ids
    n = getattr(p, "input_length", None)
    if n is not None:
        return n
    return len(p) if hasattr(p, "__len__") else 0


def grid(workload: Workload, base: EngineConfig, layout_moved: int = 0) -> list[Point]:
    """The runs advise needs: now, the bounds, then each change it can measure."""
    bs, n = base.block_size, base.num_blocks
    requests = workload.requests
    infinite = max(n, never_evicting_blocks(requests, bs))
    points = [
        Point("now", "now", "as given", base),
        Point(
            "bound",
            "never-evicting cache",
            f"a cache that never evicts (--num-blocks {infinite:,})",
            replace(base, num_blocks=infinite),
        ),
    ]
    if _token_level_possible(workload):
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


def _token_level_possible(workload: Workload) -> bool:
    if workload.hashed:
        return False
    total = sum(_prompt_len(r) + r.sampling_params.max_tokens for r in workload.requests)
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
    tokens = sum(_prompt_len(r) for r in inputs[False])
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
    inputs = {False: workload.requests}
    moved = 0
    if workload.relayout is not None and base.enable_prefix_caching:
        relaid, moved = workload.relayout()
        if moved:
            inputs[True] = relaid
    points = grid(workload, base, moved)
    runs = evaluate(points, inputs, jobs)
    now = runs[0]
    rows = [_row(p, r, now) for p, r in zip(points, runs)]
    bounds = {r["label"]: r for r in rows if r["kind"] == "bound"}
    # The never-evicting cache is a setting too (a bigger --num-blocks); block size 1 is not
    # one to run (token-granular prefix matching is how to get near it).
    changes = sorted(
        (r for r in rows if r["kind"] != "now" and r["label"] != "token-level" and r["gain"] > 0),
        key=lambda r: (-r["gain"], r["change"]),
    )
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
        "verdict": verdict(now, list(bounds.values()), changes),
        "grid": rows,
        "notes": notes(workload, base, now),
        "wall_time_s": time.perf_counter() - t0,
    }


def _row(point: Point, run: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": point.kind,
        "label": point.label,
        "change": point.change,
        "layout": point.layout,
        **run,
        **settings_of(point.config),  # a cache past never-evicting ran as never-evicting
        "gain": run["hit_rate"] - now["hit_rate"],
        "tokens_saved": run["cache_hits"] - now["cache_hits"],  # fewer computed at admission
    }


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
        if div is None:
            continue
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


def notes(workload: Workload, base: EngineConfig, now: dict[str, Any]) -> list[str]:
    """What the input cannot show, and how the figures were made."""
    out = list(workload.notes)
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
    elif not _token_level_possible(workload):
        out.append(
            f"the token-level bound is not run: over {TOKEN_LEVEL_MAX_TOKENS:,} tokens in all "
            "would each be a block"
        )
    if now["rejected"]:
        out.append(f"{now['rejected']:,} requests were too big for the cache and left out")
    if workload.kind == "trace" and workload.recorded and not workload.recorded["dry_run"]:
        out.append(
            "the trace is of a model run: its requests are run again as a dry run (same prompts, "
            "output lengths and arrivals), so the hit rate now can differ a little from the "
            "recorded one"
        )
    out.append(
        "every hit rate is a dry run's (the engine's accounting on a virtual clock, "
        f"arrivals {workload.arrivals}); each gain is that run against the run now"
    )
    return out


def default_jobs() -> int:
    """Processes for the grid: two where this process may use two CPUs."""
    from .engine.config import available_cpus

    return max(1, min(2, available_cpus()))


__all__ = [
    "Workload",
    "advise",
    "default_jobs",
    "dry_run",
    "evaluate",
    "grid",
    "is_trace",
    "move_varying_first_lines",
    "prompt_file_workload",
    "trace_workload",
]
