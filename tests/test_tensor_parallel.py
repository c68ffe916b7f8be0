"""Tensor parallelism through the public API: ``LLM(tensor_parallel_size=N)`` on CPU with gloo.

Two (or three) ranks on a two-core machine: these tests check correctness and the life cycle
of the worker processes, not speed. Greedy float32 tokens must equal one rank's (the contract
stated in test_llm.py; logits differ only by the order of the all-reduce sums).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.models import make_tiny_model

from nanokv_cli import LLM, SamplingParams
from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.events import BlockCopied, SequencePreempted
from nanokv_cli.engine.model.loader import load_model
from nanokv_cli.engine.parallel.distributed import TensorParallelError, launch
from nanokv_cli.engine.sequence import Sequence

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ATOL = 1e-4
# Small blocks and cache, short token budget: chunked prefill, prefix hits and preemption all
# happen, so the workers' mirrors of block tables are rebuilt, extended and replaced.
SMALL = dict(dtype="float32", device="cpu", block_size=4, num_blocks=20, max_num_batched_tokens=32)
ROOMY = dict(SMALL, num_blocks=128)  # for long generations
# Ranks share two cores: one thread each keeps them from fighting over them.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cleanup():
    """Shut down the LLMs a test hands in, even when it fails half-way: a live group would
    make every later LLM in this process refuse to start."""
    llms = []
    yield llms.append
    for llm in llms:
        llm.shutdown()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_models")


@cache
def model_dir(arch: str, root: Path, **overrides) -> str:
    name = "-".join([arch, *(f"{k}{v}" for k, v in sorted(overrides.items()))])
    return str(make_tiny_model(arch, root / name, **overrides))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 300, (13,), generator=g).tolist()
    return [prefix + torch.randint(3, 300, (4 + 5 * i,), generator=g).tolist() for i in range(4)]


def greedy(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [out["token_ids"] for out in llm.generate(batch, params)]


def step_logits(executor, block_size: int, prompt: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill of ``prompt`` and of one decode step after it, in blocks 0, 1, ..."""
    seq = Sequence(prompt, block_size=block_size)
    seq.block_table = list(range(len(prompt) // block_size + 1))
    seq.num_scheduled_tokens = len(prompt)
    prefill = executor.run_logits([seq])
    seq.num_cached_tokens = len(prompt)
    seq.append_token(int(prefill[0].argmax()))
    seq.num_scheduled_tokens = 1
    decode = executor.run_logits([seq])
    executor.forget(seq.seq_id)
    return [prefill, decode]


def children() -> list:
    return multiprocessing.active_children()


def pid_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def port_is_free(port: int) -> bool:
    """Whether a new server could listen on ``port`` (closed connections may linger in
    TIME_WAIT, which SO_REUSEADDR allows; a listening socket does not)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


# -- parity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_generate_the_tokens_of_one(root, arch):
    """Qwen3 adds q/k norms over sharded heads; both have untied heads and a padded vocab."""
    path = model_dir(arch, root)
    one = LLM(path, **SMALL)
    expected_logits = step_logits(one.model_runner, 4, prompts()[0])
    expected = greedy(one, prompts())
    with LLM(path, tensor_parallel_size=2, **SMALL) as two:
        assert two.model_runner.kv_cache.shape[4] == 1  # 2 KV heads over 2 ranks
        assert two.engine.num_blocks == one.engine.num_blocks
        for got, want in zip(step_logits(two.executor, 4, prompts()[0]), expected_logits):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        preempted = []
        two.engine.events.subscribe(
            lambda e: preempted.append(e) if isinstance(e, SequencePreempted) else None
        )
        assert greedy(two, prompts()) == expected
        assert preempted, "the cache was meant to be too small for the batch"
        copied = []  # token-granular hits: every rank copies the same K/V before the step
        two.engine.events.subscribe(lambda e: copied.append(e) if type(e) is BlockCopied else 0)
        again = two.generate(prompts(), GREEDY)  # prefix hits: block tables start shared
        assert [o["token_ids"] for o in again] == expected
        assert any(o["num_cached_tokens"] for o in again) and copied


def test_steps_larger_than_one_broadcast(root):
    """Two 300-token prompts in one step: the step message needs a second broadcast."""
    path = model_dir("llama", root)
    options = dict(dtype="float32", device="cpu", block_size=16, num_blocks=48)
    batch = [[(i * 7 + k) % 290 + 3 for i in range(300)] for k in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    expected = greedy(LLM(path, **options), batch, params)
    with LLM(path, tensor_parallel_size=2, **options) as two:
        assert greedy(two, batch, params) == expected


def test_default_model_on_three_ranks(tmp_path):
    """SmolLM2-135M has 9 heads and 3 KV heads: it splits over 3 ranks, not over 2."""
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    options = dict(dtype="float32", device="cpu", block_size=16, num_blocks=16)
    expected = LLM(**options).generate([prompt], params)[0]
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\), num_key_value_heads \(3\)"):
        LLM(tensor_parallel_size=2, **options)
    assert not children()
    with LLM(tensor_parallel_size=3, **options) as three:
        assert len(three.executor.worker_pids) == 2
        got = three.generate([prompt], params)[0]
    assert got["token_ids"] == expected["token_ids"]
    assert got["text"] == expected["text"]


# -- life cycle ---------------------------------------------------------------------------------


def test_shutdown_leaves_no_process_port_or_group(root, cleanup):
    path = model_dir("llama", root)
    shm_before = set(os.listdir("/dev/shm"))
    llm = LLM(path, tensor_parallel_size=2, **SMALL)
    cleanup(llm)
    pids, port = llm.executor.worker_pids, llm.executor.port
    assert [p.pid for p in children()] == pids
    assert not port_is_free(port)
    with pytest.raises(ValueError, match="still running"):
        LLM(path, **SMALL)  # the layers would shard themselves over the live group
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert not children()
    assert not any(pid_exists(pid) for pid in pids)
    assert port_is_free(port)
    assert not dist.is_initialized()
    assert set(os.listdir("/dev/shm")) <= shm_before
    with pytest.raises(TensorParallelError, match="shut down"):
        llm.generate([[5, 6, 7]], GREEDY)
    assert greedy(LLM(path, **SMALL), [[5, 6, 7]])  # one rank works again in this process


def test_killed_worker_is_reported_not_waited_for(root, cleanup):
    path = model_dir("llama", root)
    llm = LLM(path, tensor_parallel_size=2, **ROOMY)
    cleanup(llm)
    (pid,) = llm.executor.worker_pids
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = llm.stream([[5, 6, 7, 8]], params)
    next(stream)
    # Freeze the worker so rank 0 blocks in a collective of the next step, then kill it there.
    os.kill(pid, signal.SIGSTOP)
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(TensorParallelError, match="worker rank 1 was killed by SIGKILL"):
        for _ in stream:
            pass
    assert not children()
    assert not dist.is_initialized()
    with pytest.raises(TensorParallelError, match="shut down"):
        llm.generate([[5, 6, 7]], GREEDY)


def test_worker_error_is_raised_on_rank_zero(root, tmp_path):
    """Workers load the model themselves: one that cannot is reported with its own error."""
    path = Path(model_dir("llama", root))
    loaded = load_model(path)
    gone = tmp_path / "moved-away"
    shutil.copytree(path, gone)
    shutil.rmtree(gone)
    options = dict(SMALL, max_model_len=64)
    del options["max_num_batched_tokens"]
    settings = EngineConfig(**options, tensor_parallel_size=2)
    with pytest.raises(TensorParallelError) as info:
        launch(loaded.config, loaded.weights, str(gone), settings)
    message = str(info.value)
    assert "worker rank 1 failed: ModelLoadError" in message
    assert "moved-away" in message
    assert not children()
    assert not dist.is_initialized()


@pytest.mark.parametrize("ending", ["ctrl-c", "exit"])
def test_interrupt_and_exit_stop_the_workers(root, tmp_path, ending):
    """Nobody calls shutdown(): interpreter exit does it, after a Ctrl-C (SIGINT to the whole
    process group, as a terminal sends it, most likely mid-step) or a plain exit."""
    script = tmp_path / "tp_script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            import torch
            from nanokv_cli import LLM, SamplingParams

            if __name__ == "__main__":
                torch.set_num_threads(1)
                llm = LLM({model_dir("llama", root)!r}, tensor_parallel_size=2, **{ROOMY!r})
                print(*llm.executor.worker_pids, flush=True)
                llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))
                if sys.argv[1] == "exit":
                    sys.exit(0)
                print("generating", flush=True)
                params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
                while True:
                    llm.generate([[5, 6, 7, 8]], params)
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script), ending],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, like a shell job
    )
    try:
        worker = int(proc.stdout.readline())
        if ending == "ctrl-c":
            assert proc.stdout.readline() == "generating\n"
            os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if ending == "ctrl-c":
        assert "KeyboardInterrupt" in stderr
    else:
        assert proc.returncode == 0, stderr
    deadline = time.monotonic() + 10
    while pid_exists(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_exists(worker)


# -- shapes and arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"num_key_value_heads": 1}, r"num_key_value_heads \(1\) is not divisible by 2"),
        ({"vocab_size": 321}, r"vocab_size \(321\) is not divisible by 2"),
        (
            {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3},
            r"num_attention_heads \(3\), num_key_value_heads \(3\) are not divisible by 2",
        ),
    ],
)
def test_indivisible_shapes_are_named(root, overrides, named):
    path = model_dir("llama", root, **overrides)
    with pytest.raises(ValueError, match=named):
        LLM(path, tensor_parallel_size=2, **SMALL)
    assert not children()
    assert not dist.is_initialized()


@pytest.mark.parametrize("size", [0, -1, 1.5])
def test_bad_sizes_are_rejected(size):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tensor_parallel_size=size)


# -- an existing process group (as torchrun makes) ----------------------------------------------


def test_launcher_world_size_must_match(monkeypatch):
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="1", RANK="0", WORLD_SIZE="4")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="launched as one of 4 ranks.*tensor_parallel_size=4"):
        LLM(tensor_parallel_size=2)
    assert not dist.is_initialized()


def test_cli_flag_runs_two_ranks_and_reports_indivisible_shapes(root, cleanup):
    from typer.testing import CliRunner

    from nanokv_cli.cli import app

    path = model_dir("llama", root)
    args = [
        "generate",
        "hello",
        "--model",
        path,
        "--max-tokens",
        "4",
        "--no-live",
        "--json",
        "--dtype",
        "float32",
        "--ignore-eos",
        "--num-blocks",
        "16",
        "--block-size",
        "16",
    ]
    one = CliRunner().invoke(app, args)
    two = CliRunner().invoke(app, args + ["--tensor-parallel-size", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    import json

    def tokens(result):
        return [r["token_ids"] for r in json.loads(result.stdout)]

    assert len(tokens(one)[0]) == 4 and tokens(one) == tokens(two)
    bad = CliRunner().invoke(app, args + ["--tensor-parallel-size", "3"])
    assert bad.exit_code == 1
    assert "not divisible by 3" in bad.stderr and "Traceback" not in bad.output
    assert not children()
