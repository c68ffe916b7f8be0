"""Time nanokv's packed weight formats against torch's own CPU kernels on the same layer shapes.

    python scripts/profile/formats.py                      # SmolLM2-135M shapes, 1 thread
    python scripts/profile/formats.py --rows 1,4 --shapes qkv,lm_head --threads 2
    NANOKV_CPU_ISA=avx2 python scripts/profile/formats.py  # another instruction-set build

Per layer shape and row count, ms per call (the best of ``--repeats``, each the mean of enough
calls to run ~20 ms, the kernels taking turns; the machine may be shared, so the minimum is the
figure) of:

  q4p      LINEAR_Q4P: Q4_1 blocks, inputs rounded to int16 per 32 (every row)
  q8p      LINEAR_Q8P: Q8_0 blocks, inputs rounded to int16 per 32 (the LM head)
  t int4   ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the same Q4_1 groups (weight-only
           int4, groups of 32, float32 activations)
  t int4b  the same with bfloat16 activations (and scales): torch's vectorised path
  t int8   ``torch._weight_int8pack_mm``: int8 weights with one scale per output, float32 inputs
  t int8b  the same with bfloat16 activations
  t bf16   ``F.linear`` in bfloat16 (oneDNN/MKL)
  t f32    ``F.linear`` in float32 (MKL)

(bfloat16 inputs are converted beforehand, outside the timing), then the fastest torch kernel of
the cell, each nanokv format's time over its time (< 1: nanokv is faster), and q4p over q8p
(the 16-bit Q4 inputs' target: <= 1 from 16 rows). A kernel slower than ``--give-up`` ms per
call is not timed at a shape's larger row counts ("-"): torch's float32-activation int4/int8
kernels are scalar loops, seconds per call at an LM head's prefill. Last, the bytes per weight
each one holds resident, scales included.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import set_threads  # noqa: E402

from nanokv_cli.engine.cpu import build, kernels  # noqa: E402
from nanokv_cli.engine.cpu.formats import Q4, Q8, quantize  # noqa: E402

# (out, in) of SmolLM2-135M's fused projections and its LM head.
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
NANOKV = ("q4p", "q8p")
TORCH = ("t int4", "t int4b", "t int8", "t int8b", "t bf16", "t f32")
GROUP = 32


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help="layer shapes to time")
    p.add_argument("--rows", default="1,4,16,64,512", help="row counts to time")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--give-up", type=float, default=500.0, help="ms per call (see above)")
    return p.parse_args()


def best_ms(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each call's best time in ms; the repeats take turns between the calls, so that a burst of
    load on a shared machine does not fall on one kernel's every repeat."""
    number = {}
    for name, call in calls.items():
        start = time.perf_counter()
        call()  # warm-up, and a first measure of how many calls make ~20 ms
        number[name] = max(1, math.ceil(0.02 / max(time.perf_counter() - start, 1e-6)))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(number[name]):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / number[name])
    return {name: t * 1e3 for name, t in best.items()}


