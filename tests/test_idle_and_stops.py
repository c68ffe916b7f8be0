"""Views that never go stale, runs that stop between steps, figures with no data, and what-if
rows that cannot differ (issue #45 items 3, 4 and 6), in process: the request loop's idle hook,
the live view's idle frame, the step-boundary Ctrl-C, an all-aborted run's report and the
dry-run notes. The same through real terminals: test_cli_interrupts.py, test_idle_view.py."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.run.interrupt import StepInterrupt
from nanokv_cli.run.loop import Arrivals, Driver, Request, RequestQueue, dry_run_engine
from nanokv_cli.run.record import Run
from nanokv_cli.views.live import LiveView
from nanokv_cli.views.tables import summary_table

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO / "examples" / "traces" / "mooncake_conversation_trace.jsonl"


def req(n: int = 40, first: int = 1, max_tokens: int = 8) -> Request:
    return Request(list(range(first, first + n)), SamplingParams(max_tokens=max_tokens))


def plain(renderable, width: int = 120) -> str:
    con = Console(file=io.StringIO(), width=width, height=40, record=True)
    con.print(renderable)
    return con.export_text()


# -- the request loop tells observers when the engine idles ------------------------------------


def test_an_idle_queue_calls_on_idle_from_the_loop_thread_until_it_closes():
    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=64))
    queue = RequestQueue()
    seen: list[tuple[bool, int, int]] = []  # (waiting, running, thread) at each call

    def on_idle() -> None:
        seen.append((driver.waiting, engine.num_running, threading.get_ident()))

    driver = Driver(engine, clock, max_waiting=float("inf"), on_idle=on_idle, idle_interval=0.02)
    queue.submit(req())
    closer = threading.Timer(0.5, queue.close)
    closer.start()
    steps = list(driver.run(queue))
    closer.join()
    assert steps and not driver.waiting
    # Told once the request finished, then again and again while nothing came (0.5 s / 20 ms).
    assert len(seen) >= 5, seen
    assert {(waiting, running) for waiting, running, _ in seen} == {(False, 0)}
    assert {thread for *_, thread in seen} == {threading.get_ident()}


def test_an_idle_wait_for_the_next_arrival_is_cut_into_intervals():
    class Clock:
        now, waits = 0.0, []

        def __call__(self) -> float:
            return self.now

        def wait_until(self, t: float) -> None:
            self.waits.append(t)
            self.now = t

    clock = Clock()
    arrivals = Arrivals([Request([1, 2], SamplingParams(), 1.0)])
    assert arrivals.wait(clock, timeout=0.25) and clock.waits == [0.25]
    assert arrivals.wait(clock) and clock.waits == [0.25, 1.0]  # no timeout: the whole wait
    far = Arrivals([Request([1, 2], SamplingParams(), 1e12)])
    far.wait(clock, timeout=0.25)
    assert clock.waits[-1] == 1e12  # too far to be meant: left whole, for the clock to refuse


def test_the_live_view_draws_the_idle_engine_not_its_last_busy_step():
    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=64))
    buf = io.StringIO()  # a terminal's: each frame is written as it is drawn
    con = Console(file=buf, width=120, height=40, force_terminal=True, color_system=None)
    view = LiveView(engine.num_blocks, 16, console=con, total_requests=3)
    view.attach(engine.events)
    driver = Driver(engine, clock, on_idle=view.idle)
    with view:
        # No frame is due while it runs: its last busy frame would be the opening one.
        view._next_frame = float("inf")
        for _ in driver.run(Arrivals([req(first=1), req(first=100), req(first=200)])):
            view.tick()
        frames = view.frames
        view._next_frame = 0.0  # a frame is due now
        view.idle()
        assert view.frames == frames + 1
        idle_frame = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue()).split("blocks  ")[-1]
    assert "running 0 · waiting 0 · done 3/3" in idle_frame
    assert "0 used" in idle_frame and "idle" in idle_frame


# -- Ctrl-C between steps ------------------------------------------------------------------------


@pytest.fixture
def python_sigint():
    """SIGINT as a plain Python process has it (a test runner's worker may have another)."""
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, saved)


