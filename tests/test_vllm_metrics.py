"""``/metrics`` as today's vLLM dashboards and routers read it: scraped from a real server with
``prometheus_client``'s own parser, every vLLM-named series checked against the request-level
figures (``usage``) of the same run; and the shipped Grafana dashboard queries only series the
server exports."""

from __future__ import annotations

import json
import random
import re
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanokv_cli.serve.process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "examples" / "grafana" / "nanokv-dashboard.json"
BS, BLOCKS = 16, 24


def scrape(url: str) -> dict[str, list]:
    """Every sample of ``/metrics``, by sample name (``_total``, ``_bucket``... included)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def value(samples: dict, name: str, **labels) -> float:
    found = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def families(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {f.name for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """A server of 24 blocks of 16 tokens in whole-block mode (every hit is a whole block, so
    reuses count in blocks), fed prompts that share system prompts and turn the cache over."""
    workdir = tmp_path_factory.mktemp("server")
    args = ["--model", str(tiny), "--block-size", str(BS), "--num-blocks", str(BLOCKS)]
    args += ["--prefix-match", "block", "--threads", "1", "--no-live"]
    server = ServerProcess(args, workdir, {"OMP_NUM_THREADS": "1"})
    rng = random.Random(5)
    systems = [[rng.randrange(3, 300) for _ in range(3 * BS)] for _ in range(2)]
    usages = []
    try:
        for i in range(10):
            tokens = systems[i % 2] + [rng.randrange(3, 300) for _ in range(2 * BS + i)]
            body = {"prompt": tokens, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        yield server, usages, scrape(server.url)
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait() == 0, server.log()


def test_cache_config_info_sizes_the_cache_for_a_router(run):
    _, _, samples = run
    [info] = samples["vllm:cache_config_info"]
    assert info.value == 1.0
    assert info.labels["block_size"] == str(BS) and info.labels["num_gpu_blocks"] == str(BLOCKS)
    assert info.labels["enable_prefix_caching"] == "True"


def test_prompt_tokens_by_source_add_up_to_the_requests_usage(run):
    _, usages, samples = run
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0 and prompt > cached
    assert value(samples, "vllm:prompt_tokens_total") == prompt
    by_source = {
        s: value(samples, "vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    assert by_source == {
        "local_compute": prompt - cached,
        "local_cache_hit": cached,
        "external_kv_transfer": 0,
    }
    assert sum(by_source.values()) == prompt
    assert value(samples, "vllm:prompt_tokens_cached_total") == cached
    tiers = {
        s.labels["source"]: s.value for s in samples["vllm:prompt_tokens_cached_by_source_total"]
    }
    assert tiers["device"] == cached and sum(tiers.values()) == cached
    # The engine's own lookups say the same (first admissions, every request finished).
    assert value(samples, "vllm:prefix_cache_queries_total") == prompt
    assert value(samples, "vllm:prefix_cache_hits_total") == cached
    computed = "vllm:request_prefill_kv_computed_tokens"
    assert value(samples, f"{computed}_count") == len(usages)
    assert value(samples, f"{computed}_sum") == prompt - cached
    assert value(samples, "vllm:generation_tokens_total") == sum(
        u["completion_tokens"] for u in usages
    )
    assert value(samples, "vllm:time_to_first_token_seconds_count") == len(usages)
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == len(usages)


def test_block_residency_histograms_count_every_reuse_and_eviction(run):
    _, usages, samples = run
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    # Whole-block mode: each hit is one block reused, at least one use after its allocation.
    assert value(samples, "vllm:kv_block_reuse_gap_seconds_count") == cached // BS
    # 10 prompts of 6-7 blocks through 24 blocks: blocks are taken for new tokens again.
    evicted = value(samples, "vllm:kv_block_lifetime_seconds_count")
    assert evicted > 0
    assert value(samples, "vllm:kv_block_idle_before_evict_seconds_count") == evicted
    for name in ("lifetime", "idle_before_evict", "reuse_gap"):
        series = f"vllm:kv_block_{name}_seconds"
        assert value(samples, f"{series}_sum") >= 0
        buckets = [s.value for s in samples[f"{series}_bucket"]]
        assert buckets == sorted(buckets) and buckets[-1] == value(samples, f"{series}_count")
    # The idle part of a block's life is part of its life.
    assert value(samples, "vllm:kv_block_idle_before_evict_seconds_sum") <= value(
        samples, "vllm:kv_block_lifetime_seconds_sum"
    )


# -- the Grafana dashboard -----------------------------------------------------------------------


def queried_series(dashboard: dict) -> set[str]:
    """The metric names the dashboard's PromQL expressions read (suffixes as exported)."""
    names = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                names.update(re.findall(r"\b((?:vllm|nanokv):[a-z0-9_]+)", node["expr"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dashboard)
    return names


def test_the_grafana_dashboard_queries_only_exported_series(run):
    server, _, _ = run
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["panels"] and dashboard["title"]
    queried = queried_series(dashboard)
    assert len(queried) >= 10
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries series /metrics lacks: {missing}"
