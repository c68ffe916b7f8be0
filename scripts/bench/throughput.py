"""Offline throughput: nanokv vs Hugging Face transformers, same model, prompts and dtype.

nano-vllm's bench.py, scaled for a CPU by default: ``random.seed(0)``, 64 sequences, prompts of
``randint(64, 512)`` random token ids below 10,000, ``max_tokens = randint(64, 256)``, EOS
ignored, temperature 0.6. transformers runs the way a user would: ``generate`` on left-padded
sub-batches of 16 in submission order, each running to its longest ``max_tokens``. Both are
scored in *useful* output tokens per second (the sum of ``max_tokens``; a padded batch's extra
tokens do not count). nanokv runs once per ``--modes`` (default ``auto,none`` on CPU: the
default, and the float32 path transformers also computes), loading the model the user named (the
default GGUF, so ``auto`` has the file's blocks); transformers runs once per ``--hf-dtypes``
on the same weights (default float32 and bfloat16 on CPU: float32 is transformers' fastest for
dequantized GGUF weights on most CPUs, bfloat16 can win where the CPU has AVX512-BF16), and
nanokv is compared against the fastest of them.

    python scripts/bench/throughput.py                      # CPU, default SmolLM2-135M
    python scripts/bench/throughput.py --quick --threads 1  # smoke test
    python scripts/bench/throughput.py --device cuda        # nano-vllm's exact setup (below)

``--device cuda`` switches the defaults to nano-vllm's setup: Qwen3-0.6B architecture with random
weights (``--random-weights qwen3-0.6b``), bf16, 256 sequences, 100-1024 input and output tokens,
CUDA graphs on, max_model_len 4096. transformers then runs only the first ``--hf-seqs`` sequences
(default 64 on CUDA: 16 sub-batches of up to 2k tokens would take many minutes), and its rate is
that subset's useful tokens over its time. ``--hf-continuous`` runs transformers' continuous
batching instead (``generate_batch``, its paged cache), on every sequence: the comparison
issue 44 asks for. On CUDA the roofline is the bandwidth bound alone: every step reads the
weights once and each row its context's K/V, at the device-to-device copy bandwidth measured.

``--attention-backend`` is nanokv's (auto, triton, flash, sdpa, paged-c); ``--enforce-eager``
turns CUDA graphs off.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

import torch  # noqa: E402
from common import (  # noqa: E402
    add_common_args,
    decode_bytes,
    emit,
    hf_generate,
    kernel_peak_flops,
    load_transformers,
    model_folder,
    parse_modes,
    read_bandwidth,
    resolve_dtype_name,
    set_threads,
    step_flops,
    timed,
    workdir,
)

from nanokv_cli import LLM, SamplingParams  # noqa: E402
from nanokv_cli.engine.config import ATTENTION_BACKENDS  # noqa: E402
from nanokv_cli.engine.cpu import kernels as cpu_kernels  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    p.add_argument(
        "--modes",
        default=None,
        help="nanokv quantization modes, comma-separated (default auto,none on CPU, none on CUDA)",
    )
    p.add_argument("--num-seqs", type=int, default=None, help="default 64 (CPU), 256 (CUDA)")
    p.add_argument("--min-input", type=int, default=None, help="default 64 (CPU), 100 (CUDA)")
    p.add_argument("--max-input", type=int, default=None, help="default 512 (CPU), 1024 (CUDA)")
    p.add_argument("--min-output", type=int, default=None, help="default 64 (CPU), 100 (CUDA)")
    p.add_argument("--max-output", type=int, default=None, help="default 256 (CPU), 1024 (CUDA)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers sub-batch size")
    p.add_argument(
        "--hf-seqs",
        type=int,
        default=None,
        help="run transformers on the first N (default: all; 64 on CUDA)",
    )
    p.add_argument(
        "--hf-dtypes",
        default=None,
        help="transformers dtypes, comma-separated (default float32,bfloat16 on CPU; --dtype on CUDA)",
    )
    p.add_argument("--skip-hf", action="store_true", help="nanokv only")
    p.add_argument("--block-size", type=int, default=None, help="nanokv block size (LLM default)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="nanokv step budget (LLM default)"
    )
    p.add_argument(
        "--kv-cache-gib", type=float, default=None, help="nanokv CPU KV cache (default: LLM's)"
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--attention-backend", default="auto", choices=ATTENTION_BACKENDS, help="nanokv's"
    )
    p.add_argument(
        "--hf-continuous",
        action="store_true",
        help="transformers' continuous batching (generate_batch, paged cache), all sequences",
    )
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and args.model is None and args.random_weights is None:
        args.random_weights = "qwen3-0.6b"
    defaults = (256, 100, 1024, 100, 1024) if cuda else (64, 64, 512, 64, 256)
    if args.quick:
        defaults = (16, 32, 128, 16, 64)
    names = ("num_seqs", "min_input", "max_input", "min_output", "max_output")
    for name, value in zip(names, defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.hf_seqs is None:
        args.hf_seqs = 64 if cuda and not args.quick and not args.hf_continuous else args.num_seqs
    args.modes = parse_modes(p, args.modes or ("none" if cuda else "auto,none"), args.device)
    default_dtypes = args.dtype if cuda or args.dtype != "auto" else "float32,bfloat16"
    args.hf_dtypes = [d.strip() for d in (args.hf_dtypes or default_dtypes).split(",")]
    for name in args.hf_dtypes:
        try:
            resolve_dtype_name(name, args.device)
        except ValueError as e:
            p.error(f"--hf-dtypes: {e}")
    return args


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    # nano-vllm's order of draws: every prompt first, then every max_tokens.
    random.seed(0)
    prompts = [
        [random.randint(0, 9999) for _ in range(random.randint(args.min_input, args.max_input))]
        for _ in range(args.num_seqs)
    ]
    max_tokens = [random.randint(args.min_output, args.max_output) for _ in range(args.num_seqs)]
    return prompts, max_tokens


def run_nanokv(args: argparse.Namespace, source, mode: str, prompts, max_tokens) -> dict:
    kwargs = dict(
        dtype=args.dtype,
        device=args.device,
        enforce_eager=args.enforce_eager,
        quantization=mode,
        attention_backend=args.attention_backend,
    )
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_gib:
        kwargs["kv_cache_memory"] = int(args.kv_cache_gib * (1 << 30))
    if args.device.startswith("cuda"):
        kwargs["max_model_len"] = 4096
    llm = LLM(source, **kwargs)
    params = [
        SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
        for n in max_tokens
    ]
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))  # warm-up, as nano-vllm's bench
    stats = llm.engine.block_manager.stats
    steps_before, preempted_before = llm.engine.num_steps, stats.preemptions
    seconds, outs = timed(lambda: llm.generate(prompts, params), args.device)
    generated = sum(len(o["token_ids"]) for o in outs)
    assert generated == sum(max_tokens), "nanokv stopped a request early"
    return {
        "seconds": seconds,
        "output_tokens": generated,
        "tok_s": generated / seconds,
        "steps": llm.engine.num_steps - steps_before,
        "preemptions": stats.preemptions - preempted_before,
        "num_blocks": llm.model_runner.num_blocks,
        "block_size": llm.engine.block_size,
        "dtype": str(llm.model_runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(llm.model_runner.kv_cache_dtype).removeprefix("torch."),
        "quantization": llm.quantization or "none",
        "attention": llm.model_runner.plan.attention,
        "cuda_graphs": llm.model_runner.plan.cuda_graphs,
        "roofline": workload_roofline(
            llm, mode, prompts, max_tokens, seconds, llm.engine.num_steps - steps_before
        ),
    }


# Each quantization mode's weight format, for its compute peak.
PEAK_FORMAT = {"auto": "q4", "int4": "q4", "int8": "q8", "none": "f32"}


def workload_roofline(llm, mode, prompts, max_tokens, seconds, steps) -> dict | None:
    """The run's time against the least this machine needs for it: every step reads the
    weights once and each decode row its context's K/V (at the read bandwidth measured here),
    and every prompt and output token costs its FLOPs (at the kernels' peak); the tighter of
    the two binds."""
    if llm.model_runner.device.type == "cuda":
        return cuda_roofline(llm, prompts, max_tokens, seconds, steps)
    if not (cpu_kernels.available() and llm.model_runner.device.type == "cpu"):
        return None
    threads = torch.get_num_threads()
    bandwidth = read_bandwidth(threads)
    peak = kernel_peak_flops(PEAK_FORMAT.get(mode, "f32"), threads)
    weights = decode_bytes(llm, 0)
    per_position = decode_bytes(llm, 1) - weights
    kv_reads = sum(n * len(p) + n * (n - 1) // 2 for p, n in zip(prompts, max_tokens))
    flops = sum(
        step_flops(llm, len(p), len(p) // 2, logits_rows=1) + step_flops(llm, n, len(p) + n // 2)
        for p, n in zip(prompts, max_tokens)
    )
    memory_s = (steps * weights + kv_reads * per_position) / bandwidth
    compute_s = flops / peak
    bound = max(memory_s, compute_s)
    return {
        "read_bytes_per_s": bandwidth,
        "kernel_peak_flops": peak,
        "bound_seconds": bound,
        "binds": "bandwidth" if memory_s >= compute_s else "compute",
        "fraction": bound / seconds,
    }


def cuda_roofline(llm, prompts, max_tokens, seconds, steps) -> dict:
    """The bandwidth bound on CUDA: the weights once per step, plus each row's K/V, at the
    device's copy bandwidth (measured: the best of a few 1 GiB copies, read + write)."""
    bandwidth = copy_bandwidth(str(llm.model_runner.device))
    weights = decode_bytes(llm, 0)
    per_position = decode_bytes(llm, 1) - weights
    kv_reads = sum(n * len(p) + n * (n - 1) // 2 for p, n in zip(prompts, max_tokens))
    bound = (steps * weights + kv_reads * per_position) / bandwidth
    return {
        "read_bytes_per_s": bandwidth,
        "kernel_peak_flops": 0.0,
        "bound_seconds": bound,
        "binds": "bandwidth",
        "fraction": bound / seconds,
    }


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes/s a device-to-device copy moves (read + write), the best of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src), device)[0] for _ in range(5))
    return 2 * nbytes / best


