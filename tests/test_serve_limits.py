"""``nanokv serve`` under hostile or careless clients (issue #27): real servers, real sockets.

The concurrency limit answers 503, slow headers and bodies are dropped after their timeouts,
clients that leave mid-body get one log line each (no traceback), deep JSON is refused before
it is parsed, and /metrics is open without the API key unless ``--guard-metrics``.
"""

from __future__ import annotations

import inspect
import json
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from support.servers import KEY, SERVER_ARGS, wait_until

from nanokv_cli.serve.process import ServerProcess

AUTH = {"Authorization": f"Bearer {KEY}"}
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}  # raw bytes sent as JSON
HEADER_TIMEOUT, BODY_TIMEOUT = 0.5, 1.0


def start(tiny: Path, workdir: Path, *flags: str) -> ServerProcess:
    args = ["--model", str(tiny), *SERVER_ARGS, "--served-model-name", "tiny", *flags]
    return ServerProcess(args, workdir, env={"NANOKV_API_KEY": KEY})


def stop(srv: ServerProcess) -> None:
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.wait() == 0, srv.log()


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    srv = start(
        tiny,
        tmp_path_factory.mktemp("server"),
        "--timeout-header",
        str(HEADER_TIMEOUT),
        "--timeout-body",
        str(BODY_TIMEOUT),
    )
    yield srv
    stop(srv)


@pytest.fixture(scope="module")
def guarded(tiny, tmp_path_factory):
    """At most two requests in flight, one sequence at a time (a stream lasts), /metrics behind
    the key."""
    srv = start(
        tiny,
        tmp_path_factory.mktemp("guarded"),
        "--limit-concurrency",
        "2",
        "--max-num-seqs",
        "1",
        "--guard-metrics",
    )
    yield srv
    stop(srv)


def connect(srv: ServerProcess) -> socket.socket:
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def head(path: str, length: int, *, key: bool = True) -> bytes:
    auth = f"Authorization: Bearer {KEY}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and how long that took."""
    t0, data = time.monotonic(), b""
    sock.settimeout(limit)
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - t0


def open_stream(srv: ServerProcess, max_tokens: int) -> socket.socket:
    """A streaming completion, read up to its response's headers (it streams from then on)."""
    body = {"prompt": "Hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    raw = json.dumps(body).encode()
    sock = connect(srv)
    sock.sendall(head("/v1/completions", len(raw)) + raw)
    seen = b""
    while b"\r\n\r\n" not in seen:
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk
    assert seen.startswith(b"HTTP/1.1 200"), seen
    return sock


# -- the concurrency limit ----------------------------------------------------------------------


def test_requests_beyond_the_limit_get_a_503_while_the_probes_answer(guarded):
    body = {"prompt": "Hello", "max_tokens": 2}
    # The limit, 2: one stream generating 300 tokens, one waiting for the engine behind it.
    streams = [open_stream(guarded, 300), open_stream(guarded, 60)]
    try:
        r = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_overloaded"
        assert httpx.get(f"{guarded.url}/health").status_code == 200
        assert httpx.get(f"{guarded.url}/metrics", headers=AUTH).status_code == 200
    finally:
        for sock in streams:
            sock.close()

    def served() -> bool:
        r = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=AUTH, timeout=30)
        return r.status_code == 200

    assert wait_until(served, timeout=30)  # the streams' slots came back when they left


# -- timeouts -----------------------------------------------------------------------------------


def test_a_slow_header_client_is_dropped_after_its_timeout(server):
    for sent in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"):  # silent, half-sent
        with connect(server) as sock:
            sock.sendall(sent)
            data, took = read_until_closed(sock, limit=10)
        assert data.startswith(b"HTTP/1.1 408"), data
        assert HEADER_TIMEOUT * 0.8 <= took < HEADER_TIMEOUT + 3
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_slow_body_is_dropped_after_its_timeout_with_one_line(server):
    with connect(server) as sock:
        sock.sendall(head("/v1/completions", 1000) + b"{")
        data, took = read_until_closed(sock, limit=10)
    assert data == b"" and BODY_TIMEOUT * 0.8 <= took < BODY_TIMEOUT + 3
    assert wait_until(lambda: f"no complete body within {BODY_TIMEOUT:g} s" in server.log())


def test_fifty_mid_body_disconnects_log_fifty_lines_and_no_traceback(server):
    before = server.log().count("left mid-body")
    for _ in range(50):
        with connect(server) as sock:  # Content-Length 1000, one byte, then close
            sock.sendall(head("/v1/completions", 1000) + b"{")
    assert wait_until(lambda: server.log().count("left mid-body") - before >= 50, timeout=30)
    time.sleep(0.5)  # nothing more comes
    log = server.log()
    assert log.count("left mid-body") - before == 50
    assert "Traceback" not in log and "ClientDisconnect" not in log
    assert "(1 of 1000 bytes)" in log or "(0 of 1000 bytes)" in log


# -- bodies -------------------------------------------------------------------------------------


def test_deep_json_and_a_non_finite_number_get_a_400(server):
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = httpx.post(f"{server.url}/v1/completions", content=deep, headers=JSON_AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert "nested" in r.json()["error"]["message"]
    # Brackets inside strings do not nest.
    text = json.dumps({"model": "tiny", "prompt": "[" * 200, "max_tokens": 1})
    r = httpx.post(f"{server.url}/v1/completions", content=text, headers=JSON_AUTH, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 1e999}',
        headers=JSON_AUTH,
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_the_depth_scan_reads_raw_bytes_as_json_nests():
    from nanokv_cli.serve.json_body import MAX_JSON_DEPTH, _nesting_depth

    deep = MAX_JSON_DEPTH + 10
    assert _nesting_depth(b"[" * deep + b"]" * deep) == deep
    assert _nesting_depth(b'{"a": [' + b'"[{", ' * deep + b"1]}") == 2
    assert _nesting_depth(b'["\\"[[[' + b"[" * deep + b'"]') == 1  # an escaped quote


# -- the API key --------------------------------------------------------------------------------


def test_metrics_and_health_are_open_without_the_key_and_v1_is_not(server):
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    for path in ("/v1/models", "/v1/nothing"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH).status_code == 200


def test_guard_metrics_puts_metrics_behind_the_key(guarded):
    r = httpx.get(f"{guarded.url}/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{guarded.url}/metrics", headers=AUTH).status_code == 200
    assert httpx.get(f"{guarded.url}/health").status_code == 200


def test_the_cli_defaults_are_the_servers():
    from nanokv_cli.cli import serve_cmd
    from nanokv_cli.serve.limits import ServeLimits

    params = inspect.signature(serve_cmd).parameters
    for name in ("limit_concurrency", "limit_connections", "timeout_keep_alive", "timeout_header",
                 "timeout_body"):  # fmt: skip
        assert params[name].default == getattr(ServeLimits(), name), name
