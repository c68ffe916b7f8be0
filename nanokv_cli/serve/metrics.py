"""The server's Prometheus metrics (``/metrics``): vLLM's names where the meaning is the same."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as prometheus_text
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.core.cache_numbers import cache_numbers
from ..engine.core.cache_stats import MISS_REASONS
from ..engine.core.events import AllBlocksCleared, BlockAllocated, BlockCopied, BlockHit

# Buckets as vLLM's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TOKEN_BUCKETS = tuple(float(n) for n in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                          8192, 16384, 32768, 65536, 131072))  # fmt: skip
_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                      10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)  # fmt: skip

# Where a prompt token's K/V came from, in vLLM's words: computed here, this engine's prefix
# cache, or another engine (nanokv transfers none).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# Which tier served a cached prompt token (vLLM's sources): the device cache, or the second
# tier (kv_tier: host or disk) its restored blocks came from.
CACHED_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")

# report.cache_numbers() name -> (metric name, help). vLLM's names where the meaning is the same.
CACHE_COUNTERS = {
    "cache_queries": (
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache (first admissions).",
    ),
    "cache_hits": ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "preemptions": ("vllm:num_preemptions", "Sequences preempted (recomputed)."),
    "shared_hit_tokens": (
        "nanokv:prefix_cache_shared_hits",
        "Hit tokens whose block was in use by another sequence (ref count grew).",
    ),
    "revived_hit_tokens": (
        "nanokv:prefix_cache_revived_hits",
        "Hit tokens whose block was free but still cached (taken back from the free queue).",
    ),
    "copied_hit_tokens": (
        "nanokv:prefix_cache_copied_hits",
        "Hit tokens whose K/V were copied from a cached block sharing their leading tokens.",
    ),
    "restored_hit_tokens": (
        "nanokv:prefix_cache_restored_hits",
        "Hit tokens whose blocks were restored from the second tier (--kv-tier) after the "
        "cache evicted them.",
    ),
    "evictions": ("nanokv:prefix_cache_evictions", "Cached blocks whose hash was evicted."),
    "readmission_queries": (
        "nanokv:prefix_cache_readmission_queries",
        "Tokens looked up again after a preemption (not in the hit rate).",
    ),
    "readmission_hits": (
        "nanokv:prefix_cache_readmission_hits",
        "Re-admission tokens served from the cache.",
    ),
}


class Metrics:
    """Prometheus metrics of one server: counters and gauges read from the engine's last step
    snapshot at scrape time, token counters and latency histograms fed by the engine thread."""

    def __init__(
        self,
        model_name: str,
        num_blocks: int,
        snapshot: Callable[[], Any],
        cache_config: Mapping[str, Any] | None = None,
        tier_medium: str | None = None,
    ) -> None:
        """``cache_config``: the labels of ``vllm:cache_config_info`` (block size, ...).
        ``tier_medium``: the second tier's (host or disk), whose restored tokens are counted
        as that source of ``vllm:prompt_tokens_cached_by_source``."""
        self.tier_medium = tier_medium
        self.model_name = model_name
        self.num_blocks = num_blocks
        self.snapshot = snapshot
        self.cache_config = {k: str(v) for k, v in (cache_config or {}).items()}
        self.registry = CollectorRegistry(auto_describe=True)
        reg, label = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of started requests.", label, registry=reg
        ).labels(model_name)
        self._prompt_source_metrics(reg, model_name)
        self.residency = BlockResidency(reg, model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", label, registry=reg
        ).labels(model_name)
        self.request_success = Counter(
            "vllm:request_success",
            "Requests that ended, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.rejected = Counter(
            "nanokv:requests_rejected",
            "Requests refused up front (could never fit the model length or the cache).",
            label,
            registry=reg,
        ).labels(model_name)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            label,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two tokens of a request.",
            label,
            buckets=_ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            label,
            buckets=_E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)
        reg.register(self)
        self._last_token: dict[int, float] = {}

    def _prompt_source_metrics(self, reg: CollectorRegistry, model_name: str) -> None:
        """Where started requests' prompt tokens came from: vLLM's by-source counters."""

        def by_source(name: str, doc: str, sources: tuple[str, ...]) -> dict[str, Any]:
            counter = Counter(name, doc, ["model_name", "source"], registry=reg)
            return {s: counter.labels(model_name, s) for s in sources}

        self.by_source = by_source(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens of started requests by where their K/V came from.",
            PROMPT_SOURCES,
        )
        self.cached_tokens = Counter(
            "vllm:prompt_tokens_cached",
            "Prompt tokens of started requests served from a cache.",
            ["model_name"],
            registry=reg,
        ).labels(model_name)
        self.cached_by_source = by_source(
            "vllm:prompt_tokens_cached_by_source",
            "Prompt tokens served from a cache, by the tier that held them.",
            CACHED_SOURCES,
        )
        self.prefill_computed = Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens a request's prefill computed (its prompt less the cached tokens).",
            ["model_name"],
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        ).labels(model_name)

    def observe(self, outputs, now: float) -> None:
        """One step's outputs (engine thread)."""
        last = self._last_token
        generated = prompt = 0
        for out in outputs:
            generated += len(out.new_token_ids)
            prev = last.get(out.seq_id)
            if prev is None:
                prompt += out.num_prompt_tokens
                self._prompt_sources(
                    out.num_prompt_tokens, out.num_cached_tokens, out.num_restored_tokens
                )
                self.ttft.observe(out.first_token_time - out.arrival_time)
            else:
                self.itl.observe(now - prev)
            if out.finished:
                last.pop(out.seq_id, None)
                self.e2e.observe(now - out.arrival_time)
                self.request_success.labels(self.model_name, out.finish_reason).inc()
            else:
                last[out.seq_id] = now
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)

    def _prompt_sources(self, prompt: int, cached: int, restored: int = 0) -> None:
        """A started request's prompt tokens, by source: they add up to ``vllm:prompt_tokens``
        (``restored``: of the cached, those the second tier held)."""
        self.by_source["local_compute"].inc(prompt - cached)
        self.by_source["local_cache_hit"].inc(cached)
        self.cached_tokens.inc(cached)
        self.cached_by_source["device"].inc(cached - restored)
        if restored:
            self.cached_by_source[self.tier_medium or "external_unspecified"].inc(restored)
        self.prefill_computed.observe(prompt - cached)

    def ended(self, seq_id: int, reason: str) -> None:
        """A request aborted before it finished (``reason``: abort, or stop for stop strings)."""
        self._last_token.pop(seq_id, None)
        self.request_success.labels(self.model_name, reason).inc()

    def collect(self):
        """The engine's own numbers, from its last step snapshot (a collector for the registry)."""
        snap = self.snapshot()
        numbers = cache_numbers(snap)
        name = [self.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's configuration, in the labels (value 1).",
            labels=list(self.cache_config),
        )
        info.add_metric(list(self.cache_config.values()), 1.0)
        yield info
        used = snap.num_used_blocks if snap else 0
        cached = snap.num_cached_free_blocks if snap else 0
        free = snap.num_free_blocks - cached if snap else self.num_blocks
        yield gauge(
            "vllm:num_requests_running", "Requests running.", snap.num_running if snap else 0
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Requests waiting (including those mid-prefill).",
            snap.num_waiting if snap else 0,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks in use by sequences (1 = full); cached free blocks count "
            "as free.",
            used / self.num_blocks if self.num_blocks else 0.0,
        )
        blocks = GaugeMetricFamily(
            "nanokv:kv_cache_blocks",
            "KV blocks by state: used (ref count > 0), cached (free, hash kept), free (clean).",
            labels=["model_name", "state"],
        )
        for state, n in (("used", used), ("cached", cached), ("free", free)):
            blocks.add_metric([self.model_name, state], n)
        yield blocks
        if self.tier_medium is not None:
            yield gauge(
                "nanokv:kv_tier_blocks",
                "Blocks the second tier (--kv-tier) holds: evicted from the cache, restorable.",
                snap.tier_blocks if snap else 0,
            )
        for key, (metric, doc) in CACHE_COUNTERS.items():
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, numbers[key])
            yield c
        misses = CounterMetricFamily(
            "nanokv:prefix_cache_miss_tokens",
            "Prompt tokens that missed the prefix cache, by reason of the first missed block.",
            labels=["model_name", "reason"],
        )
        for reason in MISS_REASONS:
            misses.add_metric([self.model_name, reason], numbers["miss_tokens"].get(reason, 0))
        yield misses

    def text(self) -> bytes:
        return prometheus_text(self.registry)