def _sigint_self() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary


def test_the_first_ctrl_c_waits_for_the_step_and_the_second_does_not(python_sigint):
    with StepInterrupt() as stop:
        _sigint_self()
        assert stop.requested  # asked, not raised: the step in progress finishes
        with pytest.raises(KeyboardInterrupt):
            _sigint_self()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_while_the_loop_waits_raises_at_once(python_sigint):
    with StepInterrupt(waiting=lambda: True) as stop, pytest.raises(KeyboardInterrupt):
        _sigint_self()
    assert not stop.requested


def test_an_ignored_sigint_stays_ignored():
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StepInterrupt():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)


# -- an all-aborted run's figures ----------------------------------------------------------------


def test_every_request_aborted_counts_their_prompts_and_gives_no_latency():
    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=64))
    config = {"file": None, "dry_run": False, "model": None}
    queue = RequestQueue()
    a, b = req(n=40, max_tokens=100), req(n=24, first=300, max_tokens=100)
    with Run(engine, clock, config=config, latencies=True) as run:
        driver = Driver(engine, clock)
        queue.submit(a)
        queue.submit(b)
        for i, outputs in enumerate(driver.run(queue)):
            run.observe(outputs)
            if i == 5:  # both have tokens: their prompts were computed
                queue.abort(None)
                queue.close()
        report = run.report(interrupted=True)
    assert report["requests"] == 0 and report["requests_aborted"] == 2
    assert report["prompt_tokens"] == 0 and report["prompt_tokens_aborted"] == 64
    outputs = report["output_tokens"]
    assert outputs > 0
    total = (64 + outputs) / report["duration_s"]
    assert report["total_token_throughput"] == pytest.approx(total)
    assert report["total_token_throughput"] > report["output_throughput"]
    assert report["e2e_latency_s"]["p50"] is None  # no request finished: no figure

    lines = plain(summary_table(report)).splitlines()
    [latency] = [x for x in lines if x.startswith("request latency")]
    assert "n/a" in latency and "0.0 ms" not in latency
    [both] = [x for x in lines if "prompt + output" in x]
    assert f"{report['total_token_throughput']:,.1f} tok/s" in both
    assert any("64 more of aborted ones" in x for x in lines)
    assert "interrupted" in lines[0]


# -- dry-run rows a Mooncake trace cannot tell apart --------------------------------------------


def replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanokv_cli.cli", "replay", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_rows_below_the_traces_hash_blocks_say_why_they_cannot_differ():
    args = [str(MOONCAKE), "--dry-run", "--limit", "40", "--block-size", "16,256,512"]
    r = replay(*args, "--json")
    assert r.returncode == 0, r.stderr
    reports = {x["block_size"]: x for x in json.loads(r.stdout)}
    for small in (16, 256):
        [note] = reports[small]["notes"]
        assert "512-token hash-id blocks" in note and "cannot be measured" in note
        assert reports[small]["hit_rate"] == reports[512]["hit_rate"]
    assert "notes" not in reports[512]
    # The start-up line: one line on stderr, when piped too.
    [line] = [x for x in r.stderr.splitlines() if "KV cache" in x]
    assert "16,384 × 16" in line and "262,144 tokens each" in line and "dry-run default" in line

    table = replay(*args, "--no-live").stdout
    rows = {line.split()[0]: line for line in table.splitlines() if line.strip()}
    assert "*16" in rows and "*256" in rows and "512" in rows  # the marks, beside the rows
    note = table.split("\n* ", 1)[1]
    assert note.startswith("below the trace's 512-token hash-id blocks")


def test_a_prompt_file_gets_no_such_note(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt_token_ids": [1, 2, 3] * 30}) + "\n" for _ in range(3))
    )
    r = replay(str(prompts), "--dry-run", "--block-size", "16,64", "--json")
    assert r.returncode == 0, r.stderr
    assert all("notes" not in x for x in json.loads(r.stdout))
