"""Loading the model a command runs."""

from __future__ import annotations

import sys
import warnings

import typer

from ..engine.config import EngineConfig


def make_llm(model: str | None, config: EngineConfig):
    """The model and its engine."""
    from ..engine.tiers.model_tier import KVTierWarning
    from ..llm import LLM

    with warnings.catch_warnings():
        # The tier's note is printed below, with the cache's line: not twice.
        warnings.simplefilter("ignore", KVTierWarning)
        llm = LLM(model, config=config)
    if llm.rank != 0:
        # A torchrun worker rank: LLM() returned once rank 0 finished; it has nothing to print.
        raise typer.Exit(0)
    if llm.model_runner.device.type == "cpu":
        from ..engine.cpu import library

        status = library.status()
        if status.lib is None and not status.switched_off:
            print(f"nanokv: note: {status.missing} (`nanokv doctor` says more)", file=sys.stderr)
    print(kv_cache_line(llm), file=sys.stderr, flush=True)
    if llm.kv_tier_note:  # the second tier (--kv-tier): its size, or why it is off
        print(llm.kv_tier_note, file=sys.stderr, flush=True)
    return llm


def kv_cache_line(llm) -> str:
    """What the KV cache took and what decided it, in one line: said at start-up on stderr
    (also when piped), as the memory a run holds should never be a surprise."""
    from ..engine.runner.memory import format_bytes

    runner, engine = llm.model_runner, llm.engine
    blocks, size = engine.num_blocks, engine.block_size
    dtype = str(runner.kv_cache_dtype).removeprefix("torch.")
    per_rank = " per rank" if llm.tensor_parallel_size > 1 else ""
    return (
        f"nanokv: KV cache {blocks:,} blocks × {size:,} tokens = {blocks * size:,} tokens, "
        f"{format_bytes(blocks * runner.block_bytes)} {dtype}{per_rank}, "
        f"from {runner.kv_cache_source}"
    )
