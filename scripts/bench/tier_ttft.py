"""The second KV tier: time to first token of a conversation's second turn after its prefix
was evicted, restored from a disk tier against recomputed.

Two engines with identical settings (the default model, a cache a little larger than one
conversation) run in this process, one with ``--kv-tier disk:...`` and one without. Each
repeat starts a new conversation: turn one (a ``--prefix-len``-token prefix and a question),
then two other prompts as long, which evict it from the cache, then turn two (the prefix, the
answer, one more question) generating one token. Its TTFT is the figure: the tiered engine
restores the prefix's blocks from the tier, the other computes them again. The median of the
repeats of each is compared (the ratio is the baseline's over the tier's).

Also printed: the prefill speed the tiered engine measured, the tier's restore speed, and the
crossover (a block is restored while its bytes over the tier's bandwidth take less time than
its tokens to compute: restoring pays below the crossover prefill speed).

    python scripts/bench/tier_ttft.py
    python scripts/bench/tier_ttft.py --quick --threads 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import emit, set_threads  # noqa: E402

from nanokv_cli import LLM, SamplingParams  # noqa: E402

ANSWER = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefix-len", type=int, default=None, help="default 2000 (quick: 1000)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=None, help="conversations (default 3, quick 1)")
    p.add_argument("--path", help="tier directory (default: a temporary one)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quick", action="store_true", help="a smaller workload (smoke test)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args()
    args.prefix_len = args.prefix_len or (1000 if args.quick else 2000)
    args.repeat = args.repeat or (1 if args.quick else 3)
    return args


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def second_turn_ttft(llm: LLM, seed: int, prefix_len: int) -> tuple[float, int]:
    """One conversation: turn one, two evicting prompts, then turn two's TTFT and cached
    tokens."""
    rng = random.Random(seed)
    turn1 = tokens(rng, prefix_len) + tokens(rng, 16)
    answer = llm.generate([turn1], ANSWER)[0]["token_ids"]
    for _ in range(2):
        llm.generate([tokens(rng, prefix_len + 16)], FIRST_TOKEN)
    turn2 = turn1 + answer + tokens(rng, 16)
    out = llm.generate([turn2], FIRST_TOKEN)[0]
    return out["ttft_s"], out["num_cached_tokens"]


def main() -> None:
    args = parse_args()
    threads = set_threads(args.threads)
    bs = args.block_size
    # Room for one conversation and a few blocks more: the other prompts evict it.
    num_blocks = -(-(args.prefix_len + 64) // bs) + 4
    settings = {"block_size": bs, "num_blocks": num_blocks, "threads": threads}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or tmp
        tiered = LLM(kv_tier=f"disk:{path}:4GiB", **settings)
        plain = LLM(**settings)
        runs: dict[str, list[tuple[float, int]]] = {"tier": [], "recompute": []}
        for r in range(args.repeat):  # alternating, so drifts in the machine hit both
            runs["tier"].append(second_turn_ttft(tiered, 1000 + r, args.prefix_len))
            runs["recompute"].append(second_turn_ttft(plain, 1000 + r, args.prefix_len))
        backend = tiered.model_runner.tier
        stats = tiered.engine.block_manager.stats
        tiered.shutdown()
    ttft = {k: statistics.median(t for t, _ in v) for k, v in runs.items()}
    per_token = backend.recompute_s_per_token()
    restore_block = backend.block_bytes / backend.bandwidth
    result = {
        "prefix_len": args.prefix_len,
        "block_size": bs,
        "num_blocks": num_blocks,
        "threads": threads,
        "ttft_tier_s": ttft["tier"],
        "ttft_recompute_s": ttft["recompute"],
        "speedup": ttft["recompute"] / ttft["tier"],
        "cached_tokens_tier": [c for _, c in runs["tier"]],
        "cached_tokens_recompute": [c for _, c in runs["recompute"]],
        "restored_hit_tokens": stats.restored_hits,
        "block_bytes": backend.block_bytes,
        "tier_bandwidth_gb_s": backend.bandwidth / 1e9,
        "restore_ms_per_block": restore_block * 1e3,
        "recompute_ms_per_block": per_token * bs * 1e3 if per_token else None,
        "prefill_tok_s": 1 / per_token if per_token else None,
        "crossover_prefill_tok_s": bs / restore_block,
    }
    lines = [
        f"second turn after a {args.prefix_len}-token prefix was evicted "
        f"(block size {bs}, {num_blocks} blocks, {threads} threads, {args.repeat} runs):",
        f"  restored from a disk tier: TTFT {ttft['tier'] * 1e3:,.0f} ms "
        f"(cached tokens {result['cached_tokens_tier']})",
        f"  recomputed:                TTFT {ttft['recompute'] * 1e3:,.0f} ms "
        f"(cached tokens {result['cached_tokens_recompute']})",
        f"  speedup {result['speedup']:.1f}x",
        f"crossover: a block of {backend.block_bytes / 1e6:.2f} MB restores in "
        f"{result['restore_ms_per_block']:.2f} ms at {result['tier_bandwidth_gb_s']:g} GB/s; "
        f"recomputing it takes {result['recompute_ms_per_block'] or 0:.1f} ms here "
        f"({result['prefill_tok_s'] or 0:,.0f} prefill tok/s): restoring pays below "
        f"{result['crossover_prefill_tok_s']:,.0f} prefill tok/s",
    ]
    emit(result, args.json, lines)


if __name__ == "__main__":
    main()
