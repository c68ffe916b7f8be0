"""``nanokv serve`` as a child process: the one harness the tests, the benchmarks and the
examples start servers with.

    with ServerProcess(["--model", folder, "--no-live"], workdir) as server:
        httpx.get(f"{server.url}/v1/models")
        server.metrics()["vllm:num_requests_running"]
    metrics_at(url)  # the same, for a server started elsewhere

It runs ``python -m nanokv_cli.cli serve --port 0 ARGS`` (a later ``--port`` wins) from the
folder holding this copy of ``nanokv_cli``, so the child imports the same code. Its stdout and
stderr go to files in ``workdir`` (``NAME.out``, ``NAME.err``), never to pipes, so a chatty
server cannot block on a full pipe. Ready means: its log printed the address it bound
(``serving ... on http://HOST:PORT/v1``) and ``/health`` answers 200. Anything that interrupts
the wait (a timeout, Ctrl-C, SIGTERM turned into an exception) kills the child before it
propagates, so no server outlives its starter.

Only the standard library and ``prometheus_client`` (for ``metrics``): no torch, no httpx.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# The folder holding the ``nanokv_cli`` package this module belongs to.
PACKAGE_PARENT = Path(__file__).resolve().parents[len(__name__.split(".")) - 1]
SERVING_LINE = re.compile(r"serving .* on (http://\S+)/v1")
START_TIMEOUT_S = 180.0
# Loopback requests never go through a proxy, whatever the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerStartError(RuntimeError):
    """The server exited, or did not answer in time, before it was ready; carries its log."""


class ServerProcess:
    """One ``nanokv serve`` on a free loopback port, started and waited for on construction."""

    def __init__(
        self,
        args: list[str],
        workdir: str | Path,
        env: dict[str, str] | None = None,
        *,
        name: str = "server",
        timeout: float = START_TIMEOUT_S,
        cwd: str | Path | None = None,
    ) -> None:
        """``env`` is added to this process's environment; ``timeout`` bounds the start."""
        workdir = Path(workdir)
        self.out_path = workdir / f"{name}.out"
        self.err_path = workdir / f"{name}.err"
        command = [sys.executable, "-m", "nanokv_cli.cli", "serve", "--port", "0", *map(str, args)]
        # The child holds its own copies of the two files; ours close at once.
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                command,
                cwd=cwd or PACKAGE_PARENT,
                stdout=out,
                stderr=err,
                env={**os.environ, **(env or {})},
            )
        try:
            self.url = self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self.kill()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    # -- its output --------------------------------------------------------------------------

    def log(self) -> str:
        """What it wrote to stderr so far: its log lines."""
        return self.err_path.read_text(errors="replace")

    def output(self) -> str:
        """What it wrote to stdout so far (the run's summary, once it has stopped)."""
        return self.out_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT_S) -> re.Match:
        """The first match of ``pattern`` in its log, waited for while it runs."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.log())
            if found:
                return found
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise ServerStartError(f"its log never showed {pattern!r}:\n{self.log()}")
            time.sleep(0.05)

    def _wait_ready(self, deadline: float) -> str:
        url = None
        while time.monotonic() < deadline and self.proc.poll() is None:
            if url is None:
                found = SERVING_LINE.search(self.log())
                url = found.group(1) if found else None
            if url is not None and _answers(f"{url}/health"):
                return url
            time.sleep(0.05)
        state = "exited" if self.proc.poll() is not None else "did not answer in time"
        raise ServerStartError(f"nanokv serve {state}; its log:\n{self.log()}")

    # -- its life ----------------------------------------------------------------------------

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 120.0) -> int:
        """Its exit status, once it exits (``subprocess.TimeoutExpired`` past ``timeout``)."""
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 120.0, sig: int = signal.SIGTERM) -> int:
        """Ask it to stop (SIGTERM: in-flight requests finish) and return its exit status;
        killed, and the timeout raised, if it lingers past ``timeout``."""
        self.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL, if it still runs, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    # -- what it reports ---------------------------------------------------------------------

    def metrics(self, api_key: str | None = None) -> dict[str, float]:
        """Its ``/metrics`` now (see ``metrics_at``)."""
        return metrics_at(self.url, api_key)

    def process_stats(self) -> dict[str, float]:
        """RSS (MB), threads and open file descriptors of the server process (Linux)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {
            "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
            "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{self.proc.pid}/fd")),
        }


def metrics_at(url: str, api_key: str | None = None) -> dict[str, float]:
    """Every sample of ``URL/metrics`` as ``name{label=value,...}`` (labels sorted, the model
    name left out; no braces without labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{url}/metrics", headers=headers)
    with _OPENER.open(request, timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = sorted((k, v) for k, v in s.labels.items() if k != "model_name")
            inside = ",".join(f"{k}={v}" for k, v in labels)
            samples[f"{s.name}{{{inside}}}" if labels else s.name] = s.value
    return samples


def _answers(url: str) -> bool:
    """Whether ``url`` answers 200 now."""
    try:
        with _OPENER.open(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
