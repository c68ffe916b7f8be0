"""Prefix caching: time to first token of 16 prompts sharing a 1024-token prefix, cache on vs off.

Each prompt is the same ``--prefix-len`` random token ids followed by its own ``--suffix-len``
ids (16 prompts by default); every request generates one token, so the time until all of them
have it is the prefill cost. Two engines with identical settings run in the same process, one
with prefix caching and one without, in two scenarios:

* warm: the prefix is already cached (an earlier request carried it, as a shared system prompt
  does); all 16 are submitted together. This is the headline ratio.
* cold: nothing cached; the first prompt runs alone (computing the prefix once), then the other
  15 together. Submitted all at once, they could not share it: a block is only shared once its
  K/V has been computed.

transformers prefills the 16 prompts as one batch (``generate`` with one new token) for
reference. Repeats alternate the engines; the best run of each is compared.

    python scripts/bench/prefix.py
    python scripts/bench/prefix.py --quick --threads 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import (  # noqa: E402
    add_common_args,
    emit,
    hf_generate,
    load_transformers,
    model_folder,
    resolve_dtype_name,
    set_threads,
    timed,
    workdir,
)

from nanokv_cli import LLM, SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    p.add_argument("--prefix-len", type=int, default=None, help="default 1024 (quick: 512)")
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1, help="runs of each engine (best is kept)")
    p.add_argument("--block-size", type=int, default=None, help="nanokv block size (LLM default)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers reference")
    args = p.parse_args()
    if args.prefix_len is None:
        args.prefix_len = 512 if args.quick else 1024
    return args


def workload(args: argparse.Namespace) -> tuple[list[int], list[list[int]]]:
    random.seed(0)
    prefix = [random.randint(0, 9999) for _ in range(args.prefix_len)]
    prompts = [
        prefix + [random.randint(0, 9999) for _ in range(args.suffix_len)]
        for _ in range(args.num_prompts)
    ]
    warmer = prefix + [random.randint(0, 9999) for _ in range(args.suffix_len)]
    return warmer, prompts


def make_llm(args: argparse.Namespace, folder: str, caching: bool) -> LLM:
    kwargs = {"block_size": args.block_size} if args.block_size else {}
    llm = LLM(folder, dtype=args.dtype, device=args.device, enable_prefix_caching=caching, **kwargs)
    llm.generate([[1, 2, 3, 4]], FIRST_TOKEN)  # warm-up
    return llm


def cold_seconds(llm: LLM, prompts: list[list[int]], device: str) -> float:
    first, _ = timed(lambda: llm.generate(prompts[:1], FIRST_TOKEN), device)
    rest, _ = timed(lambda: llm.generate(prompts[1:], FIRST_TOKEN), device)
    return first + rest


def warm_seconds(llm: LLM, warmer: list[int], prompts: list[list[int]], device: str) -> tuple:
    llm.generate([warmer], FIRST_TOKEN)  # the earlier request that carried the prefix
    seconds, outs = timed(lambda: llm.generate(prompts, FIRST_TOKEN), device)
    return seconds, sum(o["num_cached_tokens"] for o in outs)


def main() -> None:
    args = parse_args()
    threads = set_threads(args.threads)
    warmer, prompts = workload(args)
    runs: dict[str, list[float]] = {k: [] for k in ("warm_on", "warm_off", "cold_on", "cold_off")}
    with workdir() as tmp:
        dtype = resolve_dtype_name(args.dtype, args.device)
        folder = model_folder(args, dtype, tmp)
        for _ in range(args.repeat):
            # Fresh engines per repeat: the cold runs must start from an empty cache.
            for caching, name in ((True, "on"), (False, "off")):
                llm = make_llm(args, folder, caching)
                runs[f"cold_{name}"].append(cold_seconds(llm, prompts, args.device))
                seconds, hit_tokens = warm_seconds(llm, warmer, prompts, args.device)
                runs[f"warm_{name}"].append(seconds)
                if caching:
                    cached = hit_tokens
                del llm
        hf_seconds = None
        if not args.skip_hf:
            model = load_transformers(folder, dtype, args.device)
            hf_generate(model, [prompts[0][:8]], 1, temperature=0.0, device=args.device)
            hf_seconds, _ = timed(
                lambda: hf_generate(model, prompts, 1, temperature=0.0, device=args.device),
                args.device,
            )
    best = {k: min(v) for k, v in runs.items()}
    result = {
        "benchmark": "prefix",
        "device": args.device,
        "threads": threads,
        "model": args.random_weights or args.model or "default (SmolLM2-135M)",
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "num_prompts": args.num_prompts,
        "seconds": best,
        "median_seconds": {k: statistics.median(v) for k, v in runs.items()},
        "cached_prompt_tokens_warm": cached,
        "transformers_seconds": hf_seconds,
        "warm_ratio": best["warm_off"] / best["warm_on"],
        "cold_ratio": best["cold_off"] / best["cold_on"],
    }
    lines = [
        f"{args.num_prompts} prompts = {args.prefix_len}-token shared prefix + "
        f"{args.suffix_len}-token suffixes, first token of all; {args.device}, {threads} threads, "
        f"best of {args.repeat}",
        f"warm (prefix cached earlier): caching on {best['warm_on']:7.2f} s, off "
        f"{best['warm_off']:7.2f} s -> {result['warm_ratio']:.1f}x "
        f"({cached} of {sum(map(len, prompts))} prompt tokens from the cache)",
        f"cold (first prompt alone, then 15): caching on {best['cold_on']:7.2f} s, off "
        f"{best['cold_off']:7.2f} s -> {result['cold_ratio']:.1f}x",
    ]
    if hf_seconds is not None:
        lines.append(f"transformers, one batch of {args.num_prompts}: {hf_seconds:7.2f} s")
    emit(result, args.json, lines)


if __name__ == "__main__":
    main()
