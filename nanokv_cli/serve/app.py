"""The HTTP application: its routes, error handlers and middlewares (``create_app``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from .cache_stream import EVENTS_PATH, CacheStream, WatcherLimit
from .json_body import read_json_body
from .limits import ServeLimits
from .middleware import ApiKeyMiddleware, ConcurrencyLimit, TrailingSlash
from .protocol import ApiError, ChatBody, ClientGone, CompletionBody, validate_body
from .serving import ServerState


def create_app(state: ServerState, limits: ServeLimits | None = None) -> FastAPI:
    limits = limits or ServeLimits()
    app = FastAPI(
        title="nanokv", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False
    )
    _add_error_handlers(app)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    app.add_middleware(ConcurrencyLimit, limit=limits.limit_concurrency)
    if state.api_key:  # outermost: a request without the key takes no slot
        app.add_middleware(
            ApiKeyMiddleware, api_key=state.api_key, guard_metrics=state.guard_metrics
        )
    app.add_middleware(TrailingSlash)  # outermost: every other layer sees the route's path
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answers in OpenAI's shape; an unexpected one says nothing of the internals."""

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: HttpRequest, exc: ClientGone) -> Response:
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


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    """What the server says about itself: health, the model, metrics, the cache stream."""

    @app.get("/health")
    async def health() -> Response:
        loop = state.engine_loop
        if not loop.alive or loop.queue.closed:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        state.check_model(model)
        return JSONResponse(_model_card(state))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get(EVENTS_PATH)
    async def cache_events() -> Response:
        return _cache_events(state)


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        raw = await read_json_body(request)
        body = validate_body(CompletionBody, raw)
        state.check_model(body.model)
        if isinstance(body.prompt, list) and not body.prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        tokens = state.prompt_tokens(body.prompt)
        return await state.generate(request, body, tokens, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest) -> Response:
        raw = await read_json_body(request)
        body = validate_body(ChatBody, raw)
        state.check_model(body.model)
        tokens = state.chat_tokens(body.messages)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        return await state.generate(request, body, tokens, max_tokens, chat=True)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "nanokv",
        "root": state.model_path,
        "max_model_len": state.max_model_len,
    }


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
