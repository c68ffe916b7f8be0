"""Time the linear layers of one model step: float32 against the quantized C kernels.

    python scripts/profile_quant.py                       # SmolLM2-135M shapes, 1..32 rows
    python scripts/profile_quant.py --threads 1 --rows 1,4,16,32

Every layer gets its own random weights, so a step streams the whole model from memory as a
real decode step does (one shared weight would sit in cache and flatter every variant). A step
is the best of ``--repeats`` runs of all 30 layers' four projections (qkv, o, gate/up, down).

Per row count it prints the step's time for: float32 ``F.linear`` (what ``--quantization none``
and ``auto``'s many-row steps run), each mode's kernel (what few-row steps run), and each mode's
dequantize-then-GEMM path (what ``int8``/``int4`` run from ``dense_min_rows`` rows on). The
crossovers are what ``quant.DENSE_MIN_ROWS`` and ``quantize.AUTO_MAX_ROWS`` are set from.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from nanokv_cli.engine.layers import cpu_kernels  # noqa: E402
from nanokv_cli.engine.layers.quant import DENSE_MIN_ROWS, QuantizedLinear  # noqa: E402
from nanokv_cli.engine.quantize import AUTO_MAX_ROWS  # noqa: E402

# (out, in) of one decoder layer with fused projections: qkv, o, gate/up, down.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", default="1,2,4,8,12,16,24,32", help="row counts to time")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


def best_ms(step: Callable[[], object], repeats: int) -> float:
    step()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def step_ms(layers: list, call: Callable, x: dict[int, torch.Tensor], repeats: int) -> float:
    """One step's time: ``call(layer, input)`` for every layer, inputs by their width."""

    def step() -> None:
        for layer in layers:
            width = layer.in_features if isinstance(layer, QuantizedLinear) else layer.shape[1]
            call(layer, x[width])

    return best_ms(step, repeats)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        sys.exit("the C kernels could not be built here (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    floats = [
        0.05 * torch.randn(*shape, generator=g)
        for _ in range(args.layers)
        for shape in LAYER_SHAPES
    ]
    quantized = {
        mode: [QuantizedLinear.from_float(w, mode) for w in floats] for mode in DENSE_MIN_ROWS
    }
    print(
        f"{args.layers} layers, {torch.get_num_threads()} threads; ms per step (best of {args.repeats})"
    )
    for n in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(n, k, generator=g) for k in {s[1] for s in LAYER_SHAPES}}
        times = {"float32": step_ms(floats, lambda w, x: F.linear(x, w), x, args.repeats)}
        for mode, layers in quantized.items():
            kernel = step_ms(layers, lambda q, x: cpu_kernels.linear(q.spec, x), x, args.repeats)
            dense = step_ms(layers, lambda q, x: q._dense_matmul(x), x, args.repeats)
            times[f"{mode} kernel"], times[f"{mode} dequantize"] = kernel, dense
        print(f"{n:>3} rows: " + "  ".join(f"{k} {v:7.1f}" for k, v in times.items()), flush=True)
    print(f"DENSE_MIN_ROWS {DENSE_MIN_ROWS}, AUTO_MAX_ROWS {AUTO_MAX_ROWS}")
    for mode, layers in quantized.items():
        weights = sum(q.in_features * q.out_features for q in layers)
        print(f"{mode}: {sum(q.nbytes for q in layers) / weights:.3f} bytes per weight")


if __name__ == "__main__":
    main()
