"""Summary metrics of a run, gathered from engine events and request outputs.

The prefix-cache numbers are the engine's own counters (``cache_stats.CacheStats``) as the
last step snapshot carried them, under the same names the live view, ``--json``, traces and
metrics use: ``hit_rate = cache_hits / cache_queries`` over each request's first admission
(vLLM's ``prefix_cache_hits / prefix_cache_queries``); re-admissions after preemption are
counted apart (``readmission_*``); ``miss_tokens`` splits every missed token by reason.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.core.blocks import hash_block_tokens
from ..engine.core.cache_numbers import cache_numbers, lookup_record, ratio, tier_numbers
from ..engine.core.events import (
    BlockStored,
    CacheLookup,
    Event,
    SequenceAdded,
    SequenceFinished,
    SequencePreempted,
    StepSnapshot,
)
from ..engine.core.llm_engine import RequestOutput


class RunStats:
    """An event listener that keeps the running totals a report needs.

    Token latencies come from each step's ``RequestOutput``s (``observe``): only model runs
    have meaningful ones, so the dry run skips them. With ``on_request``, every finished
    request is handed over as one record (``request_record``) the moment it finishes.
    """

    def __init__(
        self,
        infinite: InfiniteCache | None = None,
        on_request: Callable[[dict[str, Any]], None] | None = None,
        latencies: bool = False,
        divergence=None,
    ) -> None:
        """``latencies``: ``observe`` is called after every step, so a finished request's
        record waits for its last token's time; else records carry no latencies.
        ``divergence``: a ``divergence.DivergenceRecorder`` giving each record where its prompt
        parts from the earlier prompt it shares the most with."""
        # The dry-run upper bound: fed each prompt as it is added, each block the engine
        # stores, and each finished sequence's tokens (``learn``).
        self.infinite = infinite
        # Of unfinished sequences while ``infinite`` learns in token mode: the prompt's last
        # full block's hash and the tokens after it.
        self._prompts: dict[int, tuple[int, Any]] = {}
        self.divergence = divergence
        self.on_request = on_request
        self.latencies = latencies
        self.requests = 0
        self.finished = 0
        self.aborted = 0  # requests dropped before they finished (a client went away)
        self.aborted_output_tokens = 0  # of output_tokens: generated for those requests
        # Prompt tokens of aborted requests that had got a token (their prompt was all in the
        # cache): not of the finished requests', but processed all the same.
        self.aborted_prompt_tokens = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.computed_prompt_tokens = 0  # prefill tokens the steps computed (misses + recompute)
        self.peak_used_blocks = 0
        self.last: StepSnapshot | None = None
        self.step_wall_time = 0.0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.e2e: list[float] = []
        self._last_token_time: dict[int, float] = {}
        self._live: dict[int, dict[str, Any]] = {}  # per-request records until they finish
        self._ttft: dict[int, float] = {}  # seq_id -> time to its first token
        self._gaps: dict[int, list] = {}  # seq_id -> [sum, count, max] of its inter-token gaps
        self._finishing: dict[int, dict[str, Any]] = {}  # finished in this step, not observed

    def __call__(self, event: Event) -> None:
        t = type(event)
        if t is StepSnapshot:
            self.last = event
            self.step_wall_time += event.wall_time
            self.computed_prompt_tokens += event.num_prefill_tokens
            used = max(event.num_used_blocks, event.step_used_blocks)  # the latter: new traces
            if used > self.peak_used_blocks:
                self.peak_used_blocks = used
        elif t is CacheLookup:
            if self.on_request is not None:
                rec = self._live.get(event.seq_id)
                if rec is not None:
                    if event.first:
                        rec.update(lookup_record(event))
                    else:
                        rec["readmission_hit_tokens"] += event.num_hit_tokens
        elif t is BlockStored:
            if self.infinite is not None:
                self.infinite.stored(event.block_hash, event.parent_hash, event.token_ids)
        elif t is SequenceFinished:
            if event.reason == "abort":
                # What an aborted request streamed was generated and delivered: a summary
                # after Ctrl-C or a disconnect counts it (and says how much it was).
                self.aborted += 1
                self.aborted_output_tokens += event.num_completion_tokens
                if event.num_completion_tokens:
                    self.aborted_prompt_tokens += event.num_prompt_tokens
                # No output marks an abort finished: forget its last token time here, or a
                # server with --report would keep one per disconnected client.
                self._last_token_time.pop(event.seq_id, None)
            else:
                self.finished += 1
                self.prompt_tokens += event.num_prompt_tokens
            self.output_tokens += event.num_completion_tokens
            if self.on_request is not None:
                rec = self._live.pop(event.seq_id, None)
                if rec is not None:
                    rec.update(
                        output_tokens=event.num_completion_tokens, finish_reason=event.reason
                    )
                    if self.latencies and event.reason != "abort":
                        # Its last token's time comes with this step's outputs (observe).
                        self._finishing[event.seq_id] = rec
                    else:
                        self._complete(rec, event.seq_id, None)
        elif t is SequencePreempted:
            rec = self._live.get(event.seq_id)
            if rec is not None:
                rec["preemptions"] += 1
        elif t is SequenceAdded:
            self.requests += 1
            if self.infinite is not None:
                prompt = event.prompt_token_ids
                blocks = self.infinite.add(prompt)
                if self.infinite.tokens:  # where its last block will start, to learn it at the end
                    rest = prompt[len(blocks) * self.infinite.block_size :]
                    self._prompts[event.seq_id] = (blocks[-1][0] if blocks else -1, rest)
            if self.on_request is not None:
                # Keys in the order a reader wants them; the rest is filled in as it happens.
                self._live[event.seq_id] = {
                    "line": None,
                    "seq_id": event.seq_id,
                    "prompt_tokens": len(event.prompt_token_ids),
                    "cached_tokens": 0,
                    "miss_reason": None,
                    "miss_block": None,
                    "divergence": None
                    if self.divergence is None
                    else self.divergence.record(
                        event.seq_id, event.prompt_token_ids, event.prompt_recipe
                    ),
                    "preemptions": 0,
                    "readmission_hit_tokens": 0,
                    "arrival_time": event.arrival_time,
                }

    def tag(self, seq_id: int, **fields: Any) -> None:
        """Attach the caller's fields (e.g. the prompt file's line) to a request's record."""
        rec = self._live.get(seq_id)
        if rec is not None:
            rec.update(fields)

    def undelivered(self, tokens: int) -> None:
        """``tokens`` that aborted requests generated never reached a client (a server knows):
        the output counted is what clients received."""
        tokens = min(tokens, self.aborted_output_tokens)
        self.output_tokens -= tokens
        self.aborted_output_tokens -= tokens

    def learn(self, outputs: list[RequestOutput]) -> None:
        """Show the infinite cache the sequences that finished this step, whole."""
        for out in outputs:
            if out.finished:
                started = self._prompts.pop(out.seq_id, None)
                if started is not None:
                    parent, rest = started
                    self.infinite.finished(parent, [*rest, *out.token_ids])

    def observe(self, outputs: list[RequestOutput], now: float) -> None:
        """Record token latencies from one step's outputs (``now``: the engine clock)."""
        last = self._last_token_time
        records = self.on_request is not None
        for out in outputs:
            prev = last.get(out.seq_id)
            if prev is None:
                self.ttft.append(now - out.arrival_time)
                if records:  # an aborted request keeps its first token's
                    self._ttft[out.seq_id] = now - out.arrival_time
            else:
                self.itl.append(now - prev)
                if records:
                    gaps = self._gaps.setdefault(out.seq_id, [0.0, 0, 0.0])  # sum, count, max
                    gaps[0] += now - prev
                    gaps[1] += 1
                    gaps[2] = max(gaps[2], now - prev)
            if out.finished:
                last.pop(out.seq_id, None)
                self.e2e.append(now - out.arrival_time)
                rec = self._finishing.pop(out.seq_id, None)
                if rec is not None:
                    self._complete(rec, out.seq_id, now - out.arrival_time)
            else:
                last[out.seq_id] = now

    def flush(self) -> None:
        """Hand over the records still waiting for their last token's time (a step cut short
        by Ctrl-C returns no outputs): a run that ends writes every finished request."""
        for seq_id, rec in list(self._finishing.items()):
            del self._finishing[seq_id]
            self._complete(rec, seq_id, None)

    def _complete(self, rec: dict[str, Any], seq_id: int, e2e: float | None) -> None:
        """Hand a finished request's record over, with its latencies."""
        total, count, longest = self._gaps.pop(seq_id, (0.0, 0, None))
        rec.update(
            ttft_s=self._ttft.pop(seq_id, None),
            e2e_latency_s=e2e,
            itl_mean_s=total / count if count else None,
            itl_max_s=longest,
        )
        self.on_request(rec)

    def report(self, *, duration: float, wall_time: float, **config: Any) -> dict[str, Any]:
        # Every prompt token processed: after Ctrl-C aborts every request, "prompt + output"
        # would otherwise be the output alone.
        total_tokens = self.prompt_tokens + self.aborted_prompt_tokens + self.output_tokens
        report: dict[str, Any] = {
            **config,
            "requests": self.finished,
            "requests_added": self.requests,
            "requests_aborted": self.aborted,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_aborted": self.aborted_output_tokens,
            "prompt_tokens_aborted": self.aborted_prompt_tokens,
            **cache_numbers(self.last),
            **(tier_numbers(self.last, config["kv_tier"]) if config.get("kv_tier") else {}),
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "peak_used_blocks": self.peak_used_blocks,
            "steps": self.last.step + 1 if self.last else 0,
            "duration_s": duration,
            "wall_time_s": wall_time,
            "request_throughput": ratio(self.finished, duration),
            "output_throughput": ratio(self.output_tokens, duration),
            "total_token_throughput": ratio(total_tokens, duration),
        }
        if self.infinite is not None:
            report["infinite_cache_hit_rate"] = self.infinite.hit_rate
        if self.ttft:
            report["ttft_s"] = percentiles(self.ttft)
            report["itl_s"] = percentiles(self.itl)
            report["e2e_latency_s"] = percentiles(self.e2e)
        return report


