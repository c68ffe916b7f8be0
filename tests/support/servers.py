"""What the serving tests agree on. The server process itself is
``nanokv_cli.serve.process.ServerProcess``, the harness the benchmarks and examples use too."""

from __future__ import annotations

import time

KEY = "test-key"
# 24 blocks of 16 tokens: a request can fit the tiny model's 512 tokens but not the cache.
SERVER_ARGS = ["--block-size", "16", "--num-blocks", "24", "--no-live"]
LOOPBACK = "tcp://127.0.0.1:*"  # a free port, resolved by the publisher and printed by serve


def wait_until(predicate, timeout: float = 10.0):
    """``predicate()`` polled until it is true or ``timeout`` passes; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)
