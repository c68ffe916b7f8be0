"""The second KV tier's numbers (issue 46, done-when (e)): one name and one value in serve's
report (what --json and the summary print), /metrics, ``inspect --summary`` and ``inspect
--request``; vLLM's KV events carry the tier's medium; a restarted server finds the blocks."""

from __future__ import annotations

import json
import random
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.cli import run_limited

from nanokv_cli.engine.core.events import (
    BlockRemoved,
    BlockStored,
    StepSnapshot,
    TierRemoved,
    TierStored,
)
from nanokv_cli.kv_events import KVEventBatcher
from nanokv_cli.serve.process import ServerProcess

BS, BLOCKS = 16, 24
pytestmark = pytest.mark.usefixtures("one_thread")


def scrape(url: str) -> dict[str, list]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict, name: str, **labels) -> float:
    found = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def complete(url: str, tokens: list[int]) -> dict:
    body = {"prompt": tokens, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def serve(tiny, workdir, tier, name):
    args = ["--model", str(tiny), "--block-size", str(BS), "--num-blocks", str(BLOCKS)]
    args += ["--threads", "1", "--no-live", "--kv-tier", f"disk:{tier}:8MiB"]
    args += ["--report", workdir / f"{name}.json", "--record", workdir / f"{name}.trace"]
    return ServerProcess(args, workdir, {"OMP_NUM_THREADS": "1"}, name=name)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """Two servers, one after the other, on one tier: the first restores a prompt the cache
    evicted, the second (a restart) one the first stored."""
    workdir = tmp_path_factory.mktemp("tier-server")
    tier = workdir / "tier"
    rng = random.Random(3)
    a, b, c = ([rng.randrange(3, 300) for _ in range(10 * BS + 3)] for _ in range(3))
    server = serve(tiny, workdir, tier, "first")
    try:
        first = [complete(server.url, p) for p in (a, b, c, a)]
        samples = scrape(server.url)
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait() == 0, server.log()
    log = server.log()
    server = serve(tiny, workdir, tier, "second")
    try:
        again = complete(server.url, a)  # its first blocks were never evicted: stored at exit
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait() == 0, server.log()
    report = json.loads((workdir / "first.json").read_text())
    return workdir, first, samples, report, again, log


def test_one_name_one_value_everywhere(runs):
    workdir, first, samples, report, _, log = runs
    assert "nanokv: KV tier disk:" in log
    restored = report["restored_hit_tokens"]
    assert restored >= 4 * BS  # of the last request's prompt: what the cache had evicted
    assert report["hit_rate_by_tier"]["disk"] == pytest.approx(restored / report["cache_queries"])
    assert value(samples, "nanokv:prefix_cache_restored_hits_total") == restored
    assert value(samples, "vllm:prompt_tokens_cached_by_source_total", source="disk") == restored
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in first)
    assert value(samples, "vllm:prefix_cache_hits_total") == cached == report["cache_hits"]
    assert value(samples, "nanokv:kv_tier_blocks") == report["tier_blocks"] > 0
    trace = workdir / "first.trace"
    summary = json.loads(run_limited(["inspect", trace, "--summary", "--json"]).stdout)
    assert summary["cache"]["restored_hit_tokens"] == restored
    shown = run_limited(["inspect", trace, "--request", "3"]).stdout
    assert f"restored {restored:,} tokens from disk" in shown
    explained = json.loads(run_limited(["inspect", trace, "--request", "3", "--json"]).stdout)
    blocks = explained["lookups"][0]["blocks"]
    assert sum(BS for b in blocks if b["hit"] == "restored") == restored


def test_a_restarted_server_finds_the_blocks_stored_before(runs):
    *_, again, _ = runs
    # Every full block before the prompt's last token: the ones the first server evicted and
    # the ones it still held at exit (LLM.shutdown stores them).
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * BS


def test_kv_events_carry_the_tier_medium():
    batcher = KVEventBatcher(4)
    events = [
        BlockStored(0, 11, -1, [1, 2, 3, 4]),
        BlockRemoved(0, 11),
        TierStored(11, "disk"),
        TierRemoved(11, "disk"),
        TierStored(99, "host"),  # no cache announcement before it: not announced
    ]
    for e in events:
        batcher.feed(e)
    batch = batcher.feed(StepSnapshot(0, "idle", 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0, 0))
    kinds = [(e[0], e[-2] if e[0] == "BlockStored" else e[-1]) for e in batch]
    assert kinds == [
        ("BlockStored", None),
        ("BlockRemoved", None),
        ("BlockStored", "DISK"),
        ("BlockRemoved", "DISK"),
    ]
    assert batch[2][3] == [1, 2, 3, 4] and batch[2][1] == [11]
