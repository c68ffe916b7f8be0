"""CPU threads: set once per model from ``threads`` (default: the CPUs this process may run on),
and an OpenMP pool that waits passively unless the user chose otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from nanokv_cli import LLM, SamplingParams
from nanokv_cli.cli import app
from nanokv_cli.engine.config import EngineConfig

runner = CliRunner()
AFFINITY = len(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def restore_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_llm_threads_sets_torch_threads_and_generates(tiny):
    torch.set_num_threads(2)  # so that 1 is a change whatever this machine has
    llm = LLM(str(tiny), device="cpu", num_blocks=8, threads=1)
    assert llm.model_runner.threads == 1 and torch.get_num_threads() == 1
    [out] = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out["token_ids"]) == 4
    assert torch.get_num_threads() == 1  # nothing on the way reset it


def test_default_is_the_affinity_count(tiny):
    torch.set_num_threads(AFFINITY + 1)
    llm = LLM(str(tiny), device="cpu", num_blocks=8)
    assert llm.engine_config.threads is None  # resolved by the runner, not written back
    assert llm.model_runner.threads == AFFINITY == torch.get_num_threads()
    # Fewer threads already set (a benchmark's or a test's --threads 1) are kept.
    torch.set_num_threads(1)
    assert LLM(str(tiny), device="cpu", num_blocks=8).model_runner.threads == 1


def test_thread_count_is_shared_among_ranks_and_bad_counts_are_refused():
    assert EngineConfig(threads=1, tensor_parallel_size=2).thread_count() == 1
    assert EngineConfig(tensor_parallel_size=2).thread_count() == max(1, AFFINITY // 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be"):
            EngineConfig(threads=bad)


def test_cli_threads_option(tiny):
    result = runner.invoke(
        app,
        [
            "generate",
            "Hello",
            "--model",
            str(tiny),
            "--max-tokens",
            "3",
            "--threads",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    [out] = json.loads(result.stdout)
    assert len(out["token_ids"]) == 3
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("command", [["generate", "Hello"], ["replay", "prompts.txt"], ["serve"]])
@pytest.mark.parametrize("count", ["0", "-2"])
def test_cli_non_positive_threads_is_a_usage_error(command, count):
    result = runner.invoke(app, [*command, "--threads", count])
    assert result.exit_code == 2, result.output
    assert "--threads" in result.stderr and "Traceback" not in result.output


def _spin_count(env: dict[str, str]) -> str:
    code = "import nanokv_cli, os; print(os.environ['GOMP_SPINCOUNT'])"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_openmp_spins_briefly_unless_the_user_chose():
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert _spin_count(env) == "20000"
    assert _spin_count({**env, "GOMP_SPINCOUNT": "INFINITY"}) == "INFINITY"
