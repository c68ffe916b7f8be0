"""``nanokv top`` against real servers: ``nanokv serve`` subprocesses on a tiny Llama, read over
real HTTP by the CLI (``--once --json``) and the library (``nanokv_cli.serve.top.Top``), one server,
two at once, one of them restarted; the interactive view in a pty (pexpect). And the cache
stream itself, followed step by step against the block manager's own books."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pexpect
import pytest
from rich.console import Console
from support.servers import KEY, wait_until

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.cache_stats import MISS_REASONS
from nanokv_cli.engine.core.events import StepSnapshot
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.run.loop import dry_run_engine
from nanokv_cli.serve.cache_stream import EVENTS_PATH, CacheRecorder, CacheStream, block_code
from nanokv_cli.serve.metrics import CACHE_COUNTERS
from nanokv_cli.serve.process import ServerProcess, metrics_at
from nanokv_cli.serve.top import ServerView, Top, _sse_frames, parse_url, server_json, top_json
from nanokv_cli.views.top import fleet_frame

REPO = Path(__file__).resolve().parents[1]
PREFIX = list(range(10, 58))  # three 16-token blocks every request shares (vocabulary: 320)


def serve_args(tiny: Path, name: str, num_blocks: int) -> list[str]:
    return ["--model", str(tiny), "--served-model-name", name, "--block-size", "16",
            "--num-blocks", str(num_blocks), "--no-live", "--threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def server_a(tiny, tmp_path_factory):
    srv = ServerProcess(
        serve_args(tiny, "tiny-a", 24), tmp_path_factory.mktemp("a"), {"NANOKV_API_KEY": KEY}
    )
    yield srv
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.wait() == 0, srv.log()


def complete(url: str, suffix: list[int], max_tokens: int = 8) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": PREFIX + suffix, "max_tokens": max_tokens, "ignore_eos": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def idle(url: str) -> dict[str, float] | None:
    """/metrics once nothing runs, else None."""
    m = metrics_at(url, KEY)
    busy = m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]
    return m if busy == 0 and m["nanokv:kv_cache_blocks{state=used}"] == 0 else None


def top_cli(*args: str, key: str | None = KEY) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NANOKV_API_KEY"}
    if key is not None:
        env["NANOKV_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "nanokv_cli.cli", "top", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_row_is_metrics(row: dict, m: dict[str, float]) -> None:
    """One server's row of ``top`` against its /metrics, name by name."""
    for key, (metric, _) in CACHE_COUNTERS.items():
        assert row[key] == m[f"{metric}_total"], key
    for reason in MISS_REASONS:
        assert (
            row["miss_tokens"][reason]
            == m[f"nanokv:prefix_cache_miss_tokens_total{{reason={reason}}}"]
        )
    for state in ("used", "cached", "free"):
        assert row["blocks"][state] == m[f"nanokv:kv_cache_blocks{{state={state}}}"], state
    assert row["running"] == m["vllm:num_requests_running"]
    assert row["waiting"] == m["vllm:num_requests_waiting"]
    assert row["finished"] == m_done(m)


# -- the stream, step by step, in process --------------------------------------------------------


def frames_of(watcher) -> list[tuple[str, dict]]:
    text = "".join(watcher.queue.get_nowait() for _ in range(watcher.queue.qsize()))
    return list(_sse_frames(io.BytesIO(text.encode())))