def percentiles(values: list[float]) -> dict[str, float | None]:
    """Mean and nearest-rank p50/p90/p99; None for an empty list (no data is not 0 s)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(values)
    n = len(v)

    def rank(p: float) -> float:
        return v[min(n - 1, max(0, -(-p * n // 100) - 1))]

    return {"mean": sum(v) / n, "p50": rank(50), "p90": rank(90), "p99": rank(99)}


class InfiniteCache:
    """The hit rate a cache that never evicts would reach, requests taken in arrival order.

    The upper bound for the dry-run comparison: each prompt hits the longest prefix of full
    blocks the cache ever held (never the block holding its last token, as in the engine),
    then all its full blocks count as cached. With ``prefix_match="token"`` (the engine's
    default) it then also hits the longest run of the next block's tokens that an earlier
    sequence continuing the same prefix shared, all but the prompt's last token at most.

    The engine caches generated tokens too (a second turn that repeats the first turn's prompt
    and answer hits both), so the cache is fed what the engine stored as it stored it
    (``stored``: every full block, prompt or generated) and each finished sequence's last,
    partly filled block (``finished``): a bound on prompts alone would sit below what runs reach.
    """

    # Token-level: the distinct block contents kept, as bytes, to find the longest shared run;
    # past this many bytes a lookup counts the whole rest of the block once an earlier
    # continuation starts with the same token (still an upper bound, looser).
    MAX_CONTENT_BYTES = 64 << 20

    def __init__(self, block_size: int, prefix_match: str = "token") -> None:
        self.block_size = block_size
        self.tokens = prefix_match == "token"
        self.seen: set[int] = set()
        # parent hash -> the sorted contents (big-endian uint32 bytes: byte order is token
        # order) of the blocks earlier prompts had after it. The longest run shared with any
        # of them is shared with a neighbour in sorted order.
        self.continuations: dict[int, list[bytes]] = {}
        self.first_tokens: set[tuple[int, int]] = set()  # (parent hash, first token)
        self.content_bytes = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def add(self, token_ids: list[int]) -> list[tuple[int, bool]]:
        """Look a prompt up, then cache it; returns (chained hash, hit) per full block."""
        bs = self.block_size
        blocks = []
        prefix = -1
        hitting = True
        hit_prefix, hit_blocks = -1, 0  # the hash before the first block that missed
        new: list[tuple[int, int]] = []  # (parent hash, block index) of blocks not seen yet
        for i in range(len(token_ids) // bs):
            parent = prefix
            prefix = hash_block_tokens(token_ids[i * bs : (i + 1) * bs], prefix)
            hitting = hitting and prefix in self.seen and (i + 1) * bs < len(token_ids)
            if hitting:
                self.hit_tokens += bs
                hit_prefix, hit_blocks = prefix, i + 1
            elif prefix not in self.seen:
                new.append((parent, i))
                self.seen.add(prefix)
            blocks.append((prefix, hitting))
        if self.tokens:  # looked up first, then this prompt's own blocks are remembered
            start = hit_blocks * bs
            self.hit_tokens += self._shared(hit_prefix, token_ids[start : len(token_ids) - 1])
            for parent, i in new:
                self._remember(parent, token_ids[i * bs : (i + 1) * bs])
            if len(token_ids) % bs:
                self._remember(prefix, token_ids[len(token_ids) // bs * bs :])
        self.prompt_tokens += len(token_ids)
        return blocks

    def stored(self, block_hash: int, parent: int, token_ids) -> None:
        """The engine registered a full block (a prompt's or a generated one): cached for good."""
        if block_hash not in self.seen:
            self.seen.add(block_hash)
            if self.tokens:
                self._remember(parent, token_ids)

    def finished(self, parent: int, token_ids) -> None:
        """A sequence ended with ``token_ids`` after the full blocks chained into ``parent``
        (its prompt's last full block's hash, -1 for none; then the prompt's rest and the
        output): its partly filled last block stays in the cache, which token-granular reuse
        can copy from. It holds every token but the last sampled one, whose K/V no step
        computed."""
        computed = token_ids[:-1]
        if not self.tokens or not len(computed) % self.block_size:
            return  # a full last block was stored as such
        bs, full = self.block_size, len(computed) // self.block_size * self.block_size
        for i in range(0, full, bs):
            parent = hash_block_tokens(computed[i : i + bs], parent)
        self._remember(parent, computed[full:])

    def _remember(self, parent: int, block: list[int]) -> None:
        self.first_tokens.add((parent, int(block[0])))
        if self.content_bytes > self.MAX_CONTENT_BYTES:
            return
        item = np.asarray(block, dtype=">u4").tobytes()
        contents = self.continuations.setdefault(parent, [])
        i = bisect.bisect_left(contents, item)
        if i == len(contents) or not contents[i].startswith(item):
            contents.insert(i, item)
            self.content_bytes += len(item)

    def _shared(self, parent: int, wanted: list[int]) -> int:
        """The most leading tokens of ``wanted`` (at most a block) an earlier continuation of
        ``parent`` had."""
        wanted = wanted[: self.block_size]
        if not len(wanted) or (parent, int(wanted[0])) not in self.first_tokens:
            return 0
        if self.content_bytes > self.MAX_CONTENT_BYTES:
            return len(wanted)
        contents = self.continuations.get(parent, [])
        item = np.asarray(wanted, dtype=">u4").tobytes()
        i = bisect.bisect_left(contents, item)
        near = [contents[j] for j in (i - 1, i) if 0 <= j < len(contents)]
        return max((_common_bytes(item, c) for c in near), default=0) // 4

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_tokens, self.prompt_tokens)


def _common_bytes(a: bytes, b: bytes) -> int:
    """Length of the common prefix of ``a`` and ``b``, by bisection on C-level comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def write_json_atomic(path: str | Path, obj: Any, flag: str = "--report") -> None:
    """Write JSON so that ``path`` holds either its old content or the whole new one (see
    ``paths.write_atomic``: no symlinks or special files; an old file's permissions kept)."""
    from ..paths import write_atomic

    write_atomic(Path(path), json_text(obj).encode("utf-8"), flag)


def json_text(obj: Any) -> str:
    """``obj`` as indented JSON, with every NaN or infinity written as null: JSON has no such
    numbers, and a report holding them would not parse elsewhere."""
    return json.dumps(finite(obj), indent=2, allow_nan=False) + "\n"


def finite(obj: Any) -> Any:
    """``obj`` with non-finite floats replaced by None (in dicts, lists and tuples)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj
