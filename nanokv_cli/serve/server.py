"""The server's life: the listening socket, and ``serve``, which runs the engine thread and
uvicorn until a signal (or an engine failure) and writes the report."""

from __future__ import annotations

import functools
import signal
import socket
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..run.loop import EngineClock
from ..run.record import Run
from ..run.stats import write_json_atomic
from ..views.live import live_view
from .app import create_app
from .cache_stream import CacheRecorder, CacheStream
from .engine_loop import EngineLoop
from .limits import ServeLimits
from .metrics import Metrics
from .serving import ServerState
from .uvicorn_server import UvicornServer, uvicorn_config


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a taken port fails at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def server_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _commit_kv_cache(engine) -> None:
    """A server keeps its KV cache: commit it before listening (ModelRunner.commit_kv_cache),
    so RSS stays level under load (issue #27's "something other than the cache grows" was the
    cache being faulted in block by block). Tensor parallel: rank 0's shard."""
    runner = getattr(engine.executor, "runner", engine.executor)
    commit = getattr(runner, "commit_kv_cache", None)
    if commit is not None:
        commit()


def _cache_stream(llm, model_name: str, limits: ServeLimits) -> CacheStream:
    """The stream ``nanokv top`` watches, named by what a watcher needs to read it."""
    from ..version import __version__

    engine = llm.engine
    identity = {
        "model": model_name,
        "block_size": engine.block_size,
        "max_model_len": llm.max_model_len,
        "version": __version__,
    }
    recorder = CacheRecorder(engine.num_blocks)
    return CacheStream(recorder, identity, lambda: engine.clock, max_watchers=limits.max_watchers)


def _follow_engine(stream: CacheStream, engine, engine_loop: EngineLoop, server, stack) -> None:
    """The cache stream follows the engine from its first event (subscribed before the engine
    thread starts) and ends as the server shuts down: its watchers never end on their own,
    and uvicorn's shutdown would wait for them."""
    stack.callback(engine.events.subscribe(stream.recorder.listener))
    engine_loop.after_step = stream.recorder.step_ended
    server.on_start, server.on_shutdown = stream.start, stream.close


@dataclass
class ServeResult:
    exit_code: int
    report: dict[str, Any]
    interrupted: bool


def serve(
    llm,
    sock: socket.socket,
    *,
    model_name: str,
    default_max_tokens: int,
    api_key: str | None,
    config: dict[str, Any],
    record: Path | None = None,
    report: Path | None = None,
    live: bool = False,
    console=None,
    shutdown_timeout: float = 30.0,
    limits: ServeLimits | None = None,
    guard_metrics: bool = False,
    kv_events=None,  # a kv_events.KVEventsConfig: publish the cache's events for routers
) -> ServeResult:
    """Serve ``llm`` on ``sock`` until a signal (or an engine failure); write the report."""
    engine = llm.engine
    limits = limits or ServeLimits()
    _commit_kv_cache(engine)
    url = server_url(sock)
    config = {**config, "server": url, "served_model_name": model_name}
    with Run(
        engine,
        EngineClock(engine),
        config=config,
        latencies=report is not None,  # latency lists grow with every token: only for a report
        record=record,
        trace_source=url,
    ) as run:
        metrics = Metrics(
            model_name,
            engine.num_blocks,
            lambda: run.stats.last,
            cache_config=cache_config_labels(llm, engine),
            tier_medium=getattr(getattr(engine, "tier", None), "medium", None),
        )
        engine_loop = EngineLoop(engine, run, metrics)
        state = ServerState(
            llm,
            engine_loop,
            metrics,
            model_name=model_name,
            default_max_tokens=default_max_tokens,
            api_key=api_key,
            guard_metrics=guard_metrics,
        )
        app = create_app(state, limits)
        state.cache_stream = stream = _cache_stream(llm, model_name, limits)
        with ExitStack() as stack:
            stack.callback(engine.events.subscribe(metrics.residency))
            view = _enter_observers(stack, engine, url, live, console, kv_events)
            uconfig = uvicorn_config(app, limits, live=live, shutdown_timeout=shutdown_timeout)
            server = UvicornServer(uconfig, functools.partial(_on_signal, engine_loop))
            _follow_engine(stream, engine, engine_loop, server, stack)
            engine_loop.on_fatal = lambda: setattr(server, "should_exit", True)
            engine_loop.view = view
            key_note = " (API key required)" if api_key else ""
            banner = f"nanokv: serving {model_name} on {url}/v1{key_note}; Ctrl-C to stop"
            _serve_until_stopped(server, engine_loop, sock, banner)
        result, interrupted = _final_report(run, engine_loop, server)
    if report is not None:
        write_json_atomic(report, result)
    code = 1 if engine_loop.error is not None else (130 if interrupted else 0)
    return ServeResult(code, result, interrupted)


