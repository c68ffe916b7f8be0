"""The fleet what-if (``replay --dry-run --instances N --router R``): routing policies on
workloads whose hits can be counted by hand, the ``elsewhere`` miss class, the one-cache
bound, one instance against the plain dry run, and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nanokv_cli.cli import app
from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.run.loop import Request
from nanokv_cli.whatif.fleet import ROUTERS, Fleet, block_hashes
from nanokv_cli.whatif.fleet_report import run_fleet, what_if

MOONCAKE = Path(__file__).resolve().parents[1] / "examples/traces/mooncake_conversation_trace.jsonl"
BS = 16  # tokens per block
PREFIX_BLOCKS = 4  # full blocks each group's prompts share
SUFFIX = 5  # tokens after the shared prefix, unique per prompt: the last token's block
PER_GROUP = 4
ORDER = "ABBAABBA"  # round-robin over 2 instances sends each group to both

runner = CliRunner()


def group_prompt(group: str, k: int, suffix: int = SUFFIX) -> list[int]:
    base = 1_000 if group == "A" else 5_000
    prefix = list(range(base, base + PREFIX_BLOCKS * BS))
    # Distinct first tokens: no token-granular copy between suffixes.
    return prefix + [20_000 + 1_000 * k + j for j in range(suffix)]


def grouped_requests(order: str = ORDER, gap: float = 10.0, suffix: int = SUFFIX) -> list[Request]:
    """Prompts of two groups with distinct shared prefixes, ``gap`` virtual seconds apart
    (each finishes long before the next arrives)."""
    params = SamplingParams(max_tokens=2)
    return [
        Request(group_prompt(g, k, suffix), params, arrival_time=k * gap, tag=k + 1)
        for k, g in enumerate(order)
    ]


def config(num_blocks: int = 64) -> EngineConfig:
    return EngineConfig(block_size=BS, num_blocks=num_blocks)


def prefix_tokens() -> int:
    return PREFIX_BLOCKS * BS


# -- policies on a workload counted by hand ------------------------------------------------------


def test_prefix_routing_reaches_the_one_cache_bound():
    r = what_if(grouped_requests(), config(), 2, "prefix")
    queries = len(ORDER) * (prefix_tokens() + SUFFIX)
    # One cache: each group's prefix is computed once, then hit by the group's other prompts.
    assert r["one_cache"]["cache_hits"] == 2 * (PER_GROUP - 1) * prefix_tokens()
    assert r["cache_queries"] == r["one_cache"]["cache_queries"] == queries
    assert r["cache_hits"] == r["one_cache"]["cache_hits"]
    assert r["hit_rate"] == r["one_cache_hit_rate"]
    # Each group went to one instance: the first A and the first B took turns.
    assert [p["routed"] for p in r["per_instance"]] == [PER_GROUP, PER_GROUP]
    assert r["elsewhere_tokens"] == 0
    assert r["overlap_score_weight"] == 1.0


def test_round_robin_splits_each_prefix_and_loses_one_computation_per_group_and_instance():
    r = what_if(grouped_requests(), config(), 2, "round-robin")
    # Every instance sees both groups: each prefix is computed once per instance.
    per_instance_hits = 2 * (PER_GROUP // 2 - 1) * prefix_tokens()
    assert [p["cache_hits"] for p in r["per_instance"]] == [per_instance_hits] * 2
    lost = r["one_cache"]["cache_hits"] - r["cache_hits"]
    assert lost == 2 * prefix_tokens()  # one extra computation of each group's prefix
    # Those extra computations were cold here but cached on the other instance, exactly.
    assert r["elsewhere_tokens"] == lost
    assert r["elsewhere_by_reason"] == {"cold": lost}
    assert [p["elsewhere_tokens"] for p in r["per_instance"]] == [prefix_tokens()] * 2
    assert r["miss_tokens"]["cold"] >= r["elsewhere_tokens"]
    assert r["overlap_score_weight"] is None


def test_least_loaded_takes_turns_among_idle_instances():
    rr = what_if(grouped_requests(), config(), 2, "round-robin")
    ll = what_if(grouped_requests(), config(), 2, "least-loaded")
    # Spaced arrivals leave every instance idle: ties go round, as round-robin.
    assert ll["cache_hits"] == rr["cache_hits"]
    assert ll["elsewhere_tokens"] == rr["elsewhere_tokens"]


def test_prefix_router_sees_only_announced_blocks_and_load():
    """Two prompts with the same prefix at the same instant: the first one's blocks are not
    computed (nor announced) yet, so the second goes where the load is lower."""
    params = SamplingParams(max_tokens=2)
    burst = [Request(group_prompt("A", k), params, 0.0, tag=k + 1) for k in range(2)]
    r = what_if(burst, config(), 2, "prefix")
    assert [p["routed"] for p in r["per_instance"]] == [1, 1]
    # Once the first is done, a third with the same prefix follows the cached blocks.
    later = Request(group_prompt("A", 2), params, 10.0, tag=3)
    r = what_if([*burst, later], config(), 2, "prefix")
    assert [p["routed"] for p in r["per_instance"]] == [2, 1]
    assert r["per_instance"][0]["cache_hits"] == prefix_tokens()


def test_prefix_index_fed_by_events_matches_the_books():
    """The router's per-instance index, built from BlockStored/BlockRemoved alone, ends equal
    to each BlockManager's registered hashes, through evictions."""
    # Overlapping requests with unique full blocks after the prefix, and small caches.
    requests = grouped_requests("ABABBAAB" * 3, gap=0.01, suffix=2 * BS + 3)
    fleet = Fleet(config(num_blocks=12), 2, "prefix")
    reports = run_fleet(fleet, requests, {})
    assert sum(p["evictions"] for p in reports) > 0
    for inst in fleet.instances:
        inst.deliver(float("inf"))
        assert inst.index_hashes == set(inst.engine.block_manager.hash_to_block_id)
        assert inst.requests == inst.tokens == inst.blocks == inst.prefill_tokens == 0


