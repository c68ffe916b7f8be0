"""Single-sequence decode: nanokv's float and quantized modes vs transformers, llama.cpp, ceiling.

One prompt of ``--prompt-len`` tokens of English text, greedy, ``--max-tokens`` generated with EOS
ignored, end to end through each engine's Python API:

- nanokv ``LLM(quantization=...)`` for each of ``--modes``: ``auto`` (the default: a GGUF's
  own blocks, held once, for every step), ``none`` (the float model), int8 and int4 (every
  layer quantized; on the default Q4_1 GGUF both take the file's blocks and compute what
  ``auto`` computes). Off the CPU only ``none`` runs;
- transformers on the same float weights (the GGUF exported as a float32 folder), the baseline;
- llama.cpp on the same GGUF file, when ``llama_cpp`` (llama-cpp-python) is importable. It is
  an optional benchmark dependency (a ~10 minute source build on 2 cores), never needed by CI;
- the ceiling: the model's linear layers (every projection and the LM head) alone at batch 1
  through ``F.linear`` on the float weights, i.e. one decode step with no attention, norms or
  Python.

TTFT is the time to the first generated token; decode tokens/s counts the tokens after it, over
the time from the first to the last. Repeats alternate the engines so load on a shared machine
hits them alike; the best run of each is compared (medians printed too). nanokv runs without
prefix caching, so every repeat pays for its prefill as the other engines do. Also printed:
resident weight bytes per engine (llama.cpp's are the mapped GGUF file), and how many greedy
tokens each
engine shares with ``none`` before diverging.

``--batch 16,64`` adds batched decode throughput per mode (N sequences decoding together), to
check that the packed formats' 6-row tiles keep up.

    python scripts/bench/decode.py                      # default SmolLM2-135M on CPU
    python scripts/bench/decode.py --threads 1 --quick
    python scripts/bench/decode.py --threads 1 --modes none,int4 --batch 16,64 --json
    python scripts/bench/decode.py --device cuda --random-weights qwen3-0.6b
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import (  # noqa: E402
    PROBE_BYTES,
    add_common_args,
    bound_tok_s,
    decode_bytes,
    emit,
    kernel_peak_flops,
    linear_ceiling_tok_s,
    load_transformers,
    model_folder,
    parse_modes,
    read_bandwidth,
    resolve_dtype_name,
    set_threads,
    step_flops,
    sync,
    workdir,
)

from nanokv_cli import LLM, SamplingParams  # noqa: E402
from nanokv_cli.engine.cpu import kernels as cpu_kernels  # noqa: E402
from nanokv_cli.engine.model.quantize import resident_weight_bytes

PROMPT_TEXT = (
    "The history of computing is a story of memory. Early machines stored a few thousand words "
    "in delay lines and magnetic drums, and programmers spent much of their effort deciding "
    "what to keep close to the processor and what to leave on slower storage. Virtual memory "
    "changed that: the operating system splits memory into fixed-size pages, keeps a table "
    "that maps each program's pages to physical frames, and moves pages in and out as they are "
    "needed. Serving large language models faces the same problem with the keys and values "
    "that attention reads at every step, and the same idea, paging, solves it."
)
REFERENCE = "nanokv none"  # what greedy agreement is measured against: the float model

Stamps = list[float]  # time of each generated token, from the start of the request
Run = Callable[[list[int], int], tuple[Stamps, list[int]]]  # (prompt, max tokens) -> stamps, ids


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    p.add_argument(
        "--modes",
        default=None,
        help="nanokv quantization modes, comma-separated (default auto,none,int4; "
        "none alone off the CPU)",
    )
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 (quick: 64)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 128 (quick: 32)")
    p.add_argument(
        "--repeat", type=int, default=None, help="runs of each engine (default 3, quick: 2)"
    )
    p.add_argument(
        "--batch",
        default="",
        help="also batched decode per mode at these sizes, e.g. 16,64 (32 tokens each)",
    )
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers run")
    p.add_argument(
        "--no-llama-cpp", action="store_true", help="skip llama.cpp even when it is installed"
    )
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
    on_cpu = torch.device(args.device).type == "cpu"
    args.modes = parse_modes(p, args.modes or ("auto,none,int4" if on_cpu else "none"), args.device)
    try:
        args.batch = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batch takes comma-separated sizes, got {args.batch!r}")
    return args


# -- engines --------------------------------------------------------------------------------------


def nanokv_runner(llm: LLM, device: str) -> Run:
    def run(prompt: list[int], max_tokens: int) -> tuple[Stamps, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        stamps: Stamps = []
        tokens: list[int] = []
        sync(device)
        start = time.perf_counter()
        for _, out in llm.stream([prompt], params):
            sync(device)
            stamps.append(time.perf_counter() - start)
            tokens = out.token_ids
        return stamps, list(tokens)

    return run


def transformers_runner(model: Any, device: str) -> Run:
    from transformers.generation.streamers import BaseStreamer

    class Stamper(BaseStreamer):
        def __init__(self, start: float) -> None:
            self.start, self.stamps, self.calls = start, [], 0

        def put(self, value: Any) -> None:
            self.calls += 1
            if self.calls > 1:  # the first put is the prompt
                self.stamps.append(time.perf_counter() - self.start)

        def end(self) -> None:
            pass

    def run(prompt: list[int], max_tokens: int) -> tuple[Stamps, list[int]]:
        ids = torch.tensor([prompt], device=device)
        sync(device)
        streamer = Stamper(time.perf_counter())
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=0,
                do_sample=False,
                # EOS ignored, as nanokv's ignore_eos; min_new_tokens would instead mask EOS
                # out of the logits and so change the greedy tokens.
                eos_token_id=None,
                pad_token_id=0,
                streamer=streamer,
            )
        return streamer.stamps, out[0, len(prompt) :].tolist()

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

    def run(prompt: list[int], max_tokens: int) -> tuple[Stamps, list[int]]:
        model.reset()  # else generate() reuses the KV cache of a matching prefix: no prefill
        stamps: Stamps = []
        tokens: list[int] = []
        start = time.perf_counter()
        # top_k=1 is greedy; generate() does not stop at EOS by itself.
        for token in model.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0):
            stamps.append(time.perf_counter() - start)
            tokens.append(token)
            if len(stamps) == max_tokens:
                break
        return stamps, tokens

    return run


# -- measuring ------------------------------------------------------------------------------------


def text_prompt(llm: LLM, length: int) -> list[int]:
    """``length`` tokens of plain English (random ids would make greedy agreement meaningless)."""
    ids = llm.encode(PROMPT_TEXT)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def decode_tok_s(stamps: Stamps) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def summarize(runs: list[Stamps]) -> dict[str, float]:
    speeds = [decode_tok_s(s) for s in runs]
    return {
        "decode_tok_s": max(speeds),
        "decode_tok_s_median": statistics.median(speeds),
        "ttft_s": min(s[0] for s in runs),
        "ttft_s_median": statistics.median(s[0] for s in runs),
        "runs": len(runs),
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


def torch_weight_bytes(model: torch.nn.Module) -> int:
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    return sum(storages.values())


def ratios(
    results: dict[str, dict[str, float]], ceiling: float | None
) -> dict[str, dict[str, float]]:
    """Each nanokv mode's best decode tok/s over each baseline's, and TTFT against transformers."""
    baselines = {
        name: r["decode_tok_s"]
        for name, r in results.items()
        if name in (REFERENCE, "transformers", "llama.cpp")
    }
    if ceiling is not None:
        baselines["ceiling"] = ceiling
    out = {}
    for name, r in results.items():
        if not name.startswith("nanokv"):
            continue
        out[name] = {
            f"decode vs {b}": r["decode_tok_s"] / speed
            for b, speed in baselines.items()
            if b != name
        }
        if "transformers" in results:  # > 1: nanokv's first token comes sooner
            out[name]["ttft vs transformers"] = results["transformers"]["ttft_s"] / r["ttft_s"]
    return out


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    threads = set_threads(args.threads)
    with workdir() as tmp:
        dtype = resolve_dtype_name(args.dtype, args.device)
        # transformers needs a Hugging Face folder; nanokv loads what the user named, so its
        # quantized modes take a GGUF's Q4 blocks as they are rather than requantizing floats.
        folder = model_folder(args, dtype, tmp)
        source = folder if args.random_weights else args.model
        llms = {
            f"nanokv {m}": LLM(
                source,
                dtype=args.dtype,
                device=args.device,
                quantization=m,
                enable_prefix_caching=False,
            )
            for m in args.modes
        }
        hf = None if args.no_transformers else load_transformers(folder, dtype, args.device)
    first = next(iter(llms.values()))
    gguf = first.model_path if os.path.isfile(first.model_path) else None
    if args.random_weights:  # its stub tokenizer maps every word to one id
        random.seed(0)
        prompt = [random.randint(0, 9999) for _ in range(args.prompt_len)]
    else:
        prompt = text_prompt(first, args.prompt_len)

    engines: dict[str, Run] = {name: nanokv_runner(llm, args.device) for name, llm in llms.items()}
    weights = {name: nanokv_weight_bytes(llm) for name, llm in llms.items()}
    if hf is not None:
        engines["transformers"] = transformers_runner(hf, args.device)
        weights["transformers"] = torch_weight_bytes(hf)
    # llama-cpp-python's wheel is built for the CPU here; on a GPU the comparison would not hold.
    if gguf and not args.no_llama_cpp and torch.device(args.device).type == "cpu":
        llama = llama_cpp_runner(gguf, threads, context=args.prompt_len + args.max_tokens + 16)
        if llama is not None:
            engines["llama.cpp"] = llama
            weights["llama.cpp"] = os.path.getsize(gguf)  # mapped file: its blocks as stored

    for run in engines.values():  # warm-up
        run(prompt[:16], 4)
    runs: dict[str, list[Stamps]] = {name: [] for name in engines}
    tokens: dict[str, list[int]] = {}
    # The bandwidth is read between the repeats and its best kept, as the runs' best is: on a
    # shared machine one reading taken after the runs met other load than the best run did.
    reads: list[float] = []
    measure_reads = args.device == "cpu" and cpu_kernels.available()
    for _ in range(args.repeat):
        if measure_reads:
            reads.append(read_bandwidth(threads, repeats=3))
        for name, run in engines.items():
            stamps, tokens[name] = run(prompt, args.max_tokens)
            runs[name].append(stamps)
    results = {name: summarize(r) for name, r in runs.items()}

    # The ceiling is a float model's: nanokv's own float layers, else transformers' copy.
    float_model = llms[REFERENCE].model_runner.model if REFERENCE in llms else hf
    ceiling = linear_ceiling_tok_s(float_model, 1, args.device) if float_model is not None else None
    reference = REFERENCE if REFERENCE in tokens else None
    agreement = {
        name: agreeing_prefix(ids, tokens[reference])
        for name, ids in tokens.items()
        if reference and name != reference
    }
    batched: dict[str, dict[int, float]] = {}
    random.seed(1)
    for size in args.batch:
        prompts = [[random.randint(0, 9999) for _ in range(args.prompt_len)] for _ in range(size)]
        for name, llm in llms.items():
            batched.setdefault(name, {})[size] = batched_decode_tok_s(llm, prompts, 32)

    limits = roofline_of(llms, results, args, reads) if measure_reads else None
    result = {
        "roofline": limits,
        "benchmark": "decode",
        "device": args.device,
        "threads": threads,
        "dtype": str(first.model_runner.dtype).removeprefix("torch."),
        "model": args.random_weights or args.model or "default (SmolLM2-135M)",
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        "engines": results,
        "weight_bytes": weights,
        "linear_ceiling_tok_s": ceiling,
        "ratios": ratios(results, ceiling),
        "greedy_tokens_shared_with_none": agreement,
        "batched_decode_tok_s": batched,
    }
    emit(result, args.json, report_lines(result))


# Each quantization mode's weight format, for its compute peak.
PEAK_FORMAT = {"auto": "q4", "int4": "q4", "int8": "q8", "none": "f32"}


def roofline_of(
    llms: dict[str, LLM],
    results: dict[str, dict[str, float]],
    args: argparse.Namespace,
    reads: list[float],
) -> dict[str, Any]:
    """Each nanokv mode's decode speed as a fraction of what this machine's read bandwidth
    allows its bytes per token (the best of ``reads``, taken between the repeats at the run's
    threads), and its prefill as a fraction of its format's kernel peak. Also the rate at
    which this CPU re-reads a buffer of one step's size: where a step's bytes fit the
    last-level cache in part, that is the tighter limit, and decode can pass the first."""
    threads = torch.get_num_threads()
    bandwidth = max(reads + [read_bandwidth(threads)])
    out: dict[str, Any] = {"threads": threads, "read_bytes_per_s": bandwidth, "modes": {}}
    context = args.prompt_len + args.max_tokens // 2  # the decode's mean position
    for name, llm in llms.items():
        mode = name.removeprefix("nanokv ")
        peak = kernel_peak_flops(PEAK_FORMAT.get(mode, "f32"), threads)
        step_bytes = decode_bytes(llm, context)
        flops = step_flops(llm, 1, context)
        bound, binds = bound_tok_s(step_bytes, flops, bandwidth, peak, 1)
        resident = read_bandwidth(threads, nbytes=step_bytes)
        resident_bound = bound_tok_s(step_bytes, flops, resident, peak, 1)[0]
        prefill = step_flops(llm, args.prompt_len, args.prompt_len // 2, logits_rows=1)
        out["modes"][name] = {
            "bytes_per_token": step_bytes,
            "bound_tok_s": bound,
            "binds": binds,
            "decode_fraction": results[name]["decode_tok_s"] / bound,
            "step_size_read_bytes_per_s": resident,
            "step_size_bound_tok_s": resident_bound,
            "step_size_fraction": results[name]["decode_tok_s"] / resident_bound,
            "kernel_peak_flops": peak,
            # TTFT is the prompt's prefill and one sampled token.
            "prefill_fraction": prefill / results[name]["ttft_s"] / peak,
        }
    return out


def roofline_lines(limits: dict[str, Any], prompt_len: int) -> list[str]:
    lines = [
        f"roofline: read {limits['read_bytes_per_s'] / 1e9:.1f} GB/s measured here at "
        f"{limits['threads']} thread(s) (the best pass over {PROBE_BYTES >> 20} MiB, past the "
        "last-level cache)"
    ]
    for name, m in limits["modes"].items():
        lines.append(
            f"{name:14s} reads {m['bytes_per_token'] / 1e6:.1f} MB/token: bound "
            f"{m['bound_tok_s']:.1f} tok/s ({m['binds']}), decode at {m['decode_fraction']:.0%} "
            f"of it; prefill of {prompt_len} at {m['prefill_fraction']:.0%} of the kernels' "
            f"peak ({m['kernel_peak_flops'] / 1e9:.1f} GFLOP/s)"
        )
        lines.append(
            f"{'':14s} a buffer of one step's size re-read: "
            f"{m['step_size_read_bytes_per_s'] / 1e9:.1f} GB/s, bound "
            f"{m['step_size_bound_tok_s']:.1f} tok/s, decode at {m['step_size_fraction']:.0%} of it"
        )
    return lines


def report_lines(result: dict[str, Any]) -> list[str]:
    ceiling = result["linear_ceiling_tok_s"]
    shared = result["greedy_tokens_shared_with_none"]
    lines = [
        f"one sequence: prompt {result['prompt_len']} tokens, {result['max_tokens']} generated, "
        f"greedy; {result['dtype']}, {result['device']}, {result['threads']} threads; "
        f"best of {result['repeat']} (median)",
    ]
    for name, r in result["engines"].items():
        of_ceiling = f" {r['decode_tok_s'] / ceiling:5.0%} of ceiling," if ceiling else ""
        agree = (
            f", greedy = none for {shared[name]}/{result['max_tokens']}" if name in shared else ""
        )
        lines.append(
            f"{name:14s} decode {r['decode_tok_s']:7.1f} tok/s ({r['decode_tok_s_median']:7.1f})"
            f"{of_ceiling} TTFT {r['ttft_s'] * 1e3:7.1f} ms ({r['ttft_s_median'] * 1e3:7.1f}), "
            f"weights {result['weight_bytes'][name] / 1e6:7.1f} MB{agree}"
        )
    if ceiling:
        lines.append(f"linear layers alone at batch 1 (ceiling): {ceiling:7.1f} tok/s")
    for name, vs in result["ratios"].items():
        lines.append(f"{name:14s} " + "  ".join(f"{k}: {v:.2f}x" for k, v in vs.items()))
    for name, sizes in result["batched_decode_tok_s"].items():
        cells = ", ".join(f"batch {b}: {v:.1f} tok/s" for b, v in sizes.items())
        lines.append(f"{name:14s} batched decode: {cells}")
    if result["roofline"]:
        lines += roofline_lines(result["roofline"], result["prompt_len"])
    return lines


if __name__ == "__main__":
    main()