def run_transformers(
    args: argparse.Namespace, folder: str, dtype_name: str, prompts, max_tokens
) -> dict:
    dtype = resolve_dtype_name(dtype_name, args.device)
    if args.hf_continuous:
        return run_transformers_continuous(args, folder, dtype, prompts, max_tokens)
    model = load_transformers(folder, dtype, args.device)
    n = min(args.hf_seqs, len(prompts))
    hf_generate(model, [prompts[0][:8]], 4, temperature=args.temperature, device=args.device)
    total = 0.0
    for start in range(0, n, args.hf_batch_size):
        batch = prompts[start : min(n, start + args.hf_batch_size)]
        longest = max(max_tokens[start : start + len(batch)])
        seconds, _ = timed(
            lambda b=batch, m=longest: hf_generate(
                model, b, m, temperature=args.temperature, device=args.device
            ),
            args.device,
        )
        total += seconds
    useful = sum(max_tokens[:n])
    return {
        "seconds": total,
        "output_tokens": useful,
        "tok_s": useful / total,
        "seqs": n,
        "dtype": str(dtype).removeprefix("torch."),
    }


def run_transformers_continuous(args, folder: str, dtype, prompts, max_tokens) -> dict:
    """transformers' continuous batching (``generate_batch`` over its paged cache) on every
    sequence. It takes one ``max_new_tokens`` for the batch, so each sequence runs to the
    longest; only the useful tokens (the sum of ``max_tokens``) count, as for ``generate``."""
    import transformers

    # SDPA: generate_batch picks its paged attention itself (transformers 5: "sdpa" or a
    # flash implementation; eager runs as "paged|eager").
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(args.device).eval()
    config = transformers.GenerationConfig(
        max_new_tokens=max(max_tokens),
        do_sample=args.temperature > 0,
        temperature=args.temperature or None,
        eos_token_id=-1,  # ignore EOS, as nanokv's ignore_eos
        pad_token_id=0,
    )
    extra = {}
    if not args.device.startswith("cuda"):
        # On CPU it would size its cache from memory it cannot measure without psutil (and
        # page in gigabytes): give it what the workload needs, in its 256-token pages.
        pages = sum(-(-(len(p) + max(max_tokens)) // 256) for p in prompts)
        extra["continuous_batching_config"] = transformers.ContinuousBatchingConfig(
            num_blocks=pages + 1, max_batch_tokens=512
        )
    with torch.inference_mode():
        model.generate_batch([prompts[0][:8]], generation_config=config, **extra)  # warm-up
        seconds, outs = timed(
            lambda: model.generate_batch(prompts, generation_config=config, **extra), args.device
        )
    useful = sum(max_tokens)
    return {
        "seconds": seconds,
        "output_tokens": useful,
        "tok_s": useful / seconds,
        "seqs": len(outs),
        "dtype": str(dtype).removeprefix("torch."),
        "continuous": True,
    }


def main() -> None:
    args = parse_args()
    threads = set_threads(args.threads)
    prompts, max_tokens = workload(args)
    with workdir() as tmp:
        folder = model_folder(args, resolve_dtype_name(args.dtype, args.device), tmp)
        # transformers needs a Hugging Face folder; nanokv loads what the user named.
        source = folder if args.random_weights else args.model
        nano = {m: run_nanokv(args, source, m, prompts, max_tokens) for m in args.modes}
        runs = (
            []
            if args.skip_hf
            else [run_transformers(args, folder, d, prompts, max_tokens) for d in args.hf_dtypes]
        )
    hf = max(runs, key=lambda r: r["tok_s"]) if runs else None
    result = {
        "benchmark": "throughput",
        "device": args.device,
        "threads": threads,
        "model": args.random_weights or args.model or "default (SmolLM2-135M)",
        "num_seqs": args.num_seqs,
        "input_len": [args.min_input, args.max_input],
        "output_len": [args.min_output, args.max_output],
        "prompt_tokens": sum(map(len, prompts)),
        "nanokv": nano,
        "transformers": hf,  # the fastest of transformers_runs
        "transformers_runs": runs,
        "ratio": None if hf is None else {m: r["tok_s"] / hf["tok_s"] for m, r in nano.items()},
    }
    first = next(iter(nano.values()))
    lines = [
        f"workload: {args.num_seqs} seqs, {result['prompt_tokens']} prompt tokens, "
        f"{first['output_tokens']} output tokens; {args.device}, {threads} threads"
    ]
    for mode, r in nano.items():
        lines.append(
            f"nanokv {mode:5s}: {r['output_tokens']:6d} tok in {r['seconds']:7.2f} s = "
            f"{r['tok_s']:8.1f} tok/s ({r['steps']} steps, {r['preemptions']} preemptions; "
            f"runs as {r['quantization']} on a {r['dtype']} model, {r['kv_cache_dtype']} K/V; "
            f"{r['attention']} attention{', CUDA graphs' if r['cuda_graphs'] else ''})"
        )
        if r["roofline"]:
            limit = r["roofline"]
            lines.append(
                f"  roofline: the run needs at least {limit['bound_seconds']:.2f} s "
                f"({limit['binds']} binds: read {limit['read_bytes_per_s'] / 1e9:.1f} GB/s, "
                f"kernel peak {limit['kernel_peak_flops'] / 1e9:.1f} GFLOP/s, measured here); "
                f"it runs at {limit['fraction']:.0%} of that limit"
            )
    for r in runs:
        lines.append(
            f"transformers {r['dtype']}: {r['output_tokens']:6d} tok in {r['seconds']:7.2f} s = "
            f"{r['tok_s']:8.1f} tok/s ({r['seqs']} seqs, "
            + (
                "continuous batching)"
                if args.hf_continuous
                else f"sub-batches of {args.hf_batch_size})"
            )
        )
    if hf is not None:
        lines += [
            f"ratio {mode} vs transformers {hf['dtype']} (its fastest): {ratio:.2f}x"
            for mode, ratio in result["ratio"].items()
        ]
    emit(result, args.json, lines)


if __name__ == "__main__":
    main()
