"""Tensor parallelism over ``torch.distributed``: rank 0 schedules and samples, workers follow.

One model is split over N processes (the layers in ``layers/`` shard themselves by reading the
rank and world size of the default process group). Rank 0 is the process that created the
``LLM``: it owns the scheduler, the block manager and the sampler, so events, the live view and
traces see one engine whatever N is. Each step it broadcasts a compact description of the step
to the workers over a gloo group, then every rank runs the same forward pass; the sharded
layers exchange activations with all-reduce (gloo on CPU, NCCL on CUDA with one GPU per rank).

The step message is a flat int64 tensor. Workers keep a mirror of every live sequence, so a
step carries only what changed: the tokens a worker has not seen yet (the whole prompt once,
then one token per decode step) and the block-table entries past the part it already holds,
plus each sequence's ``num_cached_tokens``/``num_scheduled_tokens`` and ``kv_copy``. Sampling
fields stay on rank 0, the only rank that samples. Small messages (most decode steps) fit in one fixed-size
broadcast; larger ones take a second.

Two ways to get the processes:

- ``LLM(model, tensor_parallel_size=N)`` in a process that is in no process group: rank 0
  starts N-1 workers with ``torch.multiprocessing`` (spawn). Each worker loads the model from
  the same path itself (nothing large goes through pipes) and keeps only its shard. The
  rendezvous store listens on a free port of 127.0.0.1 and gloo binds to loopback only.
  Scripts must guard the code that creates the LLM with ``if __name__ == "__main__":``, as
  spawned workers re-import the main module.

- Under ``torchrun`` (or any launcher that sets ``env://`` rendezvous: ``MASTER_ADDR``,
  ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), possibly over several nodes:
  nothing is spawned. If the process is already in an initialized process group, that group
  is used; otherwise the LLM initializes it from the environment (and destroys it at
  shutdown). Every rank runs the same program with ``tensor_parallel_size`` equal to the
  world size. On ranks > 0 the ``LLM(...)`` call serves rank 0 and returns only when rank 0
  shuts down (its ``rank`` attribute is then > 0 and it cannot generate)::

      # torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
      #          --rdzv-endpoint HOST:29500 generate.py
      from nanokv_cli import LLM, SamplingParams

      llm = LLM("path/to/model", tensor_parallel_size=8)
      if llm.rank == 0:
          print(llm.generate(["Hello"], SamplingParams(max_tokens=32))[0]["text"])
      llm.shutdown()  # rank 0: releases the workers; other ranks: nothing left to do

  Each process uses ``cuda:$LOCAL_RANK`` (NCCL), or the CPU (gloo); the model path must
  exist on every node. Rank 0's process is the one whose output and events matter.

Life cycle: ``TensorParallelExecutor.shutdown()`` (``LLM.shutdown()``), garbage collection and
interpreter exit (``weakref.finalize``) stop the workers and destroy the process groups, which
closes every port; nothing here uses shared memory. Workers ignore SIGINT (a Ctrl-C in a
terminal reaches the whole process group; rank 0 decides what happens). A spawned worker that
raises reports its error through the rendezvous store before exiting; one that dies closes
its sockets, which fails rank 0's next collective at once. Either way rank 0 raises
``TensorParallelError`` naming the rank, and stops the remaining workers. (Under torchrun the
launcher watches the ranks; rank 0 sees the collective's error.)
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..config import EngineConfig, ModelConfig
from ..model.loader import LoadedModel
from ..runner.model_runner import ModelRunner
from ..sequence import Sequence
from .tp_channel import StepReceiver, StepSender, serve
from .tp_common import (
    COLLECTIVE_TIMEOUT,
    STOP_GRACE,
    TensorParallelError,
    _control_group,
    _from_collective,
    _init_group,
    _on_rank,
    _worker_error,
    build_shard,
)
from .tp_workers import _Workers

__all__ = [
    "TensorParallelError",
    "TensorParallelExecutor",
    "check_shardable",
    "launch",
    "parallel_mode",
    "process_rank",
    "start_tensor_parallel",
]


def check_shardable(config: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise ValueError naming every dimension that does not split over the ranks."""
    dims = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{name} ({value})" for name, value in dims.items() if value % tensor_parallel_size]
    if bad:
        raise ValueError(
            f"cannot split this model over tensor_parallel_size={tensor_parallel_size}: "
            f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible by "
            f"{tensor_parallel_size}"
        )


