"""``nanokv serve``: the OpenAI HTTP API over one engine loop.

Threads and ownership:

* the **engine thread** (``EngineLoop``) owns the engine. It iterates ``Driver.run`` over a
  ``RequestQueue``: every client's requests are admitted as they arrive and batched
  continuously, and each step's new tokens go back to the event loop in one
  ``call_soon_threadsafe``. Nothing else touches the engine;
* the **event loop** (uvicorn, the main thread) runs the HTTP handlers. A handler validates
  the body, encodes the prompt, submits the request and waits for the engine's answer
  (admitted, or refused up front with a 400), then streams the tokens it is sent
  (server-sent events) or collects them. A task per request waits for the client to go away;
  if it does, the request is aborted in the engine, whose blocks are freed at once.

``/metrics`` reads the engine's counters from the last step snapshot (the same
``report.cache_numbers`` names every view uses), and histograms the engine thread fills.
``GET /v1/nanokv/events`` streams the block map and those counters to ``nanokv top``
(``cache_stream.py``: the engine thread only queues its events).
SIGTERM stops accepting and lets in-flight requests finish (up to ``shutdown_timeout``);
SIGINT (or a second signal) aborts them. Either way the trace and report are written.

Connections are bounded (``ServeLimits``): requests in flight (a stream counts until it ends),
open connections, and how long a client may take over its headers, its body, or idle between
requests. Bodies are refused before they are parsed when too large or too deeply nested.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import json
import logging
import math
import re
import resource
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as prometheus_text
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .cache_stream import EVENTS_PATH, CacheRecorder, CacheStream, WatcherLimit
from .driver import Driver, QueueClosed, Request, RequestQueue, Run
from .engine.block_manager import MISS_REASONS
from .engine.sampling_params import SamplingParams
from .engine.tokenizer import IncrementalDecoder, TokenizerError
from .report import cache_numbers

MAX_BODY_BYTES = 1 << 20  # larger bodies get a 413
_DRAIN_BODY_BYTES = 16 << 20  # read (and drop) this much of a too-large body before the 413
MAX_STOP_STRINGS = 16
# Deeper bodies get a 400 before they are parsed (Python's json and pydantic recurse per level);
# an OpenAI request nests about 5 deep.
MAX_JSON_DEPTH = 64
_PROBES = ("/health", "/metrics")  # never refused for load: monitoring must see an overload


# -- limits ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeLimits:
    """How much a server takes on, and how long it waits for a client (seconds)."""

    limit_concurrency: int = 512  # requests in flight (streams count until they end): then 503
    limit_connections: int | None = None  # open connections; None: 3/4 of the open-files limit
    timeout_keep_alive: float = 5.0  # idle between two requests on one connection (uvicorn's)
    timeout_header: float = 10.0  # from a request's first byte (or the connection's) to its headers
    timeout_body: float = 30.0  # from the headers to the body's last byte
    max_watchers: int = 16  # cache-stream watchers (nanokv top): then 503

    def max_connections(self) -> int:
        if self.limit_connections is not None:
            return self.limit_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        # The rest of the descriptors stay for the model's files, logs, the trace and /health.
        return 3 * soft // 4 if soft != resource.RLIM_INFINITY else 1 << 16


# -- errors ------------------------------------------------------------------------------------


class ApiError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class _ClientGone(Exception):
    """The client disconnected; its request has been aborted."""


_log = logging.getLogger("uvicorn.error")  # uvicorn's handlers: the server's log, its format


# -- request bodies ----------------------------------------------------------------------------


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Body(BaseModel):
    # Strict: "5" is not a number and 1.5 is not an integer (OpenAI's API answers 400 too).
    # Fields nanokv does not know are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = 1


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None


class ChatBody(_Body):
    messages: Annotated[list[_Message], Field(min_length=1)]
    max_completion_tokens: int | None = None


# Options of OpenAI's API that nanokv does not implement: refused unless left at their default.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "prompt_logprobs": (None, 0),
}


def _is_type_tag(x: Any) -> bool:
    """A union member's name in a pydantic error location ('str', 'list[int]', '_TextPart')."""
    return isinstance(x, str) and (
        x in ("str", "int", "float", "bool", "list", "dict")
        or "[" in x
        or x[:1].isupper()
        or x.startswith("_")
    )


