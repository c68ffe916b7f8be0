"""Which block size should be the default? Kernel and engine speed at each block size.

With token-granular prefix reuse (the default) the block size no longer decides the hit rate,
so the default is picked by speed. For each block size (16, 32, 64, 128, 256) on the default
model, in one process, rounds interleaved so that machine noise falls on every size alike:

- decode: one sequence, a 256-token prompt, 64 greedy tokens (tokens/s after the first);
- prefill: a 512-token prompt (tokens/s to its first token);
- throughput: 16 sequences of 128-token prompts, 64 tokens each (output tokens/s);
- accounting: the model-free dry run of the same throughput batch (engine seconds).

Each figure is the median of the rounds, with its ratio to block size 256.

    python scripts/bench/block_size.py                 # 3 rounds, 1 thread
    python scripts/bench/block_size.py --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py


from nanokv_cli import LLM, SamplingParams  # noqa: E402
from nanokv_cli.engine.config import EngineConfig  # noqa: E402
from nanokv_cli.engine.core.dry_run import DryRunExecutor, VirtualClock  # noqa: E402
from nanokv_cli.engine.core.llm_engine import LLMEngine  # noqa: E402

SIZES = (16, 32, 64, 128, 256)
CACHE_TOKENS = 1 << 15


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def decode(llm: LLM, seed: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    times = []
    for _ in llm.stream(prompts(1, 256, seed), params):
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def prefill(llm: LLM, seed: int) -> float:
    start = time.perf_counter()
    llm.generate(prompts(1, 512, seed), SamplingParams(temperature=0.0, max_tokens=1))
    return 512 / (time.perf_counter() - start)


def throughput(llm: LLM, seed: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts(16, 128, seed), params)
    return 16 * 64 / (time.perf_counter() - start)


def accounting(block_size: int, seed: int) -> float:
    config = EngineConfig(block_size=block_size, num_blocks=CACHE_TOKENS // block_size)
    clock = VirtualClock()
    engine = LLMEngine(DryRunExecutor(config, clock=clock), config, clock=clock)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts(16, 128, seed):
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    llms = {
        bs: LLM(block_size=bs, num_blocks=CACHE_TOKENS // bs, threads=args.threads) for bs in SIZES
    }
    for llm in llms.values():  # warm up: kernels built, step program recorded
        decode(llm, 0)
    results: dict[str, dict[int, list[float]]] = {
        k: {bs: [] for bs in SIZES} for k in ("decode", "prefill", "throughput", "accounting")
    }
    for r in range(args.rounds):
        order = SIZES if r % 2 == 0 else SIZES[::-1]
        for bs in order:
            results["decode"][bs].append(decode(llms[bs], r))
            results["prefill"][bs].append(prefill(llms[bs], r))
            results["throughput"][bs].append(throughput(llms[bs], r))
            results["accounting"][bs].append(accounting(bs, r))
    units = {"decode": "tok/s", "prefill": "tok/s", "throughput": "tok/s", "accounting": "ms"}
    print(f"default model, {args.threads} thread(s), median of {args.rounds} interleaved rounds")
    print(f"{'block size':>10} " + " ".join(f"{k + ' ' + units[k]:>22}" for k in results))
    for bs in SIZES:
        cells = []
        for kind, per_size in results.items():
            med, base = statistics.median(per_size[bs]), statistics.median(per_size[256])
            scale = 1000 if kind == "accounting" else 1
            cells.append(f"{med * scale:>12.1f} ({med / base:5.2f}x)")
        print(f"{bs:>10} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
