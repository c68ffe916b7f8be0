"""What every tensor-parallel rank shares: timeouts, process groups, errors, and its shard of
the model (``build_shard``). ``distributed.py`` says how the ranks work together."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..config import EngineConfig, ModelConfig
from ..runner.model_runner import ModelRunner
from ..runner.run_plan import resolve_plan

# A forward pass keeps all ranks in lockstep, so a collective waits only for the slowest rank
# to reach the same layer; this long means a rank is stuck.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# Workers wait on the control group between steps, for as long as rank 0 stays idle. Rank 0's
# death still ends the wait at once: its sockets close.
IDLE_TIMEOUT = timedelta(days=365)
STARTUP_TIMEOUT = timedelta(minutes=5)  # for spawned workers to import torch and connect
STOP_GRACE = 10.0  # seconds a worker gets to leave after the stop message
HEADER_INTS = 512  # one broadcast carries the command, the length and this much payload

_LOOPBACK = "127.0.0.1"
_STEP, _STOP = 1, 2
_RECORD = 10  # ints per sequence before its tokens and blocks


class TensorParallelError(RuntimeError):
    """A worker rank failed or died, or the tensor-parallel group is no longer usable."""


# -- checks -------------------------------------------------------------------------------------


def _from_collective(exc: BaseException) -> bool:
    """Whether ``exc`` may come from a peer going away (collectives raise RuntimeErrors)."""
    return isinstance(exc, RuntimeError) and not isinstance(exc, TensorParallelError)


def _worker_error(message: str) -> TensorParallelError:
    """The error rank 0 raises: the summary as message, a worker's traceback as a note."""
    summary, _, details = message.partition("\n")
    error = TensorParallelError(summary)
    if details:
        error.add_note(f"worker traceback:\n{details}")
    return error


def _loopback_gloo_options() -> Any:
    """gloo options that bind to 127.0.0.1 only: spawned ranks never need another interface."""
    try:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_LOOPBACK)]
        return options
    except (AttributeError, RuntimeError):  # private API moved: fall back to the default
        return None


def _init_group(backend: str, rank: int, world: int, store: Any, loopback: bool) -> Any:
    """Join the default group (the model's collectives) and create the gloo control group."""
    options = _loopback_gloo_options() if loopback else None
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
        pg_options=options if backend == "gloo" else None,
    )
    return _control_group(options)


def _control_group(options: Any = None) -> Any:
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT, pg_options=options)


def _on_rank(engine_config: EngineConfig, local_rank: int) -> EngineConfig:
    """``engine_config`` with the device of one rank."""
    return replace(engine_config, device=_rank_device(engine_config.device, local_rank))


def _rank_device(device: str | None, local_rank: int) -> str:
    """The device of one rank: the CPU, or the rank's own GPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ValueError(f"tensor parallelism runs on cpu or cuda, not {device!r}")
    if dev.index is not None:
        raise ValueError(
            f"with tensor parallelism pass device='cuda', not {device!r}: each rank uses its own "
            "GPU (choose them with CUDA_VISIBLE_DEVICES)"
        )
    return f"cuda:{local_rank}"


# -- the model shard ------------------------------------------------------------------------


def build_shard(
    config: ModelConfig, weights: dict[str, Any], engine_config: EngineConfig, *, group: Any
) -> ModelRunner:
    """This rank's ModelRunner, with a KV-cache size all ranks agree on before it is allocated.

    Each rank sizes its cache from its own memory (on GPU after a warm-up); the block manager
    on rank 0 hands out block ids for every rank at once, so all take the smallest count.
    """
    runner = ModelRunner(config, weights, resolve_plan(config, engine_config), cache_group=group)
    _check_same_cache(runner, group)
    return runner


def _check_same_cache(runner: ModelRunner, group: Any) -> None:
    counts = torch.tensor([runner.num_blocks, -runner.num_blocks])
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=group)
    low, high = int(counts[0]), -int(counts[1])
    if low != high:
        raise TensorParallelError(
            f"ranks disagree on the KV cache size ({low} to {high} blocks); "
            "build_shard must size it"
        )


# -- the step channel ---------------------------------------------------------------------------
