"""The second KV tier's books (issue 46), model-free: evicted blocks go to the tier, a later
prompt restores them as their own hit source, only while restoring pays, within the tier's
bound; the setting's spelling; traces and random workloads; the Mooncake what-if."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cli import REPO, run_limited
from support.engines import dry_engine

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.dry_run import DryRunExecutor, StepCostModel, VirtualClock
from nanokv_cli.engine.core.events import (
    BlockRemoved,
    BlockRestored,
    CacheLookup,
    TierRemoved,
    TierStored,
)
from nanokv_cli.engine.core.llm_engine import LLMEngine
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.engine.tiers.books import TierBooks, token_digest

# A dry run's block of 4 tokens holds 4 x 23,040 bytes: 1 MiB is 11 of them.
TIER = "disk:/nonexistent/never-written:1MiB"


def run(engine, prompts, max_tokens=2):
    """Each prompt to completion, one after another; their outputs."""
    outs = []
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs.append(out)
        engine.check_invariants()
    return outs


def prompt(first, blocks, block_size=4):
    return [first * 1000 + i for i in range(blocks * block_size + 1)]


def test_an_evicted_prefix_comes_back_from_the_tier_as_restored_hits():
    engine = dry_engine(num_blocks=8, kv_tier=TIER)
    events = []
    engine.events.subscribe(events.append)
    a = prompt(1, 5)
    run(engine, [a, prompt(2, 5), prompt(3, 5)])  # they push a's blocks out of the 8 blocks
    stored = {e.block_hash for e in events if type(e) is TierStored}
    removed = {e.block_hash for e in events if type(e) is BlockRemoved}
    assert stored and stored == removed  # every evicted content went to the tier
    events.clear()
    (out,) = run(engine, [a])
    restored = [e for e in events if type(e) is BlockRestored]
    assert len(restored) == 5 and {e.medium for e in restored} == {"disk"}
    stats = engine.block_manager.stats
    assert stats.restored_hits == 20 and out.num_restored_tokens == 20
    assert out.num_cached_tokens == 20  # every full block before the last token
    lookup = [e for e in events if type(e) is CacheLookup][-1]
    assert lookup.num_hit_tokens == 20 and lookup.miss_block == 5
    assert stats.hits == stats.shared_hits + stats.revived_hits + stats.copied_hits + 20
    assert sum(stats.miss_tokens.values()) == stats.queries - stats.hits + (
        stats.readmission_queries - stats.readmission_hits
    )


def test_restored_blocks_are_hits_for_later_prompts_and_equal_answers():
    tiered = dry_engine(num_blocks=8, kv_tier=TIER)
    plain = dry_engine(num_blocks=64)
    prompts = [prompt(1, 5), prompt(2, 5), prompt(3, 5), prompt(1, 5), prompt(1, 5)]
    got = [o.token_ids for o in run(tiered, prompts, max_tokens=2)]
    want = [o.token_ids for o in run(plain, prompts, max_tokens=2)]
    assert got == want
    # The fourth prompt restored the first's blocks; the fifth found them in the cache.
    assert tiered.block_manager.stats.restored_hits == 20
    assert tiered.block_manager.stats.hits == plain.block_manager.stats.hits


def test_no_restore_when_reading_is_slower_than_recomputing():
    # 1e-6 GB/s: a block takes seconds to read, far more than its 4 tokens to compute.
    engine = dry_engine(num_blocks=8, kv_tier=TIER, kv_tier_bandwidth=1e-6)
    assert not engine.tier.pays()
    a = prompt(1, 5)
    run(engine, [a, prompt(2, 5), prompt(3, 5)])
    (out,) = run(engine, [a])
    stats = engine.block_manager.stats
    assert stats.restored_hits == 0 and out.num_cached_tokens == 0
    assert stats.miss_tokens["evicted"] > 0


def test_the_crossover_is_block_bytes_over_bandwidth_against_recompute():
    config = EngineConfig(num_blocks=8, block_size=64, kv_tier="host:1GiB")
    cost = StepCostModel(per_token=2e-5)
    books = TierBooks(DryRunExecutor(config, cost_model=cost).tier, 64)
    # 64 tokens x 23,040 bytes at 8.8 GB/s: 168 us against 64 x 20 us = 1,280 us.
    assert books.restore_s_per_block == pytest.approx(64 * 23_040 / 8.8e9)
    assert books.pays()
    slow = EngineConfig(num_blocks=8, block_size=64, kv_tier="host:1GiB", kv_tier_bandwidth=0.5)
    assert not TierBooks(DryRunExecutor(slow, cost_model=cost).tier, 64).pays()


def test_the_tier_keeps_its_bound_and_lets_the_least_recently_used_go():
    engine = dry_engine(num_blocks=8, kv_tier="host:368640")  # 4 blocks of 4 tokens
    events = []
    engine.events.subscribe(events.append)
    run(engine, [prompt(p, 5) for p in range(1, 6)])
    tier = engine.tier
    assert tier.capacity_blocks == 4 and tier.num_blocks == 4
    dropped = [e.block_hash for e in events if type(e) is TierRemoved]
    assert dropped and all(h not in tier for h in dropped)
    assert tier.dropped == len(dropped)
    # The newest stored are the ones held.
    stored = [e.block_hash for e in events if type(e) is TierStored]
    assert set(stored[-4:]) == {h for h in stored if h in tier}


def test_a_hash_whose_tokens_differ_is_no_hit():
    config = EngineConfig(num_blocks=4, block_size=4, kv_tier=TIER)
    books = TierBooks(DryRunExecutor(config).tier, 4)
    books.store(0, 123, [1, 2, 3, 4])
    assert books.holds(123, [1, 2, 3, 4]) and not books.holds(123, [1, 2, 3, 5])
    assert books.fetch(123, [9, 9, 9, 9]) is None and 123 in books
    assert token_digest([1, 2, 3, 4]) == token_digest(
        bytes(b"".join(t.to_bytes(8, "little") for t in (1, 2, 3, 4)))
    )


def test_reset_prefix_cache_forgets_the_tier_too():
    engine = dry_engine(num_blocks=8, kv_tier=TIER)
    run(engine, [prompt(1, 5), prompt(2, 5)])
    assert engine.tier.num_blocks
    engine.block_manager.reset_prefix_cache()
    assert engine.tier.num_blocks == 0


@pytest.mark.parametrize(
    "value,match",
    [
        ("disk:/x", "SIZE"),
        ("ssd:1GiB", "unknown tier medium"),
        ("host:/x:1GiB", "no path"),
        ("disk:/x:0", "above zero"),
    ],
)
def test_a_bad_spelling_is_refused_naming_the_spelling(value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(kv_tier=value)


def test_settings_checked_once():
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(kv_tier="disk:/x:1GiB", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_tier_bandwidth"):
        EngineConfig(kv_tier_bandwidth=0)
    config = EngineConfig(kv_tier="disk:/x:1GiB")
    assert config.tier_spec.size_bytes == 1 << 30 and config.tier_bandwidth() == 1.6e9
    assert config.describe()["kv_tier"] == "disk:/x:1GiB"
    assert "kv_tier" not in EngineConfig().describe()  # rows without a tier read as before
    with pytest.raises(ValueError, match="holds no block"):
        DryRunExecutor(EngineConfig(num_blocks=4, block_size=4, kv_tier="host:1KiB"))


def test_the_flags_are_offered_to_every_engine_command():
    for command in ("generate", "replay", "serve"):
        text = run_limited([command, "--help"]).stdout
        assert "--kv-tier " in text and "--kv-tier-bandwidth" in text, command


@st.composite
def workloads(draw):
    prefixes = draw(
        st.lists(st.lists(st.integers(1, 50), min_size=4, max_size=14), min_size=1, max_size=4)
    )
    requests = []
    for _ in range(draw(st.integers(2, 10))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(st.integers(1, 50), min_size=0, max_size=6))
        requests.append((prefix + suffix, draw(st.integers(1, 5)), draw(st.integers(0, 8))))
    return requests


def answers(requests, check=False, **config):
    clock = VirtualClock()
    settings = EngineConfig(max_num_seqs=3, max_num_batched_tokens=8, **config)
    engine = LLMEngine(DryRunExecutor(settings, vocab_size=60, clock=clock), settings, clock=clock)
    pending, outs, step = sorted(enumerate(requests), key=lambda r: r[1][2]), {}, 0
    ids = {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (tokens, max_tokens, _) = pending.pop(0)
            ids[engine.add_request(tokens, SamplingParams(max_tokens=max_tokens))] = i
        for out in engine.step():
            if out.finished:
                outs[ids[out.seq_id]] = out.token_ids
        if check:
            engine.check_invariants()
        step += 1
    engine.check_invariants()
    return outs, engine


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([1, 2, 4]), st.integers(0, 8), st.sampled_from([3, 12]))
def test_random_workloads_balance_and_answer_as_without_a_tier(
    requests, block_size, spare_blocks, tier_blocks
):
    # A cache that fits the largest request and little more: it evicts.
    need = max(-(-(len(p) + n - 1) // block_size) for p, n, _ in requests)
    num_blocks = need + spare_blocks
    size = tier_blocks * block_size * 23_040
    got, engine = answers(
        requests, check=True, block_size=block_size, num_blocks=num_blocks,
        kv_tier=f"host:{size}",
    )  # fmt: skip
    want, _ = answers(requests, block_size=block_size, num_blocks=num_blocks)
    assert got == want
    assert engine.tier.num_blocks <= tier_blocks


def test_a_trace_records_tier_events_and_reads_back(tmp_path):
    from nanokv_cli.trace.reader import TraceReader

    path = tmp_path / "run.trace"
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt_token_ids": prompt(p, 5)} for p in (1, 2, 3, 1)]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    result = run_limited(
        ["replay", prompts, "--dry-run", "--block-size", "4", "--num-blocks", "8",
         "--rate", "0.01", "--max-tokens", "2", "--kv-tier", TIER, "--record", path, "--json"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["restored_hit_tokens"] == 20
    reader = TraceReader(path)
    kinds = {type(e).__name__ for e in reader.events()}
    assert {"BlockRestored", "TierStored"} <= kinds
    assert reader.summary()["cache"]["restored_hit_tokens"] == 20


def test_mooncake_with_a_small_cache_and_a_disk_tier_reaches_the_never_evicting_bound():
    """Done-when (a): 1,000 requests of the bundled trace, a device cache of 1,000 blocks
    (it evicts ~25,000 times) and a disk tier as big as the working set."""
    trace = REPO / "examples/traces/mooncake_conversation_trace.jsonl"
    args = ["replay", trace, "--dry-run", "--block-size", "512", "--num-blocks", "1000",
            "--limit", "1000", "--json"]  # fmt: skip
    result = run_limited([*args, "--kv-tier", "disk:/nonexistent:4TiB"], timeout=300)
    assert result.returncode == 0, result.stderr
    tiered = json.loads(result.stdout)
    plain = json.loads(run_limited(args, timeout=300).stdout)
    bound = tiered["infinite_cache_hit_rate"]
    assert plain["evictions"] > 10_000 and plain["hit_rate"] < 0.5 * bound
    assert tiered["hit_rate"] >= 0.99 * bound
    restored = tiered["restored_hit_tokens"]
    assert restored > tiered["cache_hits"] / 2
    sources = ("shared_hit_tokens", "revived_hit_tokens", "copied_hit_tokens")
    assert tiered["cache_hits"] == restored + sum(tiered[k] for k in sources)
    by_tier = tiered["hit_rate_by_tier"]
    assert by_tier["disk"] == pytest.approx(restored / tiered["cache_queries"])
    assert by_tier["device"] + by_tier["disk"] == pytest.approx(tiered["hit_rate"])
    assert tiered["tier_prefill_tokens_saved"] == restored and tiered["tier_blocks"] > 0


def test_advise_ranks_a_disk_tier_among_its_changes():
    trace = REPO / "examples/traces/mooncake_conversation_trace.jsonl"
    args = ["advise", trace, "--block-size", "512", "--num-blocks", "500", "--limit", "200"]
    result = run_limited([*args, "--json"], timeout=300)
    assert result.returncode == 0, result.stderr
    changes = json.loads(result.stdout)["changes"]
    (tier,) = [c for c in changes if c["kind"] == "tier"]
    assert tier["change"].startswith("add a disk tier of ") and "--kv-tier disk:" in tier["change"]
    bound = next(c for c in changes if c["kind"] == "bound")
    assert tier["gain"] > 0 and tier["gain"] >= 0.95 * bound["gain"]


def test_shutdown_stores_what_the_cache_still_holds():
    from nanokv_cli.engine.core.tier_hits import flush

    engine = dry_engine(num_blocks=64, kv_tier=TIER)
    events = []
    engine.events.subscribe(events.append)
    run(engine, [prompt(1, 5)])
    assert engine.tier.num_blocks == 0  # nothing was evicted
    # Its five full blocks (the answer's two tokens fill none), each once.
    assert flush(engine.block_manager) == 5 == engine.tier.num_blocks
    assert sum(type(e) is TierStored for e in events) == 5
    assert flush(engine.block_manager) == 0
