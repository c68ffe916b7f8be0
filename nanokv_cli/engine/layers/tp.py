"""Tensor-parallel rank and world size, read from torch.distributed when it is initialised.

Every layer asks here instead of taking rank/size arguments, so a model built inside a worker
process of a ``torch.distributed`` group shards itself without extra plumbing, and a model built
anywhere else is simply unsharded (size 1).
"""

import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def divide(total: int, parts: int, what: str) -> int:
    """Split ``total`` evenly over ``parts`` ranks, or say which dimension does not divide."""
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({parts})")
    return total // parts
