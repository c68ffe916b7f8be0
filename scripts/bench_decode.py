"""Single-sequence latency: decode tokens/s and time to first token, nanokv vs transformers.

One prompt of ``--prompt-len`` random token ids, greedy, ``--max-tokens`` generated with EOS
ignored. nanokv runs through ``LLM.stream``; transformers through ``generate`` with a streamer
that timestamps each token. TTFT is the time to the first generated token; decode tokens/s
counts the tokens after it. Repeats alternate the two engines (so load on a shared machine hits
both alike) and the best run of each is compared; medians are printed too.

The ceiling is measured in the same run: the model's linear layers (every projection and the
LM head) alone at batch 1, i.e. one decode step with no attention, norms or Python.

    python scripts/bench_decode.py                      # default SmolLM2-135M on CPU
    python scripts/bench_decode.py --threads 1 --quick
    python scripts/bench_decode.py --device cuda --random-weights qwen3-0.6b
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    add_common_args,
    emit,
    linear_ceiling_tok_s,
    load_transformers,
    model_folder,
    resolve_dtype_name,
    set_threads,
    sync,
    workdir,
)

from nanokv_cli import LLM, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 (quick: 64)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 128 (quick: 32)")
    p.add_argument("--repeat", type=int, default=None, help="runs of each engine (default 3)")
    args = p.parse_args()
    quick = args.quick
    if args.prompt_len is None:
        args.prompt_len = 64 if quick else 256
    if args.max_tokens is None:
        args.max_tokens = 32 if quick else 128
    if args.repeat is None:
        args.repeat = 2 if quick else 3
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (decode speed counts the tokens after the first)")
    return args


class Timing:
    """Times of the first and last generated token, relative to the request's start."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.stamps: list[float] = []

    def token(self) -> None:
        self.stamps.append(time.perf_counter() - self.start)

    @property
    def ttft(self) -> float:
        return self.stamps[0]

    @property
    def decode_tok_s(self) -> float:
        return (len(self.stamps) - 1) / (self.stamps[-1] - self.stamps[0])


def nanokv_once(llm: LLM, prompt: list[int], max_tokens: int, device: str) -> tuple:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync(device)
    timing = Timing()
    tokens: list[int] = []
    for _, out in llm.stream([prompt], params):
        sync(device)
        timing.token()
        tokens = out.token_ids
    return timing, list(tokens)


def transformers_once(model, prompt: list[int], max_tokens: int, device: str) -> tuple:
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0

        def put(self, value) -> None:
            self.calls += 1
            if self.calls > 1:  # the first put is the prompt
                timing.token()

        def end(self) -> None:
            pass

    ids = torch.tensor([prompt], device=device)
    sync(device)
    timing = Timing()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            streamer=Stamps(),
        )
    return timing, out[0, len(prompt) :].tolist()


def stats(timings: list[Timing]) -> dict:
    return {
        "decode_tok_s": max(t.decode_tok_s for t in timings),
        "decode_tok_s_median": statistics.median(t.decode_tok_s for t in timings),
        "ttft_s": min(t.ttft for t in timings),
        "ttft_s_median": statistics.median(t.ttft for t in timings),
        "runs": len(timings),
    }


def main() -> None:
    args = parse_args()
    threads = set_threads(args.threads)
    random.seed(0)
    prompt = [random.randint(0, 9999) for _ in range(args.prompt_len)]
    with workdir() as tmp:
        dtype = resolve_dtype_name(args.dtype, args.device)
        folder = model_folder(args, dtype, tmp)
        llm = LLM(folder, dtype=args.dtype, device=args.device)
        hf = load_transformers(folder, dtype, args.device)
    nanokv_once(llm, prompt[:16], 4, args.device)  # warm-up
    transformers_once(hf, prompt[:16], 4, args.device)
    ours, theirs = [], []
    for _ in range(args.repeat):
        timing, nano_tokens = nanokv_once(llm, prompt, args.max_tokens, args.device)
        ours.append(timing)
        timing, hf_tokens = transformers_once(hf, prompt, args.max_tokens, args.device)
        theirs.append(timing)
    ceiling = linear_ceiling_tok_s(llm.model_runner.model, 1, args.device)
    nano, base = stats(ours), stats(theirs)
    result = {
        "benchmark": "decode",
        "device": args.device,
        "threads": threads,
        "dtype": str(llm.model_runner.dtype).removeprefix("torch."),
        "model": args.random_weights or args.model or "default (SmolLM2-135M)",
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "nanokv": nano,
        "transformers": base,
        "linear_ceiling_tok_s": ceiling,
        "decode_ratio": nano["decode_tok_s"] / base["decode_tok_s"],
        "ttft_ratio": base["ttft_s"] / nano["ttft_s"],
        "same_tokens": nano_tokens == hf_tokens,
    }
    lines = [
        f"one sequence: prompt {args.prompt_len} tokens, {args.max_tokens} generated, greedy; "
        f"{result['dtype']}, {args.device}, {threads} threads; best of {args.repeat}",
        f"nanokv:       decode {nano['decode_tok_s']:7.1f} tok/s "
        f"({nano['decode_tok_s'] / ceiling:4.0%} of ceiling), TTFT {nano['ttft_s'] * 1e3:7.1f} ms",
        f"transformers: decode {base['decode_tok_s']:7.1f} tok/s "
        f"({base['decode_tok_s'] / ceiling:4.0%} of ceiling), TTFT {base['ttft_s'] * 1e3:7.1f} ms",
        f"linear layers alone at batch 1 (ceiling): {ceiling:7.1f} tok/s",
        f"decode ratio: {result['decode_ratio']:.2f}x   TTFT ratio: {result['ttft_ratio']:.2f}x"
        f"   same tokens: {result['same_tokens']}",
    ]
    emit(result, args.json, lines)


if __name__ == "__main__":
    main()
