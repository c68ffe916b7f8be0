"""A ``nanokv serve`` process for the serving benchmarks (bench_serve.py, soak_serve.py): started
on a free loopback port, waited for until /health answers, read through /metrics and /proc, and
stopped with SIGTERM (killed if it lingers). No torch here: the scripts import it cheaply."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


class ServeProcess:
    def __init__(
        self, args: list[str], workdir: str, deadline: float, threads: int | None, name: str
    ) -> None:
        """``nanokv serve --port 0 --no-live ARGS``; ``name`` names its log files in
        ``workdir``; ``threads``: OMP_NUM_THREADS for it (None: inherited)."""
        env = dict(os.environ)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, "-m", "nanokv_cli.cli", "serve", "--port", "0", "--no-live", *args]
        self.err_path = Path(workdir) / f"{name}.err"
        self.err = open(self.err_path, "w")  # noqa: SIM115
        self.out = open(Path(workdir) / f"{name}.out", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.out, stderr=self.err, env=env)
        self.url = self._wait(deadline)
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.address = (host, int(port))

    def _wait(self, deadline: float) -> str:
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r"serving .* on (http://\S+)/v1", self.err_path.read_text())
            if m:
                try:
                    if httpx.get(f"{m.group(1)}/health", timeout=5).status_code == 200:
                        return m.group(1)
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        self.kill()
        raise SystemExit(f"the server did not start:\n{self.err_path.read_text()}")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                extra = {k: v for k, v in s.labels.items() if k != "model_name"}
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in extra.items()) + "}")
                out[key if extra else s.name] = s.value
        return out

    def process(self) -> dict[str, float]:
        """RSS (MB), threads and open file descriptors of the server process."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {
            "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
            "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{self.proc.pid}/fd")),
        }

    def stop(self, timeout: float) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


def settled(server: ServeProcess, timeout: float) -> dict[str, float]:
    """/metrics once nothing runs (the last step's snapshot may lag a disconnect by a step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        busy = m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]
        if (busy == 0 and m["nanokv:kv_cache_blocks{state=used}"] == 0) or (
            time.monotonic() > deadline
        ):
            return m
        time.sleep(0.1)


def chat_body(messages, max_tokens: int) -> dict:
    """A greedy streaming chat request of exactly ``max_tokens`` tokens, with its usage."""
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
