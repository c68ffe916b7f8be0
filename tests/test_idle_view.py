"""``serve``'s live view never goes stale (issue #45 item 3): once the requests are done, the
view on the server's terminal shows what ``/metrics`` says, within one refresh, not the last
busy step it happened to draw."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from support.servers import wait_until

from nanokv_cli.serve.process import metrics_at

REPO = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
COUNTERS = re.compile(
    r"blocks\s+([\d,]+) used · ([\d,]+) cached-free · ([\d,]+) free\s+"
    r"running (\d+) · waiting (\d+) · done (\d+)"
)


class Terminal:
    """A child on a pseudo-terminal, read all the time on a thread (a full pty would block the
    server's engine thread in the middle of a frame)."""

    def __init__(self, args: list[str]) -> None:
        import pexpect

        self.child = pexpect.spawn(
            sys.executable,
            args,
            cwd=str(REPO),
            env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "50"},
            dimensions=(50, 160),
            encoding="utf-8",
            codec_errors="replace",  # the terminal's own ^C may land inside a character
            timeout=120,
        )
        self.text = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None

    def expect(self, pattern: str) -> re.Match:
        """Wait for ``pattern`` (before the reader thread takes over)."""
        self.child.expect(pattern)
        self.text = self.child.before + self.child.after
        return self.child.match

    def follow(self) -> None:
        import pexpect

        def read() -> None:
            while not self._stop.is_set():
                try:
                    chunk = self.child.read_nonblocking(1 << 16, timeout=0.1)
                except pexpect.TIMEOUT:
                    continue
                except pexpect.EOF:
                    return
                with self._lock:
                    self.text += chunk

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def screen(self) -> str:
        with self._lock:
            return ANSI.sub("", self.text)

    def close(self) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(5)
        self.child.terminate(force=True)


def last_counters(text: str) -> dict[str, int]:
    *_, m = COUNTERS.finditer(text)
    keys = ("used", "cached", "free", "running", "waiting", "done")
    return {k: int(v.replace(",", "")) for k, v in zip(keys, m.groups())}


def metric_counters(url: str) -> dict[str, int]:
    m = metrics_at(url)
    done = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total"))
    return {
        "used": int(m["nanokv:kv_cache_blocks{state=used}"]),
        "cached": int(m["nanokv:kv_cache_blocks{state=cached}"]),
        "free": int(m["nanokv:kv_cache_blocks{state=free}"]),
        "running": int(m["vllm:num_requests_running"]),
        "waiting": int(m["vllm:num_requests_waiting"]),
        "done": int(done),
    }


def chat(url: str, i: int) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    text = ""
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"Question number {i}: what is a KV cache?"}],
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    return text


def test_the_idle_live_view_of_serve_matches_metrics(tiny):
    pytest.importorskip("pexpect")
    term = Terminal(
        ["-m", "nanokv_cli.cli", "serve", "--model", str(tiny), "--port", "0"]
        + ["--served-model-name", "tiny", "--block-size", "16", "--num-blocks", "64"]
    )
    try:
        url = term.expect(r"serving .* on (http://\S+)/v1").group(1)
        term.follow()
        assert wait_until(lambda: "cached-free" in term.screen(), timeout=60)  # a frame
        # 8 chats, two at a time, as the session had them.
        for pair in range(4):
            threads = [threading.Thread(target=chat, args=(url, 2 * pair + k)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        assert wait_until(lambda: metric_counters(url)["running"] == 0, timeout=60)
        want = metric_counters(url)
        assert want["done"] == 8 and want["used"] == 0
        # One refresh: the idle loop's interval (0.25 s) and a frame's (~0.1 s), with room.
        time.sleep(1.5)
        screen = term.screen()
        assert last_counters(screen) == want, screen[-3000:]
        assert "idle" in screen.rsplit("blocks ", 1)[-1]
    finally:
        term.close()
