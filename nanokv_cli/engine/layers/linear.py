"""Linear layers sharded for tensor parallelism (Megatron-style), each with a ``weight_loader``.

Every parameter carries ``weight_loader(param, hf_tensor, shard_id=None)``: it receives the full
Hugging Face tensor and copies the slice this rank owns, so the same loading code serves TP=1 and
TP=N. Fused layers (qkv, gate/up) take one HF tensor per ``shard_id``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .tp import divide, tp_rank, tp_size


def copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``param`` (converting dtype), rejecting a shape mismatch."""
    if param.shape != loaded.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T (+ b); ``tp_dim`` is the weight dimension split across ranks (None: replicated)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def shard(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp_size == 1:
            return loaded
        return loaded.chunk(self.tp_size, dim)[self.tp_rank]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and not (param.dim() == 1 and self.tp_dim == 1):
            loaded = self.shard(loaded, self.tp_dim)
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        out = divide(output_size, tp_size(), "output features")
        super().__init__(input_size, out, bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one GEMM (gate/up).

    Each rank's weight is [shard of part 0; shard of part 1; ...], so a rank's output splits
    into its own slices of every part.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        for size in output_sizes:
            divide(size, tp_size(), "output features")
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        copy_checked(param.data.narrow(0, offset, size), self.shard(loaded, 0))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads (and KV heads) are split across ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "number of attention heads")
        self.num_kv_heads = divide(num_kv_heads, tp, "number of key/value heads")
        output_size = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id
        ]
        copy_checked(param.data.narrow(0, offset, size), self.shard(loaded, 0))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        inp = divide(input_size, tp_size(), "input features")
        super().__init__(inp, output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias belongs to the sum, so only one rank adds it.
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
