"""The ASGI middlewares that admit a request before the app sees it: one path per route, the
API key, and the bound on requests in flight."""

from __future__ import annotations

import hmac

from .cache_stream import EVENTS_PATH
from .protocol import ApiError

_PROBES = ("/health", "/metrics")  # never refused for load: monitoring must see an overload


class TrailingSlash:
    """``/metrics/`` is answered as ``/metrics``, not redirected: Starlette's redirect builds
    an absolute URL from the ``Host`` header, which a client (or a proxy) chooses. Outermost,
    so the key and the limits see the path the routes see."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = dict(scope, path=path.rstrip("/") or "/")
            if isinstance(scope.get("raw_path"), bytes):
                scope["raw_path"] = scope["raw_path"].rstrip(b"/") or b"/"
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
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


class ConcurrencyLimit:
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
