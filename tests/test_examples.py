"""The scripts in examples/: they parse and explain themselves; the two-server example runs
(its --quick workload) against real servers and Dynamo's indexer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(EXAMPLES / "two_servers.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_the_two_server_example_shows_its_help():
    result = run("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "prefix router" in result.stdout and "--quick" in result.stdout


@pytest.mark.slow
def test_the_two_server_example_routes_by_prefix_to_more_hits():
    pytest.importorskip("dynamo.indexer", reason="ai-dynamo-runtime (the test extra) is missing")
    result = run("--quick", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    overall = dict(
        re.findall(r"^\s+(\S+)\s+overall:\s+6 requests, hit rate\s+([\d.]+)%", result.stdout, re.M)
    )
    assert set(overall) == {"round-robin", "prefix"}, result.stdout
    assert float(overall["prefix"]) > float(overall["round-robin"]), result.stdout
    assert "prefix routing:" in result.stdout