def _validate(model: type[BaseModel], body: dict[str, Any]):
    for name, defaults in _UNSUPPORTED.items():
        if name in body and not any(
            body[name] == d and type(body[name]) is type(d) for d in defaults
        ):
            raise ApiError(400, f"'{name}' is not supported by nanokv", param=name)
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"] if not _is_type_tag(x)) or None
        where = f"'{param}': " if param else ""
        raise ApiError(400, f"{where}{err['msg']}", param=param) from None
    if parsed.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    return parsed


# -- the engine side ---------------------------------------------------------------------------


@dataclass
class ServeRequest(Request):
    """An HTTP request on its way through the engine; ``stream`` receives what it produces."""

    stream: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    ended_by: str | None = None  # "stop": the handler found a stop string and let it go


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class EngineLoop:
    """The thread that owns the engine: admits, steps and aborts; sends tokens back.

    Items sent to a request's stream, in order: ``("added", seq_id)`` or ``("rejected",
    message)``; then one ``(token_ids, finished, finish_reason, num_prompt_tokens,
    num_cached_tokens)`` per step that gave it tokens; or ``("aborted", message)`` when the
    server aborts it, ``("failed", message)`` if the engine broke.
    """

    def __init__(self, engine, run: Run, metrics: Metrics, *, on_fatal=None) -> None:
        self.engine = engine
        self.run = run
        self.metrics = metrics
        self.queue = RequestQueue()
        self.view = None  # the live view, ticked once per step
        self.after_step: Callable[[], None] | None = None  # the cache stream's, once per step
        self.on_fatal = on_fatal
        self.error: BaseException | None = None
        self.rejected = 0
        self.abort_reason = "the server is shutting down"
        self.driver = Driver(
            engine,
            run.clock,
            max_waiting=math.inf,  # admit at once: a request that can never fit is refused now
            on_added=self._added,
            on_rejected=self._rejected,
            on_aborted=self._aborted,
        )
        self.thread = threading.Thread(target=self._main, name="nanokv-engine", daemon=True)

    # Called from any thread.
    def start(self) -> None:
        self.thread.start()

    def submit(self, req: ServeRequest) -> None:
        self.queue.submit(req)

    def abort(self, req: ServeRequest) -> None:
        self.queue.abort(req)

    def stop(self, *, abort: bool) -> None:
        """Accept no more requests; with ``abort``, drop the ones in flight too."""
        if abort:
            self.queue.abort(None)
        self.queue.close()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    # The engine thread.
    def _post(self, req: ServeRequest, item: Any) -> None:
        try:
            req.loop.call_soon_threadsafe(req.stream.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def _added(self, seq_id: int, req: ServeRequest) -> None:
        self._post(req, ("added", seq_id))

    def _rejected(self, req: ServeRequest, error: Exception) -> None:
        self.rejected += 1
        self.metrics.rejected.inc()
        self._post(req, ("rejected", str(error)))

    def _aborted(self, seq_id: int, req: ServeRequest) -> None:
        self.metrics.ended(seq_id, req.ended_by or "abort")
        if req.ended_by is None:
            self._post(req, ("aborted", self.abort_reason))

    def _main(self) -> None:
        engine, run, metrics, driver = self.engine, self.run, self.metrics, self.driver
        requests = driver.requests
        try:
            for outputs in driver.run(self.queue):
                run.observe(outputs)
                if outputs:
                    metrics.observe(outputs, engine.clock)
                    batches: dict[Any, list] = {}
                    for out in outputs:
                        req = requests[out.seq_id]
                        item = (
                            out.new_token_ids,  # a new list every step: safe to hand over
                            out.finished,
                            out.finish_reason,
                            out.num_prompt_tokens,
                            out.num_cached_tokens,
                        )
                        batches.setdefault(req.loop, []).append((req.stream, item))
                    for loop, items in batches.items():
                        try:
                            loop.call_soon_threadsafe(_deliver, items)
                        except RuntimeError:
                            pass
                if self.view is not None:
                    self.view.tick()
                if self.after_step is not None:
                    self.after_step()
        except BaseException as e:  # a bug or a broken executor: fail every request, stop
            self.error = e
            traceback.print_exc()
            self.queue.close()
            message = "the engine failed; the server's log has the details"
            for req in list(requests.values()):
                self._post(req, ("failed", message))
            while (item := self.queue.poll(0.0)) is not None:
                if isinstance(item, tuple):
                    self._post(item[0], ("failed", message))
            if self.on_fatal is not None:
                self.on_fatal()


# -- metrics -----------------------------------------------------------------------------------

# Buckets as vLLM's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

# report.cache_numbers() name -> (metric name, help). vLLM's names where the meaning is the same.
CACHE_COUNTERS = {
    "cache_queries": (
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache (first admissions).",
    ),
    "cache_hits": ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "preemptions": ("vllm:num_preemptions", "Sequences preempted (recomputed)."),
    "shared_hit_tokens": (
        "nanokv:prefix_cache_shared_hits",
        "Hit tokens whose block was in use by another sequence (ref count grew).",
    ),
    "revived_hit_tokens": (
        "nanokv:prefix_cache_revived_hits",
        "Hit tokens whose block was free but still cached (taken back from the free queue).",
    ),
    "copied_hit_tokens": (
        "nanokv:prefix_cache_copied_hits",
        "Hit tokens whose K/V were copied from a cached block sharing their leading tokens.",
    ),
    "evictions": ("nanokv:prefix_cache_evictions", "Cached blocks whose hash was evicted."),
    "readmission_queries": (
        "nanokv:prefix_cache_readmission_queries",
        "Tokens looked up again after a preemption (not in the hit rate).",
    ),
    "readmission_hits": (
        "nanokv:prefix_cache_readmission_hits",
        "Re-admission tokens served from the cache.",
    ),
}


class Metrics:
    """Prometheus metrics of one server: counters and gauges read from the engine's last step
    snapshot at scrape time, token counters and latency histograms fed by the engine thread."""

    def __init__(self, model_name: str, num_blocks: int, snapshot: Callable[[], Any]) -> None:
        self.model_name = model_name
        self.num_blocks = num_blocks
        self.snapshot = snapshot
        self.registry = CollectorRegistry(auto_describe=True)
        reg, label = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of started requests.", label, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", label, registry=reg
        ).labels(model_name)
        self.request_success = Counter(
            "vllm:request_success",
            "Requests that ended, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.rejected = Counter(
            "nanokv:requests_rejected",
            "Requests refused up front (could never fit the model length or the cache).",
            label,
            registry=reg,
        ).labels(model_name)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            label,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two tokens of a request.",
            label,
            buckets=_ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            label,
            buckets=_E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)
        reg.register(self)
        self._last_token: dict[int, float] = {}

    def observe(self, outputs, now: float) -> None:
        """One step's outputs (engine thread)."""
        last = self._last_token
        generated = prompt = 0
        for out in outputs:
            generated += len(out.new_token_ids)
            prev = last.get(out.seq_id)
            if prev is None:
                prompt += out.num_prompt_tokens
                self.ttft.observe(out.first_token_time - out.arrival_time)
            else:
                self.itl.observe(now - prev)
            if out.finished:
                last.pop(out.seq_id, None)
                self.e2e.observe(now - out.arrival_time)
                self.request_success.labels(self.model_name, out.finish_reason).inc()
            else:
                last[out.seq_id] = now
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)

    def ended(self, seq_id: int, reason: str) -> None:
        """A request aborted before it finished (``reason``: abort, or stop for stop strings)."""
        self._last_token.pop(seq_id, None)
        self.request_success.labels(self.model_name, reason).inc()

    def collect(self):
        """The engine's own numbers, from its last step snapshot (a collector for the registry)."""
        snap = self.snapshot()
        numbers = cache_numbers(snap)
        name = [self.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        used = snap.num_used_blocks if snap else 0
        cached = snap.num_cached_free_blocks if snap else 0
        free = snap.num_free_blocks - cached if snap else self.num_blocks
        yield gauge(
            "vllm:num_requests_running", "Requests running.", snap.num_running if snap else 0
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Requests waiting (including those mid-prefill).",
            snap.num_waiting if snap else 0,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks in use by sequences (1 = full); cached free blocks count "
            "as free.",
            used / self.num_blocks if self.num_blocks else 0.0,
        )
        blocks = GaugeMetricFamily(
            "nanokv:kv_cache_blocks",
            "KV blocks by state: used (ref count > 0), cached (free, hash kept), free (clean).",
            labels=["model_name", "state"],
        )
        for state, n in (("used", used), ("cached", cached), ("free", free)):
            blocks.add_metric([self.model_name, state], n)
        yield blocks
        for key, (metric, doc) in CACHE_COUNTERS.items():
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, numbers[key])
            yield c
        misses = CounterMetricFamily(
            "nanokv:prefix_cache_miss_tokens",
            "Prompt tokens that missed the prefix cache, by reason of the first missed block.",
            labels=["model_name", "reason"],
        )
        for reason in MISS_REASONS:
            misses.add_metric([self.model_name, reason], numbers["miss_tokens"].get(reason, 0))
        yield misses

    def text(self) -> bytes:
        return prometheus_text(self.registry)


