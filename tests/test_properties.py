"""Randomized workloads: the books balance after every step, nothing leaks, and what is
generated does not depend on block size, caching, chunking or preemption."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engines import run_workload

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.dry_run import DryRunExecutor, VirtualClock
from nanokv_cli.engine.core.llm_engine import LLMEngine
from nanokv_cli.engine.sampling_params import SamplingParams


@st.composite
def workloads(draw):
    prefixes = draw(
        st.lists(st.lists(st.integers(0, 50), min_size=0, max_size=12), min_size=1, max_size=3)
    )
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(st.integers(0, 50), min_size=1 if not prefix else 0, max_size=10))
        arrival = draw(st.integers(0, 6))  # in steps
        requests.append((prefix + suffix, draw(st.integers(1, 8)), arrival))
    return requests


def generated(requests, **kw):
    """Each request's generated tokens, by request index."""
    outs = {}
    clock = VirtualClock()
    settings = EngineConfig(max_num_seqs=4, **kw)
    engine = LLMEngine(
        DryRunExecutor(settings, vocab_size=60, clock=clock),
        settings,
        eos_token_ids=[0],
        clock=clock,
    )
    ids = {}
    for i, (prompt, max_tokens, _) in enumerate(requests):
        ids[engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))] = i
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[ids[out.seq_id]] = out.token_ids
    return outs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workloads(),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.integers(3, 24),
    st.integers(1, 16),
    st.booleans(),
)
def test_invariants_hold_after_every_step(requests, block_size, num_blocks, max_batched, caching):
    run_workload(
        requests,
        block_size=block_size,
        num_blocks=num_blocks,
        max_batched=max_batched,
        prefix_caching=caching,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([1, 2, 4]), st.integers(1, 12))
def test_outputs_do_not_depend_on_cache_layout(requests, block_size, max_batched):
    # Make every request admissible in the smallest cache used below.
    requests = [(p, m, a) for p, m, a in requests if len(p) + m <= 24]
    if not requests:
        return
    reference = generated(requests, num_blocks=1000, block_size=16, max_num_batched_tokens=4096)
    tiny = generated(
        requests,
        num_blocks=-(-24 // block_size),
        block_size=block_size,
        max_num_batched_tokens=max_batched,
    )
    uncached = generated(
        requests,
        num_blocks=64,
        block_size=block_size,
        max_num_batched_tokens=max_batched,
        enable_prefix_caching=False,
    )
    assert tiny == reference == uncached
