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
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from array import array
from collections.abc import Iterable
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from .config import EngineConfig, ModelConfig
from .loader import LoadedModel, load_model
from .model_runner import ModelRunner
from .sequence import Sequence

__all__ = [
    "TensorParallelError",
    "TensorParallelExecutor",
    "check_shardable",
    "launch",
    "parallel_mode",
    "process_rank",
    "start_tensor_parallel",
]

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


class ShardRunner(ModelRunner):
    """A ModelRunner whose KV-cache size is agreed by all ranks before the cache is allocated.

    Each rank sizes its cache from its own memory (on GPU after a warm-up); the block manager
    on rank 0 hands out block ids for every rank at once, so all take the smallest count.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Any],
        engine_config: EngineConfig,
        *,
        group: Any,
    ) -> None:
        self._agree_group = group
        super().__init__(config, weights, engine_config)
        del self._agree_group  # a reference would keep the group's sockets open after shutdown

    def _resolve_num_blocks(self) -> int:
        count = torch.tensor([super()._resolve_num_blocks()])
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self._agree_group)
        return int(count)


def _check_same_cache(runner: ModelRunner, group: Any) -> None:
    counts = torch.tensor([runner.num_blocks, -runner.num_blocks])
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=group)
    low, high = int(counts[0]), -int(counts[1])
    if low != high:
        raise TensorParallelError(
            f"ranks disagree on the KV cache size ({low} to {high} blocks); "
            "ShardRunner must size it"
        )


# -- the step channel ---------------------------------------------------------------------------


def _broadcast_message(values: array, group: Any) -> list[Any]:
    """Start broadcasting ``values`` from rank 0; returns the pending works and their buffers."""
    if len(values) < HEADER_INTS:
        values.frombytes(bytes(values.itemsize * (HEADER_INTS - len(values))))
    # An int64 array converts to a tensor without a per-element loop (torch.tensor(list) has one).
    message = torch.frombuffer(values, dtype=torch.int64)
    head = message[:HEADER_INTS]
    pending = [(dist.broadcast(head, 0, group=group, async_op=True), values)]
    if len(message) > HEADER_INTS:
        rest = message[HEADER_INTS:]
        pending.append((dist.broadcast(rest, 0, group=group, async_op=True), values))
    return pending


def _receive_message(group: Any) -> list[int]:
    head = torch.empty(HEADER_INTS, dtype=torch.int64)
    dist.broadcast(head, 0, group=group)
    length = 2 + int(head[1])
    if length <= HEADER_INTS:
        return head[:length].tolist()
    rest = torch.empty(length - HEADER_INTS, dtype=torch.int64)
    dist.broadcast(rest, 0, group=group)
    return head.tolist() + rest.tolist()


class StepSender:
    """Rank 0's side: describes each step by what the workers' mirrors lack."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._sent_tokens: dict[int, int] = {}  # seq_id -> tokens the workers hold
        self._sent_tables: dict[int, list[int]] = {}  # seq_id -> block table the workers hold
        self._forgotten: list[int] = []
        self._pending: list[Any] = []

    def forget(self, seq_id: int) -> None:
        if self._sent_tokens.pop(seq_id, None) is not None:
            self._forgotten.append(seq_id)
        self._sent_tables.pop(seq_id, None)

    def send_step(self, seqs: Iterable[Sequence]) -> None:
        self.wait()
        values = array("q", [_STEP, 0, len(self._forgotten), *self._forgotten])
        self._forgotten = []
        seqs = list(seqs)
        values.append(len(seqs))
        sent_tokens, sent_tables = self._sent_tokens, self._sent_tables
        for s in seqs:
            seq_id, cached, n = s.seq_id, s.num_cached_tokens, s.num_scheduled_tokens
            end = cached + n
            have = sent_tokens.get(seq_id, 0)
            tokens = s.token_ids[have:end] if end > have else ()
            if end > have:
                sent_tokens[seq_id] = end
            table = s.block_table
            held = sent_tables.get(seq_id)
            if held is not None and table[: len(held)] == held:
                keep = len(held)
                held += table[keep:]
            else:  # new, or preempted and given other blocks: resend it whole
                keep = 0
                sent_tables[seq_id] = list(table)
            copy = s.kv_copy or (-1, -1, 0)  # a token-granular hit's K/V, copied on every rank
            values.extend(
                (seq_id, cached, n, int(s.is_prefill), len(tokens), keep, len(table) - keep, *copy)
            )
            values.extend(tokens)
            values.extend(table[keep:])
        values[1] = len(values) - 2
        self._pending = _broadcast_message(values, self.group)

    def send_stop(self) -> None:
        self.wait()
        self._pending = _broadcast_message(array("q", [_STOP, 0]), self.group)
        self.wait()

    def wait(self) -> None:
        """Block until the last message has left (raises if a worker went away)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()


class StepReceiver:
    """A worker's side: rebuilds rank 0's sequences from the messages into local mirrors."""

    def __init__(self, group: Any, block_size: int) -> None:
        self.group = group
        self.block_size = block_size
        self.mirrors: dict[int, Sequence] = {}

    def receive(self) -> list[Sequence] | None:
        """The next step's sequences, or None when rank 0 says stop."""
        values = _receive_message(self.group)
        if values[0] == _STOP:
            return None
        num_forgotten = values[2]
        for seq_id in values[3 : 3 + num_forgotten]:
            self.mirrors.pop(seq_id, None)
        i = 3 + num_forgotten
        num_seqs = values[i]
        i += 1
        seqs = []
        for _ in range(num_seqs):
            seq_id, cached, n, prefill, num_tokens, keep, num_blocks, *copy = values[
                i : i + _RECORD
            ]
            i += _RECORD
            seq = self.mirrors.get(seq_id)
            if seq is None:
                seq = Sequence([], block_size=self.block_size)
                seq.seq_id = seq_id
                self.mirrors[seq_id] = seq
            if num_tokens:
                seq.token_ids += values[i : i + num_tokens]
                seq.num_tokens = len(seq.token_ids)
                seq.last_token = seq.token_ids[-1]
                i += num_tokens
            del seq.block_table[keep:]
            seq.block_table += values[i : i + num_blocks]
            i += num_blocks
            seq.num_cached_tokens, seq.num_scheduled_tokens = cached, n
            seq.is_prefill = bool(prefill)
            seq.kv_copy = tuple(copy) if copy[2] else None
            seqs.append(seq)
        return seqs


