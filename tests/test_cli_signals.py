"""Ctrl-C during a replay: exit 130, the terminal restored, report and trace still valid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanokv_cli.trace.reader import TraceReader

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO / "examples" / "traces" / "mooncake_conversation_trace.jsonl"
# Long enough that the run is still going when the signal comes (a few seconds per 500 requests).
LONG_RUN = [
    "replay",
    str(MOONCAKE),
    "--dry-run",
    "--limit",
    "4000",
    "--block-size",
    "64",
    "--num-blocks",
    "4000",
]


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the replay to get going")
        time.sleep(0.05)


def steps_written(trace: Path) -> bool:
    last = TraceReader(trace).state_at().last_snapshot
    return last is not None and last.step > 0


def test_sigint_leaves_a_valid_trace_and_report(tmp_path):
    trace, report = tmp_path / "run.trace", tmp_path / "report.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nanokv_cli.cli",
            *LONG_RUN,
            "--record",
            str(trace),
            "--report",
            str(report),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Interrupt once the trace holds a second whole step (its size alone once let the
        # signal land before step 1 on a loaded machine).
        wait_for(lambda: trace.exists() and trace.stat().st_size > 200_000 and steps_written(trace))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    saved = json.loads(report.read_text())
    assert saved["interrupted"] is True and 0 < saved["requests_added"] < 4000
    assert saved["requests"] <= saved["requests_added"]
    state = TraceReader(trace).state_at()  # reads to the last whole step
    assert state.last_snapshot is not None and state.last_snapshot.step > 0
    assert not list(tmp_path.glob(".report.json.*"))  # no temp file left behind


def test_sigint_restores_the_terminal_under_the_live_view(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "nanokv_cli.cli", *LONG_RUN],
        cwd=str(REPO),
        env={**os.environ, "TERM": "xterm-256color"},
        dimensions=(40, 100),
        encoding="utf-8",
        timeout=120,
    )
    child.expect("prefix|decode|mixed")  # a step has been drawn
    child.sendintr()
    out = child.read()
    child.close()
    assert child.exitstatus == 130
    assert "Traceback" not in out and "interrupted" in out
    assert "\x1b[?25h" in out  # the cursor is shown again
