"""Prefix-cache statistics and the reasons a lookup misses."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a prompt lookup missed, in the order the reasons are tested (the first that applies).
# ``last-block`` and ``partial`` arise under whole-block reuse only, ``last-token`` under
# token-granular reuse only (miss_reasons.py).
MISS_REASONS = (
    "disabled",
    "preempted",
    "last-block",
    "last-token",
    "in-flight",
    "evicted",
    "partial",
    "cold",
)


@dataclass
class CacheStats:
    """Prefix-cache statistics, counted in tokens like vLLM (blocks x block_size).

    ``queries``/``hits`` count each request's *first* admission only: that is the hit rate
    everywhere nanokv prints one (vLLM's ``prefix_cache_hits / prefix_cache_queries``). A
    sequence preempted and admitted again looks its tokens up again; those lookups go to the
    ``readmission_*`` counters, so recomputation never inflates the headline.
    ``restored_hits`` come from the second tier (``kv_tier``): blocks the device cache had
    evicted, read back instead of recomputed (the tier's medium, disk or host, is the run's).
    ``miss_tokens`` splits every missed token, first admissions and re-admissions alike, by
    reason (``MISS_REASONS``): ``sum(miss_tokens.values()) == misses + readmission_misses``.
    """

    queries: int = 0  # prompt tokens looked up at first admission
    shared_hits: int = 0  # ...served by blocks other sequences were using
    revived_hits: int = 0  # ...served by free blocks that still held their hash
    copied_hits: int = 0  # ...whose K/V were copied from a block sharing their first tokens
    restored_hits: int = 0  # ...whose blocks were restored from the second tier (kv_tier)
    readmission_queries: int = 0  # tokens looked up again after a preemption
    readmission_shared_hits: int = 0
    readmission_revived_hits: int = 0
    readmission_copied_hits: int = 0
    readmission_restored_hits: int = 0
    evictions: int = 0  # cached blocks reused for new data (their hash left the cache)
    preemptions: int = 0
    miss_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))

    @property
    def hits(self) -> int:
        return self.shared_hits + self.revived_hits + self.copied_hits + self.restored_hits

    @property
    def readmission_hits(self) -> int:
        return (
            self.readmission_shared_hits
            + self.readmission_revived_hits
            + self.readmission_copied_hits
            + self.readmission_restored_hits
        )

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
