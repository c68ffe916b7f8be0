"""The prefix cache's numbers under the names every view prints (the live view, ``--json``,
reports, traces, ``/metrics``, ``top``), and a lookup's miss as a record, a label and a sentence.

Beside ``CacheStats``, whose counters they name, so that traces, the server and the views read
one vocabulary without reaching up into a run's summary (``run/stats.py``).
"""

from __future__ import annotations

from typing import Any

from .cache_stats import MISS_REASONS
from .events import CacheLookup, StepSnapshot


def cache_numbers(snapshot: StepSnapshot | None) -> dict[str, Any]:
    """The prefix-cache counters of a step snapshot, under the names every view prints."""
    s = snapshot
    if s is None:
        return {
            "hit_rate": 0.0,
            "cache_queries": 0,
            "cache_hits": 0,
            "shared_hit_tokens": 0,
            "revived_hit_tokens": 0,
            "copied_hit_tokens": 0,
            "restored_hit_tokens": 0,
            "readmission_queries": 0,
            "readmission_hits": 0,
            "miss_tokens": dict.fromkeys(MISS_REASONS, 0),
            "evictions": 0,
            "preemptions": 0,
        }
    return {
        "hit_rate": ratio(s.hits, s.queries),
        "cache_queries": s.queries,
        "cache_hits": s.hits,
        "shared_hit_tokens": s.shared_hits,
        "revived_hit_tokens": s.revived_hits,
        "copied_hit_tokens": s.copied_hits,
        "restored_hit_tokens": s.restored_hits,
        "readmission_queries": s.readmission_queries,
        "readmission_hits": s.readmission_hits,
        "miss_tokens": {r: s.miss_tokens.get(r, 0) for r in MISS_REASONS},
        "evictions": s.evictions,
        "preemptions": s.preemptions,
    }


def tier_numbers(snapshot: StepSnapshot | None, tier: str) -> dict[str, Any]:
    """A run with a second tier (``tier``: its setting, ``disk:PATH:SIZE``): the hit rate each
    tier served (the device cache's hits, the tier's restored ones: they add up to
    ``hit_rate``), the prompt tokens its restores saved computing, and the blocks it holds."""
    medium = tier.partition(":")[0]
    queries = snapshot.queries if snapshot else 0
    restored = snapshot.restored_hits if snapshot else 0
    hits = snapshot.hits if snapshot else 0
    return {
        "hit_rate_by_tier": {
            "device": ratio(hits - restored, queries),
            medium: ratio(restored, queries),
        },
        "tier_prefill_tokens_saved": restored,
        "tier_blocks": snapshot.tier_blocks if snapshot else 0,
    }


def lookup_record(event: CacheLookup) -> dict[str, Any]:
    """One lookup's result and miss explanation, as ``--per-request`` and ``inspect`` give it."""
    rec: dict[str, Any] = {
        "cached_tokens": event.num_hit_tokens,
        "miss_reason": event.reason,
        "miss_block": event.miss_block,
    }
    if event.reason == "evicted":
        rec["evicted_at_step"] = event.evicted_at_step
    elif event.reason == "partial":
        rec["partial_tokens"] = event.partial_tokens
    return rec


def miss_label(rec: dict[str, Any], block_size: int) -> str:
    """A lookup record's miss reason in a few words, for table cells."""
    reason = rec["miss_reason"]
    if reason == "partial":
        return f"partial {rec.get('partial_tokens')}/{block_size} @{rec['miss_block']}"
    if reason == "evicted":
        step = rec.get("evicted_at_step", -1)
        return f"evicted @{rec['miss_block']}" + (f" (step {step})" if step != -1 else "")
    if reason in ("disabled", "preempted"):
        return reason
    if below_block(rec, block_size):
        return "below-block"
    return f"{reason} @{rec['miss_block']}"


def below_block(rec: dict[str, Any], block_size: int) -> bool:
    """Whether a lookup record's prompt is too short to fill one block, so that no block of
    it can ever hit under whole-block reuse (the engine counts it as ``last-block``; a record
    of ``inspect --prompts`` says ``below-block`` itself, as its headline does)."""
    reason = rec.get("miss_reason")
    if reason == "below-block":
        return True
    n = rec.get("num_tokens", rec.get("prompt_tokens"))
    return reason == "last-block" and n is not None and n <= block_size


def explain_miss(rec: dict[str, Any], block_size: int) -> str:
    """A sentence for a lookup record: why its first missed block missed."""
    reason, b = rec["miss_reason"], rec["miss_block"]
    where = f"block {b}"
    if below_block(rec, block_size):
        n = rec.get("num_tokens", rec.get("prompt_tokens"))
        return (
            f"below-block: the prompt's {n:,} tokens do not fill one {block_size}-token block, "
            "so no block of it can be cached (a smaller block size or token-granular reuse can)"
        )
    return {
        "disabled": "prefix caching is off",
        "preempted": "recomputed after a preemption",
        "last-block": f"{where} holds the prompt's last token, which is always computed",
        "last-token": "only the prompt's last token missed: it is always computed",
        "in-flight": f"{where} was being computed by another sequence in the same step",
        "evicted": (
            f"{where} was cached but evicted at step {rec.get('evicted_at_step')}"
            if rec.get("evicted_at_step", -1) != -1
            else f"{where}: an earlier prompt shared more of it, but its K/V had left the cache"
        ),
        "partial": (
            f"{where}: {rec.get('partial_tokens')} tokens shared with an earlier prompt "
            f"< block size {block_size}"
        ),
        "cold": f"{where}: no earlier prompt computed this prefix",
    }[reason]


def ratio(a: float, b: float) -> float:
    """``a / b``, 0 where ``b`` is 0 (no queries: no hits)."""
    return a / b if b > 0 else 0.0
