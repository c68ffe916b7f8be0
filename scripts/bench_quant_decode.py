"""Single-sequence decode speed of the quantized modes, against transformers and llama.cpp.

One prompt of ``--prompt-len`` tokens of English text, greedy, ``--max-tokens`` generated with EOS
ignored, end to end through each engine's Python API:

- nanokv ``LLM(quantization=...)`` for each of ``--modes`` (none, int8, int4) on the default
  model (or ``--model``, a GGUF or Hugging Face folder);
- transformers on the same float32 weights (the loader's converted copy of a GGUF), the baseline;
- llama.cpp on the same GGUF file, when ``llama_cpp`` (llama-cpp-python) is importable. It is
  an optional benchmark dependency (a ~10 minute source build), never needed by CI.

Decode tokens/s counts the tokens after the first, over the time from the first to the last.
Repeats alternate the engines so load on a shared machine hits them alike; the best run of
each is compared (medians printed too). Also printed: resident weight bytes per engine, and
how many greedy tokens each quantized mode shares with ``none`` before diverging. nanokv's
weight bytes include the MKL-packed copies its float32 CPU path may keep for 1-row GEMMs.

``--batch 16,64`` adds batched decode throughput per mode (N sequences decoding together), to
check that the quantized layers' large-batch path (dequantize + float32 GEMM) keeps up.

    python scripts/bench_quant_decode.py
    python scripts/bench_quant_decode.py --threads 1 --batch 16,64 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from nanokv_cli import LLM, SamplingParams  # noqa: E402
from nanokv_cli.engine.loader import load_model  # noqa: E402
from nanokv_cli.engine.quantize import resident_weight_bytes  # noqa: E402

PROMPT_TEXT = (
    "The history of computing is a story of memory. Early machines stored a few thousand words "
    "in delay lines and magnetic drums, and programmers spent much of their effort deciding "
    "what to keep close to the processor and what to leave on slower storage. Virtual memory "
    "changed that: the operating system splits memory into fixed-size pages, keeps a table "
    "that maps each program's pages to physical frames, and moves pages in and out as they are "
    "needed. Serving large language models faces the same problem with the keys and values "
    "that attention reads at every step, and the same idea, paging, solves it."
)
Run = Callable[[list[int], int], list[float]]  # (prompt, max tokens) -> token timestamps


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M)")
    p.add_argument("--modes", default="none,int8,int4", help="nanokv quantization modes")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="runs of each engine")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every engine")
    p.add_argument("--batch", default="", help="also batched decode at these sizes, e.g. 16,64")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (decode speed counts the tokens after the first)")
    return args


# -- engines --------------------------------------------------------------------------------------


def nanokv_runner(llm: LLM) -> Run:
    def run(prompt: list[int], max_tokens: int) -> list[float]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        stamps = []
        start = time.perf_counter()
        for _ in llm.stream([prompt], params):
            stamps.append(time.perf_counter() - start)
        return stamps

    return run


def nanokv_tokens(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params)[0]["token_ids"]


def load_transformers(folder: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def transformers_runner(model: Any) -> Run:
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self, start: float) -> None:
            self.start, self.stamps, self.calls = start, [], 0

        def put(self, value: Any) -> None:
            self.calls += 1
            if self.calls > 1:  # the first put is the prompt
                self.stamps.append(time.perf_counter() - self.start)

        def end(self) -> None:
            pass

    def run(prompt: list[int], max_tokens: int) -> list[float]:
        ids = torch.tensor([prompt])
        streamer = Stamps(time.perf_counter())
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                streamer=streamer,
            )
        return streamer.stamps

    return run


def llama_cpp_runner(gguf: str, threads: int, context: int) -> Run | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    model = Llama(
        model_path=gguf,
        n_ctx=context,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        seed=0,
    )

    def run(prompt: list[int], max_tokens: int) -> list[float]:
        model.reset()
        stamps = []
        start = time.perf_counter()
        # top_k=1 is greedy; generate() does not stop at EOS by itself.
        for _ in model.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0):
            stamps.append(time.perf_counter() - start)
            if len(stamps) == max_tokens:
                break
        return stamps

    return run


# -- measuring ------------------------------------------------------------------------------------


def text_prompt(tokenizer: Any, length: int) -> list[int]:
    """``length`` tokens of plain English (random ids would make greedy agreement meaningless)."""
    ids = tokenizer.encode(PROMPT_TEXT)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def decode_tok_s(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def summarize(runs: list[list[float]]) -> dict[str, float]:
    speeds = [decode_tok_s(s) for s in runs]
    return {
        "decode_tok_s": max(speeds),
        "decode_tok_s_median": statistics.median(speeds),
        "ttft_s": min(s[0] for s in runs),
    }


def batched_decode_tok_s(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Generated tokens/s between the step that gave every sequence its first token and the end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first: set[int] = set()
    start = end = time.perf_counter()
    for i, _ in llm.stream(prompts, params):
        now = time.perf_counter()
        if i not in first:
            first.add(i)
            start = now
        end = now
    return len(prompts) * (max_tokens - 1) / (end - start)


def agreeing_prefix(a: Iterable[int], b: Iterable[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def nanokv_weight_bytes(llm: LLM) -> int:
    """Weights as the model holds them, plus any extra packed copies the runner made."""
    runner = llm.model_runner
    return resident_weight_bytes(runner.model) + getattr(runner, "packed_weight_bytes", 0)


def torch_weight_bytes(model: Any) -> int:
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    return sum(storages.values())


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    loaded = load_model(args.model)
    prompt = text_prompt(loaded.tokenizer, args.prompt_len)
    context = args.prompt_len + args.max_tokens + 16
    gguf = loaded.source if os.path.isfile(loaded.source) else None
    float_folder = loaded.cache_path or loaded.source
    del loaded

    llms = {m: LLM(args.model, quantization=m) for m in modes}
    engines: dict[str, Run] = {f"nanokv {m}": nanokv_runner(llm) for m, llm in llms.items()}
    weights = {f"nanokv {m}": nanokv_weight_bytes(llm) for m, llm in llms.items()}
    if not args.no_transformers:
        hf = load_transformers(float_folder)
        engines["transformers"] = transformers_runner(hf)
        weights["transformers"] = torch_weight_bytes(hf)
    llama = llama_cpp_runner(gguf, threads, context) if gguf else None
    if llama is not None:
        engines["llama.cpp"] = llama
        weights["llama.cpp"] = os.path.getsize(gguf)  # mapped file: its blocks as stored

    for run in engines.values():  # warm-up
        run(prompt[:16], 4)
    runs: dict[str, list[list[float]]] = {name: [] for name in engines}
    for _ in range(args.repeat):
        for name, run in engines.items():
            runs[name].append(run(prompt, args.max_tokens))
    results = {name: summarize(r) for name, r in runs.items()}

    tokens = {m: nanokv_tokens(llm, prompt, args.max_tokens) for m, llm in llms.items()}
    agreement = {m: agreeing_prefix(tokens[m], tokens[modes[0]]) for m in modes[1:]}
    batched: dict[str, dict[int, float]] = {}
    random.seed(0)
    for size in [int(b) for b in args.batch.split(",") if b.strip()]:
        prompts = [[random.randint(0, 9999) for _ in range(args.prompt_len)] for _ in range(size)]
        for m, llm in llms.items():
            batched.setdefault(m, {})[size] = batched_decode_tok_s(llm, prompts, 32)

    report = {
        "benchmark": "quantized single-sequence decode",
        "threads": threads,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        "engines": results,
        "weight_bytes": weights,
        "greedy_tokens_shared_with_" + modes[0]: agreement,
        "ratios": ratios(results),
        "batched_decode_tok_s": batched,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, results, weights)


def ratios(results: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each nanokv mode's best decode tok/s over each baseline's."""
    baselines = [b for b in ("nanokv none", "transformers", "llama.cpp") if b in results]
    out = {}
    for name, r in results.items():
        if name.startswith("nanokv"):
            speed = r["decode_tok_s"]
            out[name] = {
                f"vs {b}": speed / results[b]["decode_tok_s"] for b in baselines if b != name
            }
    return out


