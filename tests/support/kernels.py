"""Packed layers of the CPU kernels (``cpu/kernels.py``) with their float64 reference weights,
for the format and thread-pool tests."""

from __future__ import annotations

import torch

from nanokv_cli.engine.cpu import kernels
from nanokv_cli.engine.cpu.kernels import LINEAR_Q4P, LINEAR_Q8P


class Layer:
    """Random GGUF-style blocks of one kind, packed, with their float64 reference weights."""

    def __init__(self, kind: int, out_features: int, in_features: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        blocks = in_features // 32
        self.kind, self.out_features, self.in_features = kind, out_features, in_features
        scale = (0.001 + 0.02 * torch.rand(out_features, blocks, generator=g)).half()
        if kind == LINEAR_Q4P:
            nibbles = torch.randint(0, 256, (out_features, in_features // 2), generator=g)
            nibbles = nibbles.to(torch.uint8)
            # Q4_1 (a free min) on even rows, Q4_0 (zero = -8 scale) on odd ones
            zero = (-0.3 * torch.rand(out_features, blocks, generator=g)).half()
            zero[1::2] = scale[1::2] * -8.0
            self.packed = kernels.pack(LINEAR_Q4P, nibbles, scale, zero)
            halves = nibbles.view(out_features, blocks, 16).long()
            q = torch.cat([halves & 15, halves >> 4], dim=2)  # GGUF order: j and j + 16
            self.q, self.zero = q.reshape(out_features, in_features), zero
        else:
            q = torch.randint(-128, 128, (out_features, in_features), generator=g)
            self.packed = kernels.pack(LINEAR_Q8P, q.to(torch.int8), scale)
            self.q, self.zero = q, None
        self.scale = scale
        # the kernel's terms per block: scale * sum(q x) and zero * sum(x); their absolute sizes
        # bound its float32 rounding
        self.weight64 = self._expand(scale).double() * self.q.double()
        self.magnitude64 = self.weight64.abs()
        if self.zero is not None:
            self.weight64 = self.weight64 + self._expand(self.zero).double()
            self.magnitude64 = self.magnitude64 + self._expand(self.zero).double().abs()

    def _expand(self, per_block: torch.Tensor) -> torch.Tensor:
        return per_block.repeat_interleave(32, dim=1)

    def spec(self, bias=None):
        return kernels.linear_spec(
            self.kind, self.packed, self.in_features, bias=bias, out_features=self.out_features
        )

    def linear(self, x, bias=None):
        x = x if x.stride(-1) == 1 else x.contiguous()
        return kernels.linear(self.spec(bias), x)

    def dequantize_rows(self, rows):
        return kernels.dequantize_rows(self.spec(), rows.reshape(-1).long().contiguous())

    def float32_weight(self) -> torch.Tensor:
        """scale * q (+ zero) rounded as float32 arithmetic rounds it."""
        w = self._expand(self.scale).float() * self.q.float()
        return w if self.zero is None else w + self._expand(self.zero).float()
