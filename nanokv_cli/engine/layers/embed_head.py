"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .linear import copy_checked
from .tp import divide, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary's rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.num_embeddings = num_embeddings
        self.num_local = divide(num_embeddings, self.tp_size, "vocabulary size")
        self.vocab_start = self.num_local * self.tp_rank
        self.vocab_end = self.vocab_start + self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"expected {self.num_embeddings} vocabulary rows, got {loaded.shape[0]}"
            )
        copy_checked(param.data, loaded.narrow(0, self.vocab_start, self.num_local))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Rows this rank does not own come out as zeros; the all-reduce fills them in.
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * owned
        y = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; with TP each rank computes its slice and rank 0 gathers them.

    Only rank 0 samples, so other ranks get ``None`` (as in nano-vllm) and the gather sends
    each slice once instead of to everyone.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        parts = (
            [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        )
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None