def print_report(
    report: dict[str, Any], results: dict[str, dict[str, float]], weights: dict[str, int]
) -> None:
    print(
        f"one sequence: prompt {report['prompt_len']} tokens, {report['max_tokens']} generated, "
        f"greedy; {report['threads']} threads; best of {report['repeat']}"
    )
    for name, r in results.items():
        print(
            f"{name:14s} decode {r['decode_tok_s']:7.1f} tok/s (median "
            f"{r['decode_tok_s_median']:6.1f}), TTFT {r['ttft_s'] * 1e3:7.1f} ms, "
            f"weights {weights[name] / 1e6:7.1f} MB"
        )
    for name, vs in report["ratios"].items():
        print(f"{name:14s} " + "  ".join(f"{k}: {v:.2f}x" for k, v in vs.items()))
    for key, value in report.items():
        if key.startswith("greedy_tokens_shared") and value:
            shared = ", ".join(f"{m}: {n}/{report['max_tokens']}" for m, n in value.items())
            print(f"greedy tokens before diverging from {key.rsplit('_', 1)[-1]}: {shared}")
    for mode, sizes in report["batched_decode_tok_s"].items():
        cells = ", ".join(f"batch {b}: {v:.1f} tok/s" for b, v in sizes.items())
        print(f"nanokv {mode:7s} batched decode: {cells}")


if __name__ == "__main__":
    main()
