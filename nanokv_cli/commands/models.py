"""Loading the model a command runs."""

from __future__ import annotations

import sys

import typer

from ..engine.config import EngineConfig


def make_llm(model: str | None, config: EngineConfig):
    """The model and its engine."""
    from ..llm import LLM

    llm = LLM(model, config=config)
    if llm.rank != 0:
        # A torchrun worker rank: LLM() returned once rank 0 finished; it has nothing to print.
        raise typer.Exit(0)
    if llm.model_runner.device.type == "cpu":
        from ..engine.cpu import kernels

        status = kernels.status()
        if status.lib is None and not status.switched_off:
            print(f"nanokv: note: {status.missing} (`nanokv doctor` says more)", file=sys.stderr)
    return llm