# -- generation, as a handler sees it ----------------------------------------------------------


class _StopMatcher:
    """Cuts generated text at the first stop string; holds back text that may begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max(map(len, stops)) - 1 if stops else 0
        self.buf = ""

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """The text that is safe to emit, and whether a stop string was found."""
        if not self.stops:
            return text, False
        buf = self.buf + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i != -1]
        if hits:
            self.buf = ""
            return buf[: min(hits)], True
        cut = len(buf) if final else max(0, len(buf) - self.hold)
        self.buf = buf[cut:]
        return buf[:cut], False


class _Generation:
    """One request's tokens as they come back from the engine thread, turned into text."""

    def __init__(
        self, state: ServerState, req: ServeRequest, stops: list[str], incremental: bool
    ) -> None:
        self.state = state
        self.req = req
        # Text as it comes (streaming, stop strings), or decoded once at the end.
        self.decoder = IncrementalDecoder(state.tokenizer) if incremental else None
        self.token_ids: list[int] = []
        self.matcher = _StopMatcher(stops)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        self.done = False  # nothing left to abort in the engine
        self.gone = False

    def client_gone(self) -> None:
        if self.gone:
            return
        self.gone = True
        self.release()
        self.req.stream.put_nowait(("gone", None))

    def release(self) -> None:
        """Abort the request in the engine unless it is over."""
        if not self.done:
            self.done = True
            self.state.engine_loop.abort(self.req)

    def _end(self, item: tuple) -> None:
        kind, message = item
        self.done = True
        if kind == "gone":
            raise _ClientGone()
        if kind == "rejected":
            raise ApiError(400, message, code="context_length_exceeded")
        if kind == "aborted":
            raise ApiError(503, f"request aborted: {message}", type="server_error")
        raise ApiError(500, message, type="server_error")

    async def admitted(self) -> None:
        item = await self.req.stream.get()
        if item[0] != "added":
            self._end(item)

    async def pieces(self) -> AsyncIterator[str]:
        """Text as it is generated; ``finish_reason`` is set when it ends."""
        queue = self.req.stream
        decoder = self.decoder
        while True:
            items = [await queue.get()]
            while not queue.empty():  # the client is behind: send what came as one piece
                items.append(queue.get_nowait())
            text: list[str] = []
            finished = False
            for item in items:
                if len(item) == 2:
                    self._end(item)
                token_ids, finished, reason, _, cached = item
                if not self.num_completion_tokens:
                    self.num_cached_tokens = cached
                self.num_completion_tokens += len(token_ids)
                if decoder is not None:
                    text.extend(decoder.add(t) for t in token_ids)
                    if finished:
                        text.append(decoder.flush())
                else:
                    self.token_ids.extend(token_ids)
                    if finished:
                        text.append(self.state.tokenizer.decode(self.token_ids))
                if finished:
                    self.finish_reason = reason
                    self.done = True
                    break
            piece, stopped = self.matcher.feed("".join(text), final=finished)
            if stopped:
                self.finish_reason = self.req.ended_by = "stop"
                self.release()
                yield piece
                return
            if piece or finished:
                yield piece
            if finished:
                return

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


