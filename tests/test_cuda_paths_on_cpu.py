"""The CUDA-only code paths' logic, forced on CPU (issue 44): no GPU is needed to catch a crash
that every CUDA run would meet.

- The memory-sizing warm-up: a CUDA run without ``--num-blocks``/``--kv-cache-memory`` runs
  the largest prefill a step may hold before the cache exists, to measure its activations.
  Here torch.cuda's memory figures are stood in for and the CPU runs that warm-up.
- SDPA's output in float32 on CUDA is not contiguous (heads-first); the decode path took a
  ``.view`` of it. Here SDPA is made to answer with the same numbers laid out that way.
"""

from dataclasses import replace

import torch
import torch.nn.functional as F

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.runner import kv_cache, model_runner
from nanokv_cli.engine.runner.model_runner import ModelRunner
from nanokv_cli.engine.runner.run_plan import resolve_plan
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.engine.sequence import Sequence


def settings(**kw) -> EngineConfig:
    base = {"block_size": 16, "num_blocks": 64, "device": "cpu", "max_model_len": 256}
    return EngineConfig(**{**base, "threads": 1, **kw})


def greedy(runner: ModelRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens of each prompt, prompts in one step, then batched decode steps."""
    bs, free = runner.block_size, iter(range(runner.num_blocks))
    seqs = [Sequence(p, SamplingParams(temperature=0.0), block_size=bs) for p in prompts]
    for _ in range(n):
        for s in seqs:
            s.num_scheduled_tokens = s.num_tokens - s.num_cached_tokens
            while len(s.block_table) * bs < s.num_tokens:
                s.block_table.append(next(free))
        for s, token in zip(seqs, runner.run(seqs)):
            s.num_cached_tokens = s.num_tokens
            s.append_token(token)
    return [s.completion_token_ids for s in seqs]


PROMPTS = [[(i * 37 + salt * 11) % 290 + 3 for i in range(n)] for salt, n in enumerate([9, 23, 40])]


def test_cuda_sizing_warmup_runs_before_the_cache_exists(tiny_weights, monkeypatch):
    """The warm-up runs a step through ``_prepare`` (which reads ``_offsets``) and ``_forward``
    (which reads ``graphs``) before the cache is allocated; the cache is then sized from what
    the GPU has left after it, and the runner answers as one given a size."""
    config, weights = tiny_weights("llama")[:2]
    total, free, peak, current = 16 << 20, 15 << 20, 3 << 20, 1 << 20
    stats = {"allocated_bytes.all.peak": peak, "allocated_bytes.all.current": current}
    for name, stand_in in {
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda: None,
        "mem_get_info": lambda: (free, total),
        "memory_stats": lambda: stats,
    }.items():
        monkeypatch.setattr(torch.cuda, name, stand_in)
    # The CUDA sizing branch, taken on this CPU: no cache size given.
    monkeypatch.setattr(model_runner, "needs_gpu_budget", lambda shape, plan: True)
    monkeypatch.setattr(kv_cache, "needs_gpu_budget", lambda shape, plan: True)
    warmups = []
    real_warmup = ModelRunner._warmup
    monkeypatch.setattr(ModelRunner, "_warmup", lambda self: warmups.append(real_warmup(self)))

    unsized = settings(num_blocks=None, max_num_batched_tokens=256)
    sized = ModelRunner(config, weights, resolve_plan(config, unsized))
    assert len(warmups) == 1
    budget = int(total * 0.9 - (total - free) - (peak - current))
    assert sized.num_blocks == budget // sized.block_bytes
    assert sized.kv_cache.shape[2] == sized.num_blocks  # the real cache, bound after
    assert all(a.k_cache.shape[0] == sized.num_blocks for a in sized.attention_layers)
    given = ModelRunner(config, weights, resolve_plan(config, settings()))
    assert greedy(sized, PROMPTS, 4) == greedy(given, PROMPTS, 4)


def _heads_first_sdpa(real):
    """SDPA with CUDA float32's output layout: the same values, [n, kv_heads, group, hd] over
    memory ordered [n, group, kv_heads, hd], so ``.view(n, heads, hd)`` cannot see it."""

    def sdpa(*args, **kw):
        o = real(*args, **kw)
        if o.dim() == 4:
            o = o.transpose(1, 2).contiguous().transpose(1, 2)
            assert not o.is_contiguous()
        return o

    return sdpa


def test_float32_decode_through_sdpa_takes_a_non_contiguous_output(tiny_weights, monkeypatch):
    """The SDPA back end in float32, as a CUDA run without flash-attn had it: decode steps go
    through SDPA in length buckets and must reshape its output, not view it."""
    config, weights = tiny_weights("llama")[:2]
    assert (
        config.num_key_value_heads > 1 and config.num_attention_heads > config.num_key_value_heads
    )
    engine = settings()
    plan = resolve_plan(config, engine)
    expected = greedy(ModelRunner(config, weights, plan), PROMPTS, 5)
    sdpa_plan = replace(plan, attention="sdpa", fused_decoder=False)
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", _heads_first_sdpa(F.scaled_dot_product_attention)
    )
    runner = ModelRunner(config, weights, sdpa_plan)
    assert greedy(runner, PROMPTS, 5) == expected