def serve(runner: ModelRunner, receiver: StepReceiver) -> None:
    """A worker's loop: run every step rank 0 announces, until it says stop."""
    while (seqs := receiver.receive()) is not None:
        runner.run(seqs)


# -- worker processes (spawn mode) --------------------------------------------------------------


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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _worker_main(
    rank: int,
    world: int,
    port: int,
    backend: str,
    model_path: str,
    engine_config: EngineConfig,
    num_threads: int,
) -> None:
    """Entry point of a spawned worker rank; ``engine_config`` names this rank's device."""
    # Ctrl-C in a terminal reaches every process of the foreground group; rank 0 decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    store = dist.TCPStore(_LOOPBACK, port, world, is_master=False, timeout=STARTUP_TIMEOUT)
    try:
        store.set(f"nanokv/joined/{rank}", "1")
        if engine_config.device.startswith("cuda"):  # pragma: no cover - GPU
            torch.cuda.set_device(torch.device(engine_config.device))
        control = _init_group(backend, rank, world, store, loopback=True)
        loaded = load_model(model_path)
        dist.barrier(group=control)  # start building together: the build has collectives
        runner = ShardRunner(loaded.config, loaded.weights, engine_config, group=control)
        del loaded
        _check_same_cache(runner, control)
        serve(runner, StepReceiver(control, runner.block_size))
    except BaseException as exc:
        try:  # rank 0 raises it; if rank 0 is gone, there is nobody left to tell
            report = _describe(exc) + "\n" + "".join(traceback.format_exception(exc))
            store.set(f"nanokv/error/{rank}", report)
        except Exception:
            pass
        os._exit(1)  # skip interpreter teardown: a broken gloo group can block in it
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing left to clean up; torch's teardown would only delay rank 0's join


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Workers:
    """The spawned worker processes (ranks 1..N-1) and the rendezvous store rank 0 serves."""

    def __init__(self, backend: str, model_path: str, engine_config: EngineConfig) -> None:
        self.world = world = engine_config.tensor_parallel_size
        self.backend = backend
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((_LOOPBACK, 0))  # a free port, picked by the kernel, on loopback only
        listener.listen(world * 4)
        self.port = listener.getsockname()[1]
        # The store takes ownership of the socket: no window for another process to take the
        # port between choosing it and listening on it.
        self.store = dist.TCPStore(
            _LOOPBACK,
            self.port,
            world,
            is_master=True,
            timeout=STARTUP_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // world))
        context = torch.multiprocessing.get_context("spawn")
        self.procs = []
        self._stopping = False
        self._watcher: threading.Thread | None = None
        try:
            for rank in range(1, world):
                rank_config = _on_rank(engine_config, rank)
                proc = context.Process(
                    target=_worker_main,
                    args=(rank, world, self.port, backend, model_path, rank_config, threads),
                    name=f"nanokv-tp-rank{rank}",
                    daemon=True,  # multiprocessing's exit hook terminates them as a last resort
                )
                proc.start()
                self.procs.append(proc)
        except BaseException:
            self.stop(0.0)
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_joined(self) -> None:
        """Wait until every worker reached the store, watching that none died on the way."""
        keys = [f"nanokv/joined/{rank}" for rank in range(1, self.world)]
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        while not self.store.check(keys):
            self.raise_if_failed(startup=True)
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel workers did not start within {STARTUP_TIMEOUT}"
                )
            time.sleep(0.02)

    def all_alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def failure(self, wait: float = 0.0) -> str | None:
        """What went wrong with the first failed worker, or None if all look fine.

        A worker that raised reports through the store before it exits; ``wait`` gives one
        that is on its way out (its sockets already closed) the time to report or be reaped.
        """
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                report = self._report(rank)
                if report is not None:
                    return f"tensor-parallel worker rank {rank} failed: {report}"
                if not proc.is_alive():
                    report = self._report(rank)  # it may have reported just before exiting
                    if report is not None:
                        return f"tensor-parallel worker rank {rank} failed: {report}"
                    return f"tensor-parallel worker rank {rank} {_exit_reason(proc.exitcode)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _report(self, rank: int) -> str | None:
        key = f"nanokv/error/{rank}"
        try:
            if self.store.check([key]):
                return self.store.get(key).decode(errors="replace")
        except RuntimeError:
            pass
        return None

    def raise_if_failed(self, startup: bool = False) -> None:
        if self.all_alive() and not startup:
            return
        message = self.failure()
        if message is None:
            return
        if startup and "failed:" not in message:
            message += (
                " while starting (in a script, create the LLM under "
                "`if __name__ == '__main__':`: spawned workers re-import the main module)"
            )
        raise _worker_error(message)

    def watch(self) -> None:  # pragma: no cover - GPU (NCCL)
        """Abort NCCL's pending collectives when a worker dies, so rank 0 fails instead of hanging.

        gloo needs no help: a dead peer's closed sockets fail its collectives at once.
        """
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if self.backend != "nccl" or abort is None:
            return

        def run() -> None:
            from multiprocessing.connection import wait

            wait([p.sentinel for p in self.procs])
            if not self._stopping:
                abort()

        self._watcher = threading.Thread(target=run, name="nanokv-tp-watch", daemon=True)
        self._watcher.start()

    def stop(self, grace: float) -> None:
        """Let workers leave within ``grace`` seconds, then terminate, then kill them."""
        self._stopping = True
        deadline = time.monotonic() + grace
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for proc in self.procs:
            proc.close()
        self.procs = []
        self.store = None  # closes the listening port


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
        runner = _build(config, weights, rank_config, group)
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
        runner = _build(loaded.config, loaded.weights, rank_config, group)
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


def _build(
    config: ModelConfig, weights: dict[str, Any], engine_config: EngineConfig, group: _Group
) -> ModelRunner:
    runner = ShardRunner(config, weights, engine_config, group=group.control)
    _check_same_cache(runner, group.control)
    return runner
