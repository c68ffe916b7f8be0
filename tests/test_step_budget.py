"""The step budget (engine/core/step_budget.py): while sequences decode, a step takes only the prompt
tokens that keep it under the latency target, at costs measured as the run goes; without
decodes, or without a target, the fixed token budget rules as before."""

from __future__ import annotations

import pytest

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.dry_run import DryRunExecutor, StepCostModel, VirtualClock
from nanokv_cli.engine.core.llm_engine import LLMEngine
from nanokv_cli.engine.core.step_budget import StepBudget
from nanokv_cli.engine.sampling_params import SamplingParams

# A CPU-like virtual machine: 8 ms per step, 1 ms per computed token (the default model on 2
# cores computes a prompt token in ~1 ms).
CPU_LIKE = StepCostModel(step_overhead=8e-3, per_token=1e-3, per_kv_token=0.0)


def burst_engine(target_ms: float | None, cost: StepCostModel = CPU_LIKE):
    config = EngineConfig(
        num_blocks=512,
        block_size=16,
        max_num_batched_tokens=4096,
        step_latency_target_ms=target_ms,
    )
    clock = VirtualClock()
    return LLMEngine(
        DryRunExecutor(config, clock=clock, cost_model=cost), config, clock=clock
    ), clock


def run_burst(target_ms: float | None, cost: StepCostModel = CPU_LIKE):
    """4 streams decoding, then 16 prompts of 150 tokens at once: the steps' virtual seconds
    while the streams decode, and each new request's first-token time."""
    engine, clock = burst_engine(target_ms, cost)
    streams = [
        engine.add_request([7, i] * 10, SamplingParams(max_tokens=300, ignore_eos=True))
        for i in range(4)
    ]
    for _ in range(20):
        engine.step()
    prompts = [
        engine.add_request([1000 + i] * 150, SamplingParams(max_tokens=8, ignore_eos=True))
        for i in range(16)
    ]
    first_token: dict[int, float] = {}
    gaps = []  # the first stream's (all four decode in every step)
    last = {s: clock() for s in streams}
    start = clock()
    while len(first_token) < len(prompts):
        for out in engine.step():
            now = clock()
            if out.seq_id in last:
                if out.seq_id == streams[0]:
                    gaps.append(now - last[out.seq_id])
                last[out.seq_id] = now
            elif out.seq_id not in first_token:
                first_token[out.seq_id] = now - start
        engine.check_invariants()
    return gaps, first_token


def test_without_a_target_the_burst_freezes_the_streams():
    gaps, _ = run_burst(None)
    assert max(gaps) > 2.0  # 16 x 150 prompt tokens in one step: ~2.4 virtual seconds


@pytest.mark.parametrize("target_ms", [30, 60])
def test_with_a_target_no_stream_waits_past_it_and_every_prompt_progresses(target_ms):
    gaps, first_token = run_burst(target_ms)
    target = target_ms / 1000
    # The first mixed steps take the opening chunk and correct it; from then on the measured
    # budget holds (the floor of 16 tokens lets a step run over only if the decodes alone
    # exceed the target).
    assert max(gaps[3:]) <= target * 1.05, gaps[:10]
    assert max(gaps) < 0.2
    assert len(first_token) == 16  # nobody starved: each prompt got its first token


def test_the_budget_follows_the_machine():
    # Twice the cost per token: the budget halves, the steps still meet the target.
    slow = StepCostModel(step_overhead=8e-3, per_token=2e-3, per_kv_token=0.0)
    gaps, first_token = run_burst(60, slow)
    assert max(gaps[3:]) <= 0.06 * 1.05 and len(first_token) == 16


def test_the_oldest_prompt_always_progresses_when_decodes_alone_exceed_the_target():
    budget = StepBudget(target_s=0.010)
    for _ in range(10):
        budget.observe(decode_rows=32, prompt_tokens=budget.prompt_tokens(32, 4096), seconds=0.05)
    assert budget.prompt_tokens(32, 4096) == budget.min_prompt_tokens
    assert budget.prompt_tokens(32, 5) == 5  # never past the fixed budget left


def test_steps_without_decodes_take_the_whole_budget():
    budget = StepBudget(target_s=0.010)
    budget.observe(decode_rows=4, prompt_tokens=64, seconds=1.0)
    assert budget.prompt_tokens(0, 4096) == 4096


def test_one_slow_step_moves_the_budget_at_most_twofold():
    budget = StepBudget(target_s=0.05)
    before = budget.prompt_tokens(4, 4096)
    budget.observe(4, before, seconds=50.0)  # another process held the CPU
    assert budget.prompt_tokens(4, 4096) >= before // 2


def test_a_bad_target_is_refused():
    for bad in (-1, float("nan"), "50", True):
        with pytest.raises(ValueError, match="step_latency_target_ms"):
            EngineConfig(step_latency_target_ms=bad)
    assert EngineConfig(step_latency_target_ms=0).step_latency_target_ms == 0