class Kernels:
    """Every kernel of one layer shape, built from one random float weight: nanokv's formats
    from its Q4_1 and Q8_0 groups, torch's int4 from the same Q4_1 groups."""

    def __init__(self, out_features: int, in_features: int, g: torch.Generator) -> None:
        w = 0.05 * torch.randn(out_features, in_features, generator=g)
        self.shape = (out_features, in_features)
        q4, q8 = quantize(w, Q4), quantize(w, Q8)
        self.q4p = kernels.pack(kernels.LINEAR_Q4P, q4.q, q4.scale, q4.zero)
        self.q8p = kernels.pack(kernels.LINEAR_Q8P, q8.q, q8.scale)
        # torch's int4 dequantizes (q - 8) * scale + zero: its zero is the Q4_1 min + 8 scale
        halves = q4.q.view(out_features, -1, GROUP // 2).long()  # GGUF order: j and j + 16
        q = torch.cat([halves & 15, halves >> 4], dim=2).reshape(out_features, in_features)
        self.int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        scale, zero = q4.scale.float(), q4.zero.float() + 8.0 * q4.scale.float()
        self.int4_scales = torch.stack([scale.T, zero.T], dim=2).contiguous()  # [in/32, out, 2]
        self.int4_scales_bf16 = self.int4_scales.bfloat16()
        self.int8_scale = w.abs().amax(dim=1) / 127.0
        self.int8 = torch.round(w / self.int8_scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.int8_scale_bf16 = self.int8_scale.bfloat16()
        self.f32 = w
        self.bf16 = w.bfloat16()
        self._check_same_weights(g)

    def _check_same_weights(self, g: torch.Generator) -> None:
        """torch's int4 holds the very weights q4p holds (its zero-point convention)."""
        x = torch.randn(2, self.shape[1], generator=g)
        calls = self.calls(x)
        ours, theirs = calls["q4p"](), calls["t int4"]()
        error = float((ours - theirs).norm() / ours.norm())
        if error > 1e-4:
            sys.exit(f"torch's int4 weights are not q4p's: relative difference {error:.1e}")

    def calls(self, x: torch.Tensor) -> dict[str, Callable[[], object]]:
        out_features, in_features = self.shape
        xb = x.bfloat16()

        def nanokv(kind: int, weights: torch.Tensor) -> Callable[[], object]:
            spec = kernels.linear_spec(kind, weights, in_features, out_features=out_features)
            return lambda: kernels.linear(spec, x)

        return {
            "q4p": nanokv(kernels.LINEAR_Q4P, self.q4p),
            "q8p": nanokv(kernels.LINEAR_Q8P, self.q8p),
            "t int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.int4, GROUP, self.int4_scales
            ),
            "t int4b": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                xb, self.int4, GROUP, self.int4_scales_bf16
            ),
            "t int8": lambda: torch._weight_int8pack_mm(x, self.int8, self.int8_scale),
            "t int8b": lambda: torch._weight_int8pack_mm(xb, self.int8, self.int8_scale_bf16),
            "t bf16": lambda: F.linear(xb, self.bf16),
            "t f32": lambda: F.linear(x, self.f32),
        }

    def bytes_per_weight(self) -> dict[str, float]:
        weights = self.shape[0] * self.shape[1]

        def size(*tensors: torch.Tensor) -> float:
            return sum(t.numel() * t.element_size() for t in tensors) / weights

        return {
            "q4p": size(self.q4p),
            "q8p": size(self.q8p),
            "t int4": size(self.int4, self.int4_scales),
            "t int4b": size(self.int4, self.int4_scales_bf16),
            "t int8": size(self.int8, self.int8_scale),
            "t bf16": size(self.bf16),
            "t f32": size(self.f32),
        }


def main() -> None:
    args = parse_args()
    set_threads(args.threads)
    if not kernels.available():
        sys.exit("the C kernels could not be built here (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    print(
        f"{build.active_variant().name} build, {torch.get_num_threads()} thread(s), torch "
        f"{torch.__version__}; ms per call, best of {args.repeats}"
    )
    columns = (*NANOKV, *TORCH)
    print(
        f"{'layer':>16} {'rows':>5} "
        + " ".join(f"{c:>8}" for c in columns)
        + f" {'fastest':>7} {'q4p/t':>6} {'q8p/t':>6} {'q4p/q8p':>7}"
    )
    sizes = {}
    for name in args.shapes.split(","):
        layer = Kernels(*SHAPES[name], g)
        shape = f"{name} {layer.shape[0]}x{layer.shape[1]}"
        sizes[shape] = layer.bytes_per_weight()
        given_up: set[str] = set()
        for n in (int(r) for r in args.rows.split(",")):
            x = torch.randn(n, layer.shape[1], generator=g)
            calls = {k: call for k, call in layer.calls(x).items() if k not in given_up}
            times = dict.fromkeys(columns, math.inf) | best_ms(calls, args.repeats)
            given_up |= {k for k, t in times.items() if args.give_up < t < math.inf}
            fastest = min(TORCH, key=times.__getitem__)
            ratios = [times[c] / times[fastest] for c in NANOKV]
            print(
                f"{shape:>16} {n:>5} "
                + " ".join(
                    f"{times[c]:8.3f}" if times[c] < math.inf else f"{'-':>8}" for c in columns
                )
                + f" {fastest[2:]:>7} "
                + " ".join(f"{r:6.2f}" for r in ratios)
                + f" {times['q4p'] / times['q8p']:7.2f}",
                flush=True,
            )
    print("bytes per weight")
    for shape, per_format in sizes.items():
        print(f"{shape:>16}       " + "  ".join(f"{k} {v:.3f}" for k, v in per_format.items()))


if __name__ == "__main__":
    main()
