"""How much a server takes on: requests, connections, watchers, and how long it waits."""

from __future__ import annotations

import resource
from dataclasses import dataclass


@dataclass(frozen=True)
class ServeLimits:
    """How much a server takes on, and how long it waits for a client (seconds)."""

    limit_concurrency: int = 512  # requests in flight (streams count until they end): then 503
    limit_connections: int | None = None  # open connections; None: 3/4 of the open-files limit
    timeout_keep_alive: float = 5.0  # idle between two requests on one connection (uvicorn's)
    timeout_header: float = 10.0  # from a request's first byte (or the connection's) to its headers
    timeout_body: float = 30.0  # from the headers to the body's last byte
    max_watchers: int = 16  # cache-stream watchers (nanokv top): then 503
    timeout_write: float = 10.0  # a response its client takes nothing of for this long: closed

    def max_connections(self) -> int:
        if self.limit_connections is not None:
            return self.limit_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        # The rest of the descriptors stay for the model's files, logs, the trace and /health.
        return 3 * soft // 4 if soft != resource.RLIM_INFINITY else 1 << 16
