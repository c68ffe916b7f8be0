"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu import kernels as cpu_kernels
from .linear import copy_checked


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, loaded)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``.

        On the C path the sum is written into ``residual`` itself (each layer's residual
        stream is its own tensor, held by nobody else).
        """
        if cpu_kernels.runs(x):  # one fused C call instead of ~10 torch ops
            if residual is None:
                return cpu_kernels.rms_norm(x, self.weight, self.eps)
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual), residual
        # F.rms_norm is one fused kernel; in fp32 it is bit-identical to transformers' formula,
        # and in bf16 it normalises in fp32 internally (one rounding away from transformers).
        if residual is not None:
            x = x + residual
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
