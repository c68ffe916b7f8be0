"""Say what was taken (issue #45 item 5): the KV cache's size and what decided it, one line at
start-up from ``generate``, ``replay`` and ``serve`` (on stderr, piped too); and the default CPU
cache sized by what the model can use, within the memory budget, not by free memory alone."""

from __future__ import annotations

import re
import signal

import pytest
import torch
from support.cli import MODEL_MEMORY, run_limited

from nanokv_cli.engine.config import EngineConfig, ModelConfig
from nanokv_cli.engine.runner import kv_cache
from nanokv_cli.engine.runner.kv_cache import CacheShape, count_blocks
from nanokv_cli.engine.runner.memory import MemoryLimit
from nanokv_cli.engine.runner.run_plan import resolve_plan
from nanokv_cli.serve.process import ServerProcess

GiB, MiB = 1 << 30, 1 << 20
# SmolLM2-135M's cache: 30 layers, 3 KV heads of 64, float16 K/V (the default model's).
SMOLLM2 = CacheShape(30, 3, 64, 256, torch.float16, torch.device("cpu"))
# Its sizes, as a run plan reads them: 8,192 positions.
SMOLLM2_MODEL = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, max_position_embeddings=8192)
BLOCK = SMOLLM2.block_bytes  # 5.6 MiB
LINE = re.compile(
    r"^nanokv: KV cache ([\d,]+) blocks × ([\d,]+) tokens = ([\d,]+) tokens, "
    r"[\d.]+ (?:KiB|MiB|GiB) \w+, from (.+)$"
)


def sized(monkeypatch, free: int | None, **settings) -> kv_cache.CacheSize:
    limit = None if free is None else MemoryLimit(free, "available memory")
    monkeypatch.setattr(kv_cache, "memory_limit", lambda device: limit)
    return count_blocks(
        SMOLLM2, resolve_plan(SMOLLM2_MODEL, EngineConfig(device="cpu", **settings))
    )


def test_the_default_holds_what_the_model_can_use_not_what_is_free(monkeypatch):
    # A roomy machine: eight of the model's longest sequences, not a quarter of 64 GiB.
    n, source = sized(monkeypatch, 64 * GiB)
    assert n == 8 * 8192 // 256 and n * BLOCK < 1.5 * GiB
    assert source == (
        "room for 8 sequences of the model's 8,192 tokens (the default), within the 4.0 GiB cap "
        "on a quarter of the 64.0 GiB this process may take (available memory)"
    )
    # Fewer sequences allowed: fewer blocks, and the flag that said so.
    n, source = sized(monkeypatch, 64 * GiB, max_num_seqs=2)
    assert n == 64 and source.startswith("room for 2 sequences of the model's 8,192 tokens")
    assert "(--max-num-seqs 2)" in source


@pytest.mark.parametrize(
    "free, blocks, source",
    [
        (2 * GiB, 512 * MiB // BLOCK, "a quarter of the 2.0 GiB this process may take"),
        (600 * MiB, 256 * MiB // BLOCK, "the 256.0 MiB floor under a quarter of the 600.0 MiB"),
        (400 * MiB, 200 * MiB // BLOCK, "half of the 400.0 MiB this process may take"),
        (None, GiB // BLOCK, "the default 1.0 GiB (free memory is unknown)"),
    ],
)
def test_a_tight_budget_caps_it_and_says_how(monkeypatch, free, blocks, source):
    n, said = sized(monkeypatch, free)
    assert n == blocks and said.startswith(source), said


def test_a_size_given_is_named_by_its_flag(monkeypatch):
    assert sized(monkeypatch, 64 * GiB, num_blocks=10) == (10, "--num-blocks")
    n, source = sized(monkeypatch, 64 * GiB, kv_cache_memory=GiB)
    assert n == GiB // BLOCK and source == "--kv-cache-memory 1.0 GiB"
    # More than the model could ever use: the flag's budget, capped by --max-num-seqs.
    n, source = sized(monkeypatch, 64 * GiB, kv_cache_memory=GiB, max_num_seqs=1)
    assert n == 32 and source == (
        "room for 1 sequence of the model's 8,192 tokens (--max-num-seqs 1), "
        "within --kv-cache-memory 1.0 GiB"
    )


def kv_lines(stderr: str) -> list[re.Match]:
    lines = [line for line in stderr.splitlines() if "KV cache" in line]
    assert len(lines) == 1, stderr  # one line
    return [LINE.match(lines[0])]


def test_generate_and_replay_say_it_when_piped(tiny, tmp_path):
    r = run_limited(["generate", "Hello", "--model", tiny, "--max-tokens", "2"], MODEL_MEMORY)
    assert r.returncode == 0, r.stderr
    [m] = kv_lines(r.stderr)
    assert m, r.stderr
    blocks, size, tokens = (int(g.replace(",", "")) for g in m.groups()[:3])
    assert blocks * size == tokens and size == 256
    # Under ulimit -v, the limit that decided it is named.
    assert "ulimit -v" in m.group(4), m.group(4)

    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    args = ["replay", prompts, "--model", tiny, "--max-tokens", "2", "--num-blocks", "12"]
    r = run_limited([*args, "--block-size", "16", "--json"], MODEL_MEMORY)
    assert r.returncode == 0, r.stderr
    [m] = kv_lines(r.stderr)
    assert m.groups()[:3] == ("12", "16", "192") and m.group(4) == "--num-blocks"


def test_serve_says_it_before_it_listens(tiny, tmp_path):
    args = ["--model", str(tiny), "--kv-cache-memory", "1MiB", "--block-size", "16", "--no-live"]
    srv = ServerProcess([*args, "--port", "0"], tmp_path)
    try:
        log = srv.log()
    finally:
        srv.send_signal(signal.SIGTERM)
        assert srv.wait() == 0
    [m] = kv_lines(log)
    assert m and m.group(4) == "--kv-cache-memory 1.0 MiB"
    assert log.index("KV cache") < log.index("serving ")
