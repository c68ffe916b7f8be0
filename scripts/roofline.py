"""The physical limits the CPU benchmarks print their speed against (issue 32).

- ``read_bandwidth(threads)``: bytes per second one pass of the C kernels' own pool reads from a
  buffer well past the last-level cache (csrc/probe.c), the best of a few passes, measured in
  the benchmark's own run. ``nbytes=`` reads a buffer of another size again and again: at a
  decode step's own size it is what a step's re-reads can reach where they fit the last-level
  cache in part, a tighter bound than the first.
- ``kernel_peak_flops(fmt, threads)``: the multiply-adds per second of the kernels' inner loop
  on a layer held in cache (no memory traffic), for a weight format: the compute limit of a
  batch or a prompt.
- ``decode_bytes(llm, context)``: what one decode step of one sequence must read, from the
  model's actual formats: every weight the step multiplies by (packed or float, a tied
  table once), plus the K/V of ``context`` positions.
- ``step_flops(llm, rows, context)``: a step's multiply-adds times two.

A step's bound is ``max(bytes / bandwidth, flops / peak)``; a benchmark prints its measured
speed as a fraction of the speed that bound allows.

    python scripts/roofline.py --threads 1,2     # the machine's limits alone
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanokv_cli.engine.cpu import kernels  # noqa: E402
from nanokv_cli.engine.cpu.formats import FORMATS, FloatLinear, PackedLinear  # noqa: E402
from nanokv_cli.engine.layers.embed_head import ParallelLMHead  # noqa: E402
from nanokv_cli.engine.layers.linear import LinearBase  # noqa: E402

PROBE_BYTES = 512 << 20  # far past any last-level cache here (32-260 MiB)
# The peak's layer: 192 rows of 576 inputs against ~384 KB of weights in the format, so the
# weights stay in a core's L2 (1-2 MB here) and a call's fixed costs (ctypes, rounding the rows,
# the pool's hand-off) are a few percent of it. A layer of 192 x 576 x 96 rows measured ~45%
# below this one's peak at one thread and two, so a 256-token prefill read "138%" of it.
PEAK_ROWS, PEAK_INPUTS, PEAK_WEIGHT_BYTES = 192, 576, 384 << 10


def read_bandwidth(threads: int, repeats: int = 5, nbytes: int = PROBE_BYTES) -> float:
    """Best bytes/s of ``repeats`` passes of ``threads`` threads over ``nbytes``."""
    buffer = torch.ones(nbytes, dtype=torch.uint8)  # written: every page is there
    kernels.read_probe(buffer, threads)  # warm the pool's threads
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.read_probe(buffer, threads)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def kernel_peak_flops(fmt: str, threads: int, repeats: int = 20) -> float:
    """Best FLOP/s (2 per multiply-add) of the C product on a cache-resident layer of format
    ``fmt`` ("q4", "q8" or "f32") over ``PEAK_ROWS`` rows, with ``threads`` threads."""
    in_features, rows = PEAK_INPUTS, PEAK_ROWS
    packed = FORMATS.get(fmt)
    per_weight = packed.bytes_per_weight if packed else 4.0  # f32
    out_features = int(PEAK_WEIGHT_BYTES / (in_features * per_weight)) // 16 * 16
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    layer = FloatLinear(weight, None) if fmt == "f32" else PackedLinear.from_parts(packed, [weight])
    x = torch.randn(rows, in_features)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernels run torch's thread count
    try:
        with torch.inference_mode():
            layer(x)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(10):
                    layer(x)
                best = min(best, (time.perf_counter() - start) / 10)
    finally:
        torch.set_num_threads(previous)
    return 2 * out_features * in_features * rows / best


def _weight_bytes(module: torch.nn.Module) -> int:
    if isinstance(module, PackedLinear):
        return module.nbytes
    return sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))


def decode_bytes(llm, context: int) -> int:
    """Bytes one decode step of one sequence at ``context`` positions reads: the weights it
    multiplies by, each once (a packed embedding sharing the LM head's table is the head's
    read; an embedding of its own gives one row), and the K/V of ``context`` positions."""
    runner = llm.model_runner
    model = runner.model
    embed = model.model.embed_tokens
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if module is embed or id(module) in seen:
            continue
        seen.add(id(module))
        total += _weight_bytes(module)
    kv = context * runner.cache_shape.block_bytes // runner.block_size
    return total + kv


def step_flops(llm, rows: int, context: int, logits_rows: int | None = None) -> int:
    """FLOPs (2 per multiply-add) of a step of ``rows`` query rows at a mean ``context``:
    every projection per row, the LM head per row of ``logits_rows`` (default: all, a decode
    step; a prompt's prefill projects its last row only), and attention's scores and weighted
    sums over the context."""
    model = llm.model_runner.model
    head = model.lm_head
    head_size = _matmul_size(head)
    layers = sum(_matmul_size(m) for m in model.modules() if m is not head)
    config = llm.config
    attention = 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    logits = rows if logits_rows is None else logits_rows
    return 2 * (rows * (layers + attention * context) + logits * head_size)


def _matmul_size(module: torch.nn.Module) -> int:
    """Multiply-adds per row of a projection (packed, float kernel or torch layer), else 0."""
    if isinstance(module, PackedLinear):
        return module.in_features * module.out_features
    if isinstance(module, (FloatLinear, LinearBase, ParallelLMHead)):
        weight = module.weight
        return weight.shape[0] * weight.shape[1]
    return 0


def bound_tok_s(
    bytes_per_step: float, flops_per_step: float, bandwidth: float, peak: float, rows: int
) -> tuple[float, str]:
    """Tokens/s the tighter limit allows a step of ``rows`` rows, and which limit binds."""
    memory, compute = bytes_per_step / bandwidth, flops_per_step / peak
    return rows / max(memory, compute), "bandwidth" if memory >= compute else "compute"


def main() -> None:
    p = argparse.ArgumentParser(description="the machine's read bandwidth and kernel peaks")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = p.parse_args()
    if not kernels.available():
        sys.exit("the C kernels are not built here (nanokv doctor says why)")
    for threads in (int(t) for t in args.threads.split(",")):
        peaks = ", ".join(
            f"{fmt} {kernel_peak_flops(fmt, threads) / 1e9:.1f}" for fmt in ("q4", "q8", "f32")
        )
        print(
            f"{threads} thread(s): read {read_bandwidth(threads) / 1e9:.1f} GB/s; "
            f"kernel peak GFLOP/s: {peaks}"
        )


if __name__ == "__main__":
    main()