class BlockResidency:
    """vLLM's KV block residency histograms, fed by the engine's events (engine thread).

    vLLM samples 1% of its blocks behind ``--kv-cache-metrics``; nanokv's books see every
    block's life anyway, so every block counts, always. A block's content lives from the
    allocation that gave it new tokens until the block is allocated again, for other tokens
    (its K/V are then overwritten): that is its lifetime, and the time since its last use (the
    allocation or a hit) is how long it sat idle before eviction. A hit on it (shared, revived,
    or read as a copy's source) is a reuse, ``reuse_gap`` after the use before.
    """

    def __init__(self, registry, model_name: str, clock: Callable[[], float] = time.monotonic):
        def histogram(name: str, doc: str):
            return Histogram(
                name, doc, ["model_name"], buckets=_RESIDENCY_BUCKETS, registry=registry
            ).labels(model_name)

        self.lifetime = histogram(
            "vllm:kv_block_lifetime_seconds",
            "A block's content, from its allocation until the block held other tokens.",
        )
        self.idle_before_evict = histogram(
            "vllm:kv_block_idle_before_evict_seconds",
            "Time from a block content's last use until the block held other tokens.",
        )
        self.reuse_gap = histogram(
            "vllm:kv_block_reuse_gap_seconds",
            "Time between two uses of a block's content (its allocation, then each hit).",
        )
        self.clock = clock
        self.born: dict[int, float] = {}  # block id -> when its content was allocated
        self.used: dict[int, float] = {}  # block id -> its content's last use

    def __call__(self, event) -> None:
        t = type(event)
        if t is BlockAllocated:
            now, block = self.clock(), event.block_id
            born = self.born.get(block)
            if born is not None:
                self.lifetime.observe(now - born)
                self.idle_before_evict.observe(now - self.used[block])
            self.born[block] = self.used[block] = now
        elif t is BlockHit:
            self._reused(event.block_id)
        elif t is BlockCopied:
            self._reused(event.source_block_id)
        elif t is AllBlocksCleared:
            self.born.clear()
            self.used.clear()

    def _reused(self, block: int) -> None:
        now = self.clock()
        last = self.used.get(block)
        if last is not None:
            self.reuse_gap.observe(now - last)
        self.used[block] = now