def test_stream_follows_the_block_managers_books_through_every_kind_of_change():
    """A real engine (dry-run executor) with shared, revived, preempted and evicted blocks:
    after every step, the codes a watcher rebuilt from the frames it was sent equal the block
    manager's ref counts and hashes, and its stats are the step's own snapshot; a watcher
    that stops reading gets a fresh snapshot, and the books stay right when the engine thread
    applies its events itself (the loop fell behind: nobody ticked)."""
    eng, _ = dry_run_engine(EngineConfig(block_size=4, num_blocks=24))
    bm = eng.block_manager
    recorder = CacheRecorder(eng.num_blocks, max_pending=40)
    eng.events.subscribe(recorder.listener)
    snaps: list[StepSnapshot] = []
    eng.events.subscribe(lambda e: snaps.append(e) if type(e) is StepSnapshot else None)
    stream = CacheStream(
        recorder, {"model": "dry", "block_size": 4}, lambda: eng.clock, queue_frames=3
    )
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prefix = list(range(100, 116))
    waves = [
        [prefix + [1, 2, 3]],
        [prefix + [1, 2, 3], prefix[:14] + [7, 8, 9], prefix + [5]],  # shared
        [prefix + [6, 6]],  # revived
        [[1000 + 10 * i + j for j in range(15)] for i in range(4)],  # preemption, evictions
        [prefix + [4, 4, 4, 4, 4]],
    ]

    def step() -> None:
        eng.step()
        recorder.step_ended()  # as serve's engine loop calls it

    def books() -> bytearray:
        return bytearray(block_code(b.ref_count, b.hash) for b in bm.blocks)

    async def watch() -> dict[str, int]:
        watcher = stream.open()
        view = ServerView(parse_url("http://127.0.0.1:1"))
        seen = {"snapshot": 0, "delta": 0}

        def read() -> None:
            for event, data in frames_of(watcher):
                seen[event] += 1
                view.apply(event, data)
            assert view.codes == books()
            assert view.snapshot() == replace(snaps[-1], scheduled=[])

        for i, wave in enumerate(waves):
            for prompt in wave:
                eng.add_request(prompt, params)
            for _ in range(20 if i == 1 else 3):
                step()
                stream.tick()
                read()
            if i == 2:  # a watcher that does not read for a while (its queue holds 3 frames)
                for _ in range(12):
                    step()
                    stream.tick()
                read()
                resyncs = watcher.resyncs
            if i == 3:  # nobody ticks for 8 steps: the engine thread catches up (> 40 events)
                for _ in range(8):
                    step()
                stream.tick()
                read()
        while eng.has_unfinished_requests():
            step()
            stream.tick()
            read()
        return {**seen, "resyncs": resyncs, "finished": view.stats["finished"]}

    seen = asyncio.run(watch())
    stats = bm.stats
    assert stats.shared_hits and stats.revived_hits and stats.preemptions and stats.evictions
    assert seen["resyncs"] >= 1 and recorder.catch_ups >= 1
    assert seen["snapshot"] >= 2 and seen["delta"] > 20  # the first, and a resync's
    assert recorder.finished == sum(map(len, waves)) == seen["finished"]


# -- one real server ------------------------------------------------------------------------------


def test_once_json_is_the_servers_own_numbers(server_a):
    """After requests sharing a prefix, ``top --once --json`` gives what /metrics gives, name by
    name, and what the requests were told: cached tokens, prompt tokens, tokens computed."""
    usages = [complete(server_a.url, [200 + i, 210 + i]) for i in range(4)]
    m = wait_until(lambda: idle(server_a.url))
    out = top_cli(server_a.url, "--once", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert idle(server_a.url) == m  # nothing ran meanwhile
    (row,) = report["servers"]
    assert row["status"] == "up" and row["model"] == "tiny-a" and row["restarts"] == 0
    assert (row["num_blocks"], row["block_size"]) == (24, 16)
    assert_row_is_metrics(row, m)
    hits = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert row["cache_hits"] >= hits > 0  # >=: the module's other tests ran requests too
    assert row["blocks"]["cached"] > 0 and row["blocks"]["used"] == 0
    # Tokens computed: prompts less their hits, and every generated token but each first one
    # (it comes from the prompt's last step). Without preemptions nothing is computed twice.
    assert row["preemptions"] == 0
    prompt, generated = m["vllm:prompt_tokens_total"], m["vllm:generation_tokens_total"]
    assert row["tokens_total"] == prompt - row["cache_hits"] + generated - row["finished"]
    fleet = report["fleet"]
    assert fleet["servers_up"] == 1 and fleet["cache_hits"] == row["cache_hits"]
    assert fleet["hit_rate"] == row["hit_rate"] == row["cache_hits"] / row["cache_queries"]


def test_the_stream_needs_the_servers_key(server_a):
    url = server_a.url + EVENTS_PATH
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(url, headers=headers, timeout=10)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    with httpx.stream("GET", url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert next(r.iter_lines()) == "event: snapshot"
    missing = top_cli(server_a.url, "--once", key=None)
    assert missing.returncode == 1
    assert "401: the server wants an API key (give --api-key or NANOKV_API_KEY)" in missing.stderr
    wrong = top_cli(server_a.url, "--once", "--api-key", "wrong", key=None)
    assert wrong.returncode == 1 and "401: the server refused the API key" in wrong.stderr
    bad = top_cli("ftp://" + server_a.url.removeprefix("http://"), "--once")
    assert bad.returncode == 1 and "not an http:// or https:// URL" in bad.stderr
    json_alone = top_cli(server_a.url, "--json")
    assert json_alone.returncode == 2 and "--json needs --once" in json_alone.stderr


def test_watchers_are_bounded_and_leave_their_place(server_a):
    """16 watchers at once (serve's limit); the next gets a 503 until one leaves."""
    url, headers = server_a.url + EVENTS_PATH, {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=10) as client:
        streams = []
        try:
            for _ in range(16):
                request = client.build_request("GET", url, headers=headers)
                streams.append(client.send(request, stream=True))  # open until closed
                assert streams[-1].status_code == 200
            full = httpx.get(url, headers=headers, timeout=10)
            assert full.status_code == 503 and full.json()["error"]["code"] == "too_many_watchers"
            streams.pop().close()

            def room() -> bool:
                with httpx.stream("GET", url, headers=headers, timeout=10) as r:
                    return r.status_code == 200

            assert wait_until(room)
        finally:
            for r in streams:
                r.close()


def test_interactive_view_in_a_terminal_and_ctrl_c(server_a):
    """``nanokv top URL`` in a pty: a frame with the block map, the hit rate and the server's
    name; Ctrl-C leaves with exit 0 and the cursor shown again."""
    complete(server_a.url, [230, 231])
    env = {**os.environ, "NANOKV_API_KEY": KEY, "TERM": "xterm-256color"}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "nanokv_cli.cli", "top", server_a.url],
        cwd=str(REPO),
        env=env,
        dimensions=(40, 120),
        encoding="utf-8",
        timeout=30,
    )
    try:
        child.expect("● up")
        child.expect("tiny-a")
        child.expect("blocks × 16 tokens")
        child.expect("cached-free")  # the map's legend, under its rows
        child.expect(r"hit rate \d+\.\d%")
        child.expect("tokens/s")
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    assert "\x1b[?25h" in child.before  # the cursor, hidden while drawing, is back


