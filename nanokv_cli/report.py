"""Summary metrics of a run, gathered from engine events and request outputs.

``hit_rate`` is request-level: prompt tokens served from the prefix cache at each request's
first admission, over all prompt tokens of finished requests (vLLM's prefix-cache hit rate).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .engine.block_manager import BlockManager
from .engine.events import Event, SequenceAdded, SequenceFinished, StepSnapshot
from .engine.llm_engine import RequestOutput


class RunStats:
    """An event listener that keeps the running totals a report needs.

    Token latencies come from each step's ``RequestOutput``s (``observe``): only model runs
    have meaningful ones, so the dry run skips them.
    """

    def __init__(self, infinite: InfiniteCache | None = None) -> None:
        self.infinite = infinite  # fed each prompt as it is added (dry-run upper bound)
        self.requests = 0
        self.finished = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.cached_tokens = 0
        self.peak_used_blocks = 0
        self.last: StepSnapshot | None = None
        self.step_wall_time = 0.0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.e2e: list[float] = []
        self._last_token_time: dict[int, float] = {}

    def __call__(self, event: Event) -> None:
        t = type(event)
        if t is StepSnapshot:
            self.last = event
            self.step_wall_time += event.wall_time
            if event.num_used_blocks > self.peak_used_blocks:
                self.peak_used_blocks = event.num_used_blocks
        elif t is SequenceFinished:
            self.finished += 1
            self.prompt_tokens += event.num_prompt_tokens
            self.output_tokens += event.num_completion_tokens
            self.cached_tokens += max(0, event.num_cached_tokens)
        elif t is SequenceAdded:
            self.requests += 1
            if self.infinite is not None:
                self.infinite.add(event.prompt_token_ids)

    def observe(self, outputs: list[RequestOutput], now: float) -> None:
        """Record token latencies from one step's outputs (``now``: the engine clock)."""
        last = self._last_token_time
        for out in outputs:
            prev = last.get(out.seq_id)
            if prev is None:
                self.ttft.append(now - out.arrival_time)
            else:
                self.itl.append(now - prev)
            if out.finished:
                last.pop(out.seq_id, None)
                self.e2e.append(now - out.arrival_time)
            else:
                last[out.seq_id] = now

    def report(self, *, duration: float, wall_time: float, **config: Any) -> dict[str, Any]:
        s = self.last
        total_tokens = self.prompt_tokens + self.output_tokens
        report: dict[str, Any] = {
            **config,
            "requests": self.finished,
            "requests_added": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": _ratio(self.cached_tokens, self.prompt_tokens),
            # Token lookups of every admission, re-admissions after preemption included.
            "cache_queries": s.queries if s else 0,
            "shared_hit_tokens": s.shared_hits if s else 0,
            "revived_hit_tokens": s.revived_hits if s else 0,
            "evictions": s.evictions if s else 0,
            "preemptions": s.preemptions if s else 0,
            "peak_used_blocks": self.peak_used_blocks,
            "steps": s.step if s else 0,
            "duration_s": duration,
            "wall_time_s": wall_time,
            "request_throughput": _ratio(self.finished, duration),
            "output_throughput": _ratio(self.output_tokens, duration),
            "total_token_throughput": _ratio(total_tokens, duration),
        }
        if self.infinite is not None:
            report["infinite_cache_hit_rate"] = self.infinite.hit_rate
        if self.ttft:
            report["ttft_s"] = percentiles(self.ttft)
            report["itl_s"] = percentiles(self.itl)
            report["e2e_latency_s"] = percentiles(self.e2e)
        return report


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean and nearest-rank p50/p90/p99 (zeros for an empty list)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    v = sorted(values)
    n = len(v)

    def rank(p: float) -> float:
        return v[min(n - 1, max(0, -(-p * n // 100) - 1))]

    return {"mean": sum(v) / n, "p50": rank(50), "p90": rank(90), "p99": rank(99)}


class InfiniteCache:
    """The hit rate a cache that never evicts would reach, requests taken in arrival order.

    The upper bound for the dry-run comparison: each prompt hits the longest prefix of full
    blocks some earlier prompt had (never the block holding its last token, as in the engine),
    then all its full blocks count as cached.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seen: set[int] = set()
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def add(self, token_ids: list[int]) -> list[tuple[int, bool]]:
        """Look a prompt up, then cache it; returns (chained hash, hit) per full block."""
        bs = self.block_size
        blocks = []
        prefix = -1
        hitting = True
        for i in range(len(token_ids) // bs):
            prefix = BlockManager.compute_hash(token_ids[i * bs : (i + 1) * bs], prefix)
            hitting = hitting and prefix in self.seen and (i + 1) * bs < len(token_ids)
            if hitting:
                self.hit_tokens += bs
            else:
                self.seen.add(prefix)
            blocks.append((prefix, hitting))
        self.prompt_tokens += len(token_ids)
        return blocks

    @property
    def hit_rate(self) -> float:
        return _ratio(self.hit_tokens, self.prompt_tokens)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write JSON so that ``path`` holds either its old content or the whole new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a report is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