async def _watch_disconnect(request: HttpRequest, on_gone: Callable[[], None]) -> None:
    """Call ``on_gone`` when the client disconnects (or the response is complete)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        pass
    on_gone()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# -- the HTTP application ----------------------------------------------------------------------


class ServerState:
    """What the handlers share: the model's tokenizer and limits, the engine loop, metrics."""

    def __init__(
        self,
        llm,
        engine_loop: EngineLoop,
        metrics: Metrics,
        *,
        model_name: str,
        default_max_tokens: int,
        api_key: str | None,
        guard_metrics: bool = False,
    ) -> None:
        self.tokenizer = llm.tokenizer
        self.chat_prompt = llm.chat_prompt
        self.vocab_size = llm.config.vocab_size
        self.max_model_len = llm.max_model_len
        self.model_path = llm.model_path
        self.engine_loop = engine_loop
        self.metrics = metrics
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.api_key = api_key
        self.guard_metrics = guard_metrics
        self.created = int(time.time())
        self.cache_stream: CacheStream | None = None  # GET /v1/nanokv/events, set by serve()

    # -- checks ----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def prompt_tokens(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            try:
                return self.tokenizer.encode(prompt, max_tokens=self.max_model_len)
            except TokenizerError as e:  # longer than the model can take, or not Unicode
                raise ApiError(400, str(e), param="prompt") from None
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"token id {bad[0]} is out of range (the vocabulary has {self.vocab_size})",
                param="prompt",
            )
        return list(prompt)

    def chat_tokens(self, messages: list[_Message]) -> list[int]:
        rendered = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                if any(part.type != "text" or part.text is None for part in content):
                    raise ApiError(
                        400, "only text content parts are supported", param=f"messages.{i}"
                    )
                content = "".join(part.text for part in content)
            role = "system" if m.role == "developer" else m.role
            rendered.append({"role": role, "content": content or ""})
        try:
            return self.chat_prompt(rendered)
        except TokenizerError as e:
            raise ApiError(400, f"chat template: {e}", param="messages") from None

    def sampling(
        self, body: _Body, max_tokens: int | None, num_prompt_tokens: int
    ) -> tuple[SamplingParams, list[str]]:
        if max_tokens is None:
            # The server's default, within the model's length when the prompt leaves room.
            room = self.max_model_len - num_prompt_tokens
            max_tokens = min(self.default_max_tokens, room) if room > 0 else 1
        elif max_tokens < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        elif num_prompt_tokens + max_tokens > self.max_model_len:
            raise ApiError(
                400,
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"model's length ({self.max_model_len})",
                param="max_tokens",
                code="context_length_exceeded",
            )
        top_k = body.top_k if body.top_k is not None else 0
        if top_k == -1:  # vLLM's "no cut"
            top_k = 0
        try:
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                max_tokens=max_tokens,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                seed=body.seed,
                ignore_eos=body.ignore_eos,
            )
        except (TypeError, ValueError) as e:  # SamplingParams names the field first
            param = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=param) from None
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
        return params, stops

    # -- running a request -----------------------------------------------------------------

    async def generate(
        self,
        request: HttpRequest,
        body: _Body,
        tokens: list[int],
        max_tokens: int | None,
        chat: bool,
    ) -> Response:
        params, stops = self.sampling(body, max_tokens, len(tokens))
        if not tokens:
            raise ApiError(400, "the prompt is empty", param="prompt")
        req = ServeRequest(tokens, params, stream=asyncio.Queue(), loop=asyncio.get_running_loop())
        try:
            self.engine_loop.submit(req)
        except QueueClosed:
            raise ApiError(503, "the server is shutting down", type="server_error") from None
        gen = _Generation(self, req, stops, incremental=body.stream or bool(stops))
        watcher = asyncio.create_task(_watch_disconnect(request, gen.client_gone))
        streaming = False
        try:
            await gen.admitted()
            head = {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "created": int(time.time()),
                "model": self.model_name,
            }
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                streaming = True
                return StreamingResponse(
                    self._events(gen, watcher, head, chat, include_usage),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            text = "".join([piece async for piece in gen.pieces()])
            return JSONResponse(self._whole(gen, head, chat, text))
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            if not streaming:
                watcher.cancel()
                gen.release()

    def _whole(self, gen: _Generation, head: dict, chat: bool, text: str) -> dict[str, Any]:
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
            }
        obj = "chat.completion" if chat else "text_completion"
        return {**head, "object": obj, "choices": [choice], "usage": gen.usage()}

    async def _events(
        self, gen: _Generation, watcher: asyncio.Task, head: dict, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if include_usage else {}

        def chunk(piece: str | None, finish_reason: str | None) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": piece or ""}
            choice["logprobs"] = None
            choice["finish_reason"] = finish_reason
            return _sse({**head, "choices": [choice], **extra})

        # Text chunks are the template around the piece: one small json.dumps per chunk.
        before, after = chunk("@piece@", None).split('"@piece@"')
        dumps = json.JSONEncoder(ensure_ascii=False).encode
        try:
            if chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                first.update(logprobs=None, finish_reason=None)
                yield _sse({**head, "choices": [first], **extra})
            async for piece in gen.pieces():
                if piece:
                    yield before + dumps(piece) + after
            yield chunk(None, gen.finish_reason)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        except _ClientGone:
            return
        except ApiError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            gen.release()


async def _json_body(request: HttpRequest) -> dict[str, Any]:
    too_large = ApiError(
        413, f"the request body is larger than {MAX_BODY_BYTES:,} bytes", code="request_too_large"
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        await _drain(request)
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await _drain(request, size)
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        _log_gone_mid_body(request, size, length)
        raise _ClientGone() from None
    raw = b"".join(chunks)
    if _nesting_depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the body is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _log_gone_mid_body(request: HttpRequest, size: int, length: str | None) -> None:
    """One line, not a traceback: a client that leaves mid-body is routine, not a bug."""
    client = request.client
    who = f"{client.host}:{client.port}" if client else "a client"
    timeout = request.scope.get("nanokv.body_timeout")
    why = f"sent no complete body within {timeout:g} s" if timeout else "left mid-body"
    _log.warning(
        '%s - "%s %s" %s (%d of %s bytes); dropped',
        who,
        request.method,
        request.url.path,
        why,
        size,
        length if length is not None else "?",
    )


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # less 1: opens +1, closes -1


def _nesting_depth(raw: bytes) -> int:
    """How deep the brackets of a JSON text nest, on the raw bytes (a bound: cheap, no parse)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:  # nearly every body: no scan
        return 0
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)  # none inside strings
    steps = brackets.translate(_DEPTH_STEP)
    return max(itertools.accumulate(b - 1 for b in steps), default=0)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; JSON has none


async def _drain(request: HttpRequest, size: int = 0) -> None:
    """Read what the client is still sending (up to a bound), so it gets to read the 413."""
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > _DRAIN_BODY_BYTES:
                return
    except Exception:
        pass


class _ApiKeyMiddleware:
    """/v1/* needs ``Authorization: Bearer KEY`` (compared in constant time), as vLLM's key;
    /metrics too with ``guard_metrics`` (Prometheus scrapers and gateways read it keyless)."""

    def __init__(self, app, api_key: str, guard_metrics: bool) -> None:
        self.app = app
        self.key = api_key.encode()
        self.guard_metrics = guard_metrics

    def guards(self, path: str) -> bool:
        return (
            path == "/v1" or path.startswith("/v1/") or (self.guard_metrics and path == "/metrics")
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.guards(scope["path"]):
            header = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    header = value
            scheme, _, token = header.partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
            if not ok:
                error = ApiError(
                    401,
                    "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ConcurrencyLimit:
    """At most ``limit`` requests in flight, a stream counted until its last event (the app's
    call lasts that long); the next gets a 503. The probes are never refused."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        # The cache stream has its own, smaller limit: a watcher must not hold a request's slot.
        if scope["type"] != "http" or scope["path"] in _PROBES or scope["path"] == EVENTS_PATH:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = ApiError(
                503,
                f"the server has {self.limit} requests in flight, its limit; retry later",
                code="server_overloaded",
            )
            await error.response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class _WatchResponse(StreamingResponse):
    """One watcher's server-sent events; it leaves the stream however the response ends."""

    def __init__(self, stream: CacheStream, watcher) -> None:
        super().__init__(
            stream.frames(watcher),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.stream, self.watcher = stream, watcher

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.discard(self.watcher)


def _cache_events(state: ServerState) -> Response:
    """``GET /v1/nanokv/events``: the cache stream ``nanokv top`` reads (cache_stream.py)."""
    stream = state.cache_stream
    if stream is None:
        raise ApiError(404, f"no cache stream: GET {EVENTS_PATH}", code="not_found")
    try:
        watcher = stream.open()
    except WatcherLimit as e:
        raise ApiError(503, f"{e}; retry later", code="too_many_watchers") from None
    return _WatchResponse(stream, watcher)


def create_app(state: ServerState, limits: ServeLimits | None = None) -> FastAPI:
    limits = limits or ServeLimits()
    app = FastAPI(title="nanokv", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(_ClientGone)
    async def client_gone(request: HttpRequest, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{exc.detail}: {request.method} {request.url.path}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        response = ApiError(exc.status_code, message, code=code).response()
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: HttpRequest, exc: Exception) -> JSONResponse:
        return ApiError(500, "internal server error", type="server_error").response()

    @app.get("/health")
    async def health() -> Response:
        loop = state.engine_loop
        if not loop.alive or loop.queue.closed:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def model_card() -> dict[str, Any]:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "nanokv",
            "root": state.model_path,
            "max_model_len": state.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        state.check_model(model)
        return JSONResponse(model_card())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get(EVENTS_PATH)
    async def cache_events() -> Response:
        return _cache_events(state)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        raw = await _json_body(request)
        body = _validate(CompletionBody, raw)
        state.check_model(body.model)
        if isinstance(body.prompt, list) and not body.prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        tokens = state.prompt_tokens(body.prompt)
        return await state.generate(request, body, tokens, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest) -> Response:
        raw = await _json_body(request)
        body = _validate(ChatBody, raw)
        state.check_model(body.model)
        tokens = state.chat_tokens(body.messages)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        return await state.generate(request, body, tokens, max_tokens, chat=True)

    app.add_middleware(_ConcurrencyLimit, limit=limits.limit_concurrency)
    if state.api_key:  # outermost: a request without the key takes no slot
        app.add_middleware(
            _ApiKeyMiddleware, api_key=state.api_key, guard_metrics=state.guard_metrics
        )
    return app


# -- the server's life -------------------------------------------------------------------------


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


class _BoundedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds uvicorn lacks: a connection beyond
    ``max_connections`` is closed as it is accepted (the descriptors stay bounded), a request's
    headers must arrive within ``timeout_header`` of its first byte (or of the connection's
    start: a silent connection is a slow header) and its body within ``timeout_body`` of them.
    A slow header gets a 408; a slow body is closed, and the handler logs it in one line."""

    def __init__(self, limits: ServeLimits, max_connections: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.max_connections = max_connections
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()  # the descriptor is freed now; connection_lost forgets it
            return
        self._arm(self.limits.timeout_header, self._slow_header)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.deadline is None:  # the header clock runs from the connection's start
            self._arm(self.limits.timeout_header, self._slow_header)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.limits.timeout_body, self._slow_body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _slow_header(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # no response is being written
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            )
        self.transport.close()

    def _slow_body(self) -> None:
        self.deadline = None
        if self.cycle is not None and not self.transport.is_closing():
            self.cycle.scope["nanokv.body_timeout"] = self.limits.timeout_body
            self.transport.close()  # the handler sees a disconnect


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with nanokv's signal handling: the first SIGTERM drains, SIGINT (or a
    second signal) aborts what is in flight; the signals are not re-raised afterwards."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int, bool], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal
        self.signals: list[int] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_start: Callable[[], None] | None = None  # called in the loop, before serving
        self.on_shutdown: Callable[[], None] | None = None  # ...as shutting down begins

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        if self.on_start is not None:
            self.on_start()
        await super().serve(sockets=sockets)

    async def shutdown(self, sockets=None) -> None:
        if self.on_shutdown is not None:  # on a signal or an engine failure alike
            self.on_shutdown()
        await super().shutdown(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        again = self.should_exit
        self.signals.append(sig)
        self.should_exit = True
        if again:
            self.force_exit = True
        if self.loop is not None:  # locks are taken in the loop, not in the signal handler
            self.loop.call_soon_threadsafe(self.on_signal, sig, again)


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
    from . import __version__

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
    from .driver import EngineClock, live_view
    from .report import write_json_atomic

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
        metrics = Metrics(model_name, engine.num_blocks, lambda: run.stats.last)
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
            view = None
            if live:
                view = stack.enter_context(live_view(engine, console, title=f"nanokv serve {url}"))
            if kv_events is not None:  # closed (flushed) once the engine thread has stopped
                from .kv_events import publish_kv_events, publishing_note

                publisher = stack.enter_context(publish_kv_events(engine, kv_events))
                print(publishing_note(publisher), file=sys.stderr, flush=True)
            # Made inside the live view, so uvicorn's log handlers write above it.
            uconfig = uvicorn.Config(
                app,
                log_level="warning" if live else "info",
                access_log=not live,
                timeout_graceful_shutdown=shutdown_timeout,
                lifespan="off",
                ws="none",
                http=functools.partial(_BoundedHttp, limits, limits.max_connections()),
                timeout_keep_alive=limits.timeout_keep_alive,
            )

            def on_signal(sig: int, again: bool) -> None:
                abort = sig == signal.SIGINT or again
                if abort:
                    engine_loop.abort_reason = "the server was interrupted"
                engine_loop.stop(abort=abort)

            server = _Uvicorn(uconfig, on_signal)
            _follow_engine(stream, engine, engine_loop, server, stack)
            engine_loop.on_fatal = lambda: setattr(server, "should_exit", True)
            engine_loop.view = view
            engine_loop.start()
            sock.listen(2048)
            key_note = " (API key required)" if api_key else ""
            print(
                f"nanokv: serving {model_name} on {url}/v1{key_note}; Ctrl-C to stop",
                file=sys.stderr,
                flush=True,
            )
            try:
                server.run(sockets=[sock])
            finally:
                engine_loop.stop(abort=True)
                engine_loop.join(timeout=120)
        interrupted = signal.SIGINT in server.signals
        stopped_by = signal.Signals(server.signals[0]).name if server.signals else None
        result = run.report(
            rejected=engine_loop.rejected,
            interrupted=interrupted,
            stopped_by=stopped_by,
        )
    if report is not None:
        write_json_atomic(report, result)
    code = 1 if engine_loop.error is not None else (130 if interrupted else 0)
    return ServeResult(code, result, interrupted)
