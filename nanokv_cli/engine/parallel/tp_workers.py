"""Spawned worker ranks: their entry point (``_worker_main``) and rank 0's handle on them
(``_Workers``: start, watch, report a failure, stop)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..model.loader import load_model
from .tp_channel import StepReceiver, serve
from .tp_common import (
    _LOOPBACK,
    STARTUP_TIMEOUT,
    TensorParallelError,
    _init_group,
    _on_rank,
    _worker_error,
    build_shard,
)


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
        runner = build_shard(loaded.config, loaded.weights, engine_config, group=control)
        del loaded
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