def cache_config_labels(llm, engine) -> dict[str, Any]:
    """``vllm:cache_config_info``'s labels, vLLM's names: what a router sizes its model of this
    cache by (the Gateway API Inference Extension and llm-d read block_size and
    num_gpu_blocks; num_gpu_blocks is the engine's cache on any device, as in vLLM's CPU
    back end)."""
    plan = getattr(getattr(llm, "model_runner", None), "plan", None)
    dtype = getattr(plan, "kv_cache_dtype", None)
    tier = getattr(engine, "tier", None)
    return {
        "block_size": engine.block_size,
        "num_gpu_blocks": engine.num_blocks,
        # vLLM's CPU offload blocks: a host tier's (a disk tier is no CPU memory).
        "num_cpu_blocks": tier.capacity_blocks if tier and tier.medium == "host" else 0,
        "cache_dtype": "auto" if dtype is None else str(dtype).removeprefix("torch."),
        "enable_prefix_caching": engine.config.enable_prefix_caching,
        "prefix_caching_hash_algo": "xxhash",
    }


def _enter_observers(stack: ExitStack, engine, url: str, live: bool, console, kv_events):
    """What watches the engine besides the clients, entered on ``stack``: the live view (returned,
    or None) and the KV-event publisher (closed, so flushed, once the engine thread has stopped).
    """
    view = None
    if live:
        view = stack.enter_context(live_view(engine, console, title=f"nanokv serve {url}"))
    if kv_events is not None:
        from ..kv_events import publish_kv_events, publishing_note

        publisher = stack.enter_context(publish_kv_events(engine, kv_events))
        print(publishing_note(publisher), file=sys.stderr, flush=True)
    return view


def _on_signal(engine_loop: EngineLoop, sig: int, again: bool) -> None:
    """SIGTERM drains (no more requests; those in flight finish); SIGINT or a second signal
    aborts those in flight too."""
    abort = sig == signal.SIGINT or again
    if abort:
        engine_loop.abort_reason = "the server was interrupted"
    engine_loop.stop(abort=abort)


def _serve_until_stopped(
    server: UvicornServer, engine_loop: EngineLoop, sock: socket.socket, banner: str
) -> None:
    """Start the engine thread, listen and serve; once uvicorn returns, stop the engine thread,
    aborting what is left."""
    engine_loop.start()
    sock.listen(2048)
    print(banner, file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine_loop.stop(abort=True)
        engine_loop.join(timeout=120)


def _final_report(run: Run, engine_loop: EngineLoop, server: UvicornServer):
    """The run's report, with how the server stopped; and whether it was interrupted."""
    interrupted = signal.SIGINT in server.signals
    stopped_by = signal.Signals(server.signals[0]).name if server.signals else None
    run.stats.undelivered(engine_loop.undelivered_tokens())
    result = run.report(
        rejected=engine_loop.rejected,
        interrupted=interrupted,
        stopped_by=stopped_by,
    )
    return result, interrupted