def test_block_hashes_are_the_engines_keys():
    tokens = group_prompt("A", 0)
    fleet = Fleet(config(), 1)
    run_fleet(fleet, [Request(tokens, SamplingParams(max_tokens=1))], {})
    cached = fleet.instances[0].engine.block_manager.hash_to_block_id
    assert all(h in cached for h in block_hashes(tokens, BS))


def test_the_bound_takes_the_requests_the_fleet_admitted():
    # Too big for one instance's 8 blocks, not for the bound's 16: rejected, and left out.
    params = SamplingParams(max_tokens=2)
    big = Request(list(range(30_000, 30_000 + 10 * BS)), params, 5.0, tag=99)
    requests = grouped_requests()
    requests.insert(1, big)
    r = what_if(requests, config(num_blocks=8), 2, "round-robin")
    assert r["rejected"] == 1
    assert r["requests"] == r["one_cache"]["requests"] == len(ORDER)


def test_bad_fleet_arguments():
    with pytest.raises(ValueError, match="at least 1"):
        what_if(grouped_requests(), config(), 0)
    with pytest.raises(ValueError, match="unknown router"):
        what_if(grouped_requests(), config(), 2, "random")


# -- one instance is the plain dry run ---------------------------------------------------------


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def json_of(*args: object):
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_one_instance_equals_the_plain_dry_run():
    # A small cache: evictions, preemptions and rejected requests all happen.
    base = ["replay", MOONCAKE, "--dry-run", "--limit", "150", "--block-size", "64"]
    base += ["--num-blocks", "300"]
    plain = json_of(*base)
    fleet = json_of(*base, "--instances", "1", "--router", "prefix")
    assert plain["evictions"] and plain["preemptions"] and plain["rejected"]
    mine = fleet["per_instance"][0]
    for key, value in plain.items():
        if key != "wall_time_s":
            assert mine[key] == value, key
    assert fleet["hit_rate"] == plain["hit_rate"] == fleet["one_cache_hit_rate"]
    assert fleet["elsewhere_tokens"] == 0


# -- the command line --------------------------------------------------------------------------


@pytest.fixture
def grouped_jsonl(tmp_path) -> Path:
    path = tmp_path / "groups.jsonl"
    lines = [
        {"prompt_token_ids": r.prompt_token_ids, "timestamp": r.arrival_time, "max_tokens": 2}
        for r in grouped_requests()
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("router", ROUTERS)
def test_cli_json_matches_the_python_what_if(grouped_jsonl, router):
    base = ["replay", grouped_jsonl, "--dry-run", "--block-size", BS, "--num-blocks", 64]
    report = json_of(*base, "--instances", 2, "--router", router)
    expected = what_if(grouped_requests(), config(), 2, router)
    for key in ("cache_hits", "cache_queries", "elsewhere_tokens", "one_cache_hit_rate"):
        assert report[key] == expected[key], key
    assert report["instances"] == 2 and report["router"] == router
    assert report["file"] == str(grouped_jsonl) and report["dry_run"] is True


def test_cli_text_is_plain_and_shows_the_bound(grouped_jsonl, tmp_path):
    saved = tmp_path / "fleet.json"
    args = ["replay", grouped_jsonl, "--dry-run", "--block-size", BS, "--num-blocks", 64]
    result = invoke(*args, "--instances", 2, "--report", saved)  # round-robin by default
    assert result.exit_code == 0, result.output
    out = result.stdout
    report = json.loads(saved.read_text())
    assert report["router"] == "round-robin"
    assert "Fleet what-if" in out and "one-cache bound" in out and "cached elsewhere" in out
    assert f"{report['hit_rate']:.1%}" in out and f"{report['one_cache_hit_rate']:.1%}" in out
    assert f"{report['elsewhere_tokens']:,}" in out
    assert "\x1b[" not in out  # plain output when not a terminal


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dry-run", "--instances", "0"], "--instances"),
        (["--router", "prefix"], "add --dry-run"),
        (["--instances", "2"], "add --dry-run"),
        (["--dry-run", "--router", "random"], "'random' is not one of"),
        (["--dry-run", "--instances", "2", "--block-size", "16,64"], "one --block-size"),
        (["--dry-run", "--instances", "2", "--record", "x.trace"], "not a fleet"),
        (["--dry-run", "--instances", "2", "--per-request", "r.jsonl"], "not a fleet"),
        (["--dry-run", "--instances", "2", "--live"], "not a fleet"),
    ],
)
def test_cli_refuses_what_a_fleet_cannot_run(grouped_jsonl, tmp_path, extra, message):
    result = runner.invoke(
        app, ["replay", str(grouped_jsonl), *extra], env={"COLUMNS": "200"}, catch_exceptions=False
    )
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "x.trace").exists()