def parallel_mode(tensor_parallel_size: int) -> Literal["single", "spawn", "join"]:
    """How an LLM with this size runs here: one process, spawned workers, or an existing group.

    Raises ValueError when the size cannot work in this process: not a positive integer, a
    tensor-parallel LLM of ours is still running (the layers read the one default group), or
    the process belongs to a group (e.g. under torchrun) of a different size.
    """
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
        raise ValueError(f"tensor_parallel_size must be an integer, got {tensor_parallel_size!r}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if not (dist.is_available() and dist.is_initialized()):
        if tensor_parallel_size == 1:
            return "single"
        launched = _launcher_world_size()
        if launched is None:
            return "spawn"
        if tensor_parallel_size != launched:
            raise ValueError(
                f"this process was launched as one of {launched} ranks (WORLD_SIZE, e.g. by "
                f"torchrun): pass tensor_parallel_size={launched}, not {tensor_parallel_size}"
            )
        return "join"
    if _Group.active is not None:
        raise ValueError(
            f"a tensor-parallel LLM over {dist.get_world_size()} ranks is still running in this "
            "process: call its shutdown() before creating another LLM"
        )
    world = dist.get_world_size()
    if world == 1 and tensor_parallel_size == 1:
        return "single"
    if tensor_parallel_size != world:
        raise ValueError(
            f"this process is rank {dist.get_rank()} of a torch.distributed group of {world} "
            f"processes (e.g. started by torchrun): pass tensor_parallel_size={world}, "
            f"not {tensor_parallel_size}"
        )
    return "join"


def process_rank() -> int:
    """This process's rank: in its process group, else as its launcher set it, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if _launcher_world_size() is not None:
        return int(os.environ["RANK"])
    return 0


def _launcher_world_size() -> int | None:
    """WORLD_SIZE when a launcher (torchrun, or by hand) set up ``env://`` rendezvous for us."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        world = int(env["WORLD_SIZE"])
    except ValueError:
        return None
    return world if world > 1 else None


# -- the model shard ----------------------------------------------------------------------------


# -- rank 0 -------------------------------------------------------------------------------------


class _Group:
    """What rank 0 must release: workers, process groups, the store. Shared with the finalizer."""

    active: _Group | None = None  # the group this process spawned and still runs

    def __init__(self, workers: _Workers | None, owns_default_group: bool) -> None:
        self.workers = workers
        self.owns_default_group = owns_default_group
        self.control: Any = None
        self.sender: StepSender | None = None
        self.broken = False
        self.closed = False

    def close(self) -> None:
        """Stop the workers (politely unless the group broke) and destroy the process groups."""
        if self.closed:
            return
        self.closed = True
        graceful = not self.broken and self.sender is not None
        try:
            if graceful:
                try:
                    self.sender.send_stop()
                except Exception:  # a worker already left: stop the rest the hard way
                    graceful = False
            if self.workers is not None:
                self.workers.stop(STOP_GRACE if graceful else 0.0)
        finally:
            self._destroy_groups()

    def _destroy_groups(self) -> None:
        control, self.control = self.control, None
        if self.sender is not None:  # its pending works hold the group too
            self.sender.group, self.sender._pending = None, []
        try:
            if not dist.is_initialized():
                return
            if self.owns_default_group:
                dist.destroy_process_group()  # the control group goes with it
            elif control is not None:
                dist.destroy_process_group(control)
        finally:
            if _Group.active is self:
                _Group.active = None


class TensorParallelExecutor:
    """Rank 0's executor: ``run(seqs) -> list[int]`` over all ranks, as LLMEngine expects.

    ``runner`` is rank 0's shard; ``num_blocks`` is the KV-cache size every rank agreed on.
    """

    def __init__(self, runner: ModelRunner, group: _Group) -> None:
        self.runner = runner
        self.tensor_parallel_size = dist.get_world_size()
        self._group = group
        self._sender = group.sender = StepSender(group.control)
        self._finalizer = weakref.finalize(self, group.close)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def port(self) -> int | None:
        """The rendezvous port on 127.0.0.1 (None under torchrun, whose store is not ours)."""
        return self._group.workers.port if self._group.workers is not None else None

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the spawned workers (empty under torchrun)."""
        return self._group.workers.pids if self._group.workers is not None else []

    def run(self, seqs: list[Sequence]) -> list[int]:
        """Run one step on every rank; rank 0 samples one token per sequence."""
        return self._step(seqs, self.runner.run)

    def run_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """float32 logits at each sequence's last scheduled position (computed on every rank)."""
        return self._step(seqs, self.runner.run_logits)

    def forget(self, seq_id: int) -> None:
        """The request is finished: drop its sampler state and the workers' mirror of it."""
        self.runner.forget(seq_id)
        self._sender.forget(seq_id)

    def shutdown(self) -> None:
        """Stop the workers and release the process groups; idempotent."""
        self._finalizer()

    def _step(self, seqs: list[Sequence], compute: Any) -> Any:
        self._check_usable()
        try:
            self._sender.send_step(seqs)
            result = compute(seqs)
            self._sender.wait()
            return result
        except BaseException as exc:
            self._fail(exc)

    def _check_usable(self) -> None:
        group = self._group
        if group.closed:
            raise TensorParallelError("this tensor-parallel LLM was shut down")
        if group.broken:
            raise TensorParallelError("the tensor-parallel group failed earlier: create a new LLM")
        if group.workers is not None:
            try:
                group.workers.raise_if_failed()
            except TensorParallelError:
                group.broken = True
                self.shutdown()
                raise

    def _fail(self, exc: BaseException) -> None:
        """The ranks may now be out of step: report a failed worker, stop them all, re-raise."""
        group = self._group
        group.broken = True
        message = None
        # Collective errors are RuntimeErrors; anything else (a bug on rank 0, Ctrl-C) is
        # rank 0's own and is re-raised as is.
        if group.workers is not None and _from_collective(exc):
            message = group.workers.failure(wait=2.0)
        self.shutdown()
        if message is None:
            raise exc
        raise _worker_error(message) from exc


def start_tensor_parallel(
    loaded: LoadedModel, engine_config: EngineConfig
) -> TensorParallelExecutor | None:
    """Bring up ``engine_config.tensor_parallel_size`` ranks for ``loaded`` and return rank 0's
    executor.

    In spawn mode workers load the model from ``loaded.source`` themselves, and get ``engine_config`` (pickled) with their own device. Under an
    existing process group (torchrun), ranks > 0 serve rank 0 here and return None once rank 0
    shuts down.
    """
    size = engine_config.tensor_parallel_size
    check_shardable(loaded.config, size)
    mode = parallel_mode(size)
    if mode == "join":
        return _join(loaded, engine_config)
    if mode != "spawn":
        raise ValueError(f"tensor_parallel_size={size} needs no workers")
    return _spawn(loaded, engine_config)


def launch(
    config: ModelConfig, weights: dict[str, Any], model_path: str, engine_config: EngineConfig
) -> TensorParallelExecutor:
    """Spawn-mode start from parts: rank 0 uses ``weights``, workers load ``model_path``."""
    size = engine_config.tensor_parallel_size
    check_shardable(config, size)
    if parallel_mode(size) != "spawn":
        raise ValueError("launch() starts its own workers: this process is already in a group")
    return _launch(config, weights, model_path, engine_config)


def _spawn(loaded: LoadedModel, engine_config: EngineConfig) -> TensorParallelExecutor:
    model_path = loaded.source
    return _launch(loaded.config, loaded.weights, model_path, engine_config)


def _launch(
    config: ModelConfig, weights: dict[str, Any], model_path: str, engine_config: EngineConfig
) -> TensorParallelExecutor:
    world = engine_config.tensor_parallel_size
    rank_config = _on_rank(engine_config, 0)
    backend = "nccl" if rank_config.device.startswith("cuda") else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world:  # pragma: no cover - GPU
        raise ValueError(
            f"tensor_parallel_size={world} needs {world} GPUs, found {torch.cuda.device_count()}"
        )
    workers = _Workers(backend, str(model_path), engine_config)
    group = _Group(workers, owns_default_group=True)
    try:
        workers.wait_joined()
        group.control = _init_group(backend, 0, world, workers.store, loopback=True)
        _Group.active = group
        workers.watch()
        dist.barrier(group=group.control)  # every worker has its weights
        runner = build_shard(config, weights, rank_config, group=group.control)
        return TensorParallelExecutor(runner, group)
    except BaseException as exc:
        group.broken = True
        message = workers.failure(wait=2.0) if _from_collective(exc) else None
        group.close()
        if message is None:
            raise
        raise _worker_error(message) from exc


def _join(loaded: LoadedModel, engine_config: EngineConfig) -> TensorParallelExecutor | None:
    """Run as one rank of a group made by a launcher; set it up from ``env://`` if needed."""
    owns = not dist.is_initialized()
    rank = process_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    rank_config = _on_rank(engine_config, local_rank)
    device = rank_config.device
    if device.startswith("cuda"):  # pragma: no cover - GPU
        torch.cuda.set_device(torch.device(device))
    if owns:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method="env://", timeout=COLLECTIVE_TIMEOUT)
    group = _Group(None, owns_default_group=owns)
    _Group.active = group
    try:
        group.control = _control_group()
        dist.barrier(group=group.control)
        runner = build_shard(loaded.config, loaded.weights, rank_config, group=group.control)
    except BaseException:
        group.close()
        raise
    if rank == 0:
        return TensorParallelExecutor(runner, group)
    try:
        serve(runner, StepReceiver(group.control, runner.block_size))
    finally:
        group.close()
    return None