# -- two servers, one restarted -------------------------------------------------------------------


@pytest.mark.slow
def test_two_servers_then_one_restarts(server_a, tiny, tmp_path):
    """Two servers at once: a row each equal to its /metrics, and the merged figures their sums.
    Then B stops (SIGTERM: top shows it down) and a new B starts on the same port: the same
    ``Top`` shows it up again as a new instance, with the new instance's numbers."""
    args_b = serve_args(tiny, "tiny-b", 32)
    env = {"NANOKV_API_KEY": KEY}
    (tmp_path / "b1").mkdir()
    b = ServerProcess(args_b, tmp_path / "b1", env)
    try:
        for i in range(3):
            complete(b.url, [250 + i])
        ma, mb = wait_until(lambda: idle(server_a.url)), wait_until(lambda: idle(b.url))
        with Top([server_a.url, b.url], KEY) as top:
            assert top.wait(lambda vs: all(v.status == "up" for v in vs), 30)
            done = [m_done(ma), m_done(mb)]
            assert top.wait(lambda vs: [v.stats["finished"] for v in vs] == done, 10)
            rows = [server_json(v) for v in top.views()]
            for row, m in zip(rows, (ma, mb)):
                assert_row_is_metrics(row, m)
            assert [r["model"] for r in rows] == ["tiny-a", "tiny-b"]
            fleet = top_json(top.views())["fleet"]
            assert fleet["num_blocks"] == 24 + 32 and fleet["servers_up"] == 2
            for key in ("cache_queries", "cache_hits", "evictions", "finished", "running"):
                assert fleet[key] == rows[0][key] + rows[1][key], key
            assert fleet["blocks"]["cached"] == sum(r["blocks"]["cached"] for r in rows)
            assert fleet["hit_rate"] == fleet["cache_hits"] / fleet["cache_queries"]
            first_b = rows[1]["instance_id"]

            b.proc.send_signal(signal.SIGTERM)  # the server ends top's stream with a "bye"
            seen: list[ServerView] = []
            assert top.wait(lambda vs: seen.append(vs[1]) or vs[1].status == "down", 30)
            assert seen[-1].error == "the server is shutting down"  # then: connection refused
            assert b.wait() == 0, b.log()
            assert top.views()[0].status == "up"
            port = b.url.rsplit(":", 1)[1]
            (tmp_path / "b2").mkdir()
            b = ServerProcess([*args_b, "--port", port], tmp_path / "b2", env)
            assert b.url.endswith(f":{port}")
            assert top.wait(lambda vs: vs[1].status == "up", 30)
            complete(b.url, [260])
            mb = wait_until(lambda: idle(b.url))
            assert top.wait(lambda vs: vs[1].stats["finished"] == 1, 10)
            views = top.views()
            row = server_json(views[1])
            assert row["instance_id"] != first_b and row["restarts"] == 1
            assert_row_is_metrics(row, mb)  # the new instance's numbers only
            assert row["cache_queries"] == len(PREFIX) + 1
            console = Console(file=io.StringIO(), width=120, record=True)
            console.print(fleet_frame(views, 120))
            frame = console.export_text()
            assert "fleet" in frame and "2/2 up" in frame and "↻1" in frame
        once = top_cli(server_a.url, b.url, "--once", "--json")
        assert once.returncode == 0, once.stderr
        assert [r["model"] for r in json.loads(once.stdout)["servers"]] == ["tiny-a", "tiny-b"]
    finally:
        b.kill()


def m_done(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("vllm:request_success_total"))
