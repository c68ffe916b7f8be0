"""Linear layers sharded for tensor parallelism (Megatron-style), each with a ``weight_loader``.

Every parameter carries ``weight_loader(param, hf_tensor, shard_id=None)``: it receives the full
Hugging Face tensor and copies the slice this rank owns, so the same loading code serves TP=1 and
TP=N. Fused layers (qkv, gate/up) take one HF tensor per ``shard_id``.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .tp import divide, tp_rank, tp_size


def single_row_packing_available() -> bool:
    """Whether MKL's packed GEMM (the ops torch.compile's CPU backend uses) is in this torch."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def worth_packing(weight: torch.Tensor) -> bool:
    """Whether a [out, in] float32 CPU weight runs faster packed for 1-row inputs.

    Measured at batch 1 (AVX2, MKL, 1-2 threads), packed against F.linear: an LM head
    49152x576 8.0 -> 4.4 ms, gate/up 3072x576 0.52 -> 0.34 ms, 6144x1024 1.5 -> 1.1 ms,
    qkv 960x576 -13%; but o 576x576 +25% and down 576x1536 2x slower. Wide outputs gain.
    """
    out_features, in_features = weight.shape
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and out_features >= 1.5 * in_features
        and out_features >= 512
    )


def pack_for_single_row(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed copy of ``weight`` for 1-row inputs (``weight`` itself stays in use)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 1)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear, through the packed weight when there is one and ``x`` is a single row."""
    if packed_row is not None and x.dim() == 2 and x.shape[0] == 1:
        return torch.ops.mkl._mkl_linear(x, packed_row, weight, bias, 1)
    return F.linear(x, weight, bias)


# Whether the step being computed holds prefill rows; set by the model runner around each
# forward (``prefill_step``), read by ``auto_twin``.
_prefill_step = False


@contextmanager
def prefill_step(on: bool) -> Iterator[None]:
    """Mark the forward run inside as a step with (``on``) or without prefill rows."""
    global _prefill_step
    saved, _prefill_step = _prefill_step, on
    try:
        yield
    finally:
        _prefill_step = saved


def auto_twin(module: nn.Module, rows: int) -> nn.Module | None:
    """The ``--quantization auto`` copy of a layer's weights that serves ``rows`` input rows:
    the model file's blocks for few rows; for more, the batch copy, or in a step with prefill
    rows the exact copy where there is one (a prompt's K/V feed every later token, so they are
    computed without rounding the inputs to int8); None: the float weights (every step
    without ``auto``)."""
    if module.quantized is not None and rows < module.quantized.dense_min_rows:
        return module.quantized
    if _prefill_step and module.exact is not None:
        return module.exact
    return module.batched


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
        # MKL-packed weight for 1-row inputs (single-sequence decode); set by the model runner.
        self.packed_row: torch.Tensor | None = None
        # ``--quantization auto`` (quantize.attach_file_blocks), one rank only: the same weights
        # as a model file's quantized blocks, which serve steps of few rows, and as copies
        # laid out for batches and for prefills (see auto_twin).
        self.quantized: nn.Module | None = None
        self.batched: nn.Module | None = None
        self.exact: nn.Module | None = None
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
        twin = auto_twin(self, x.shape[0])
        if twin is not None:
            return twin(x)
        return linear(x, self.weight, self.bias, self.packed_row)


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
        twin = auto_twin(self, x.shape[0])
        if twin is not None:  # one rank only: no all-reduce
            return twin(x)
        # The bias belongs to the sum, so only one rank adds it.
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None, self.packed_row)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
