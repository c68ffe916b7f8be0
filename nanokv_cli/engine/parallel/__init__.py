"""Tensor parallelism: ranks, their channel and workers."""
