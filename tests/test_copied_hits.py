"""Copied hits (token-granular reuse) where they happened: ``inspect --request`` puts each on
the logical block its ``BlockCopied`` event names, its counts are the run's own, the lookup
takes the copy source that shares the most, a miss after a copy names what prevented more, and
``inspect --prompts`` rows add up to its headline in both match modes (issue #45 item 2)."""

import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from support.engines import compute, dry_engine, lookup_of, run_workload, seq_of

from nanokv_cli.engine.block_manager import BlockManager
from nanokv_cli.engine.core.cache_numbers import miss_label
from nanokv_cli.engine.core.events import (
    BlockCopied,
    CacheLookup,
    SequenceAdded,
    SequenceFinished,
)
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.run.analysis import explain_request
from nanokv_cli.trace.format import make_header
from nanokv_cli.trace.reader import TraceReader
from nanokv_cli.trace.writer import TraceWriter
from nanokv_cli.views.inspect import render_prompt_map, render_request
from nanokv_cli.workload.prompts import map_prompt_blocks

HITS = ("shared", "revived")


def text_of(renderable, width: int = 160) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


@contextmanager
def record_workload(requests, **kw):
    """Run ``requests`` (prompt, max tokens, arrival step) through a dry engine, books checked
    after every step, into a trace: its reader, once closed, and every event."""
    seen = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "run.trace"
        header = make_header(
            block_size=kw["block_size"], num_blocks=kw["num_blocks"], model=None, dry_run=True
        )
        with TraceWriter(path, header) as writer:

            def listen(event):
                seen.append(event)
                writer(event)

            run_workload(requests, listener=listen, **kw)
        yield TraceReader(path), seen


def copies_by_lookup(events):
    """seq id -> for each of its lookups in order, the BlockCopied event that served it (or
    None); and seq id -> the cached tokens its SequenceFinished reports."""
    copies: dict[int, list] = {}
    finished = {}
    for e in events:
        t = type(e)
        if t is CacheLookup:
            copies.setdefault(e.seq_id, []).append(None)
        elif t is BlockCopied:
            assert copies[e.seq_id][-1] is None, "two copies for one lookup"
            copies[e.seq_id][-1] = e
        elif t is SequenceFinished:
            finished[e.seq_id] = e.num_cached_tokens
    return copies, finished


def check_request(reader, seq_id, copies, cached, bs):
    """What ``inspect --request`` shows of ``seq_id`` against the events and the run."""
    info = explain_request(reader, seq_id)
    assert len(info["lookups"]) == len(copies)
    for look, copy in zip(info["lookups"], copies):
        kinds = [b["hit"] for b in look["blocks"]]
        k = sum(1 for h in kinds if h in HITS)
        # Hits first, then at most one copied block, then misses: a block hits only after
        # its whole prefix.
        assert all(h in HITS for h in kinds[:k]), kinds
        shown = [i for i, h in enumerate(kinds) if h == "copied"]
        if copy is None:
            assert not shown and all(h is None for h in kinds[k:]), kinds
            copied = 0
        else:
            assert shown == [k], (kinds, copy)  # right after the full-block hits
            block = look["blocks"][k]
            assert block["block_id"] == copy.block_id  # the block the event names
            assert (block["source_block_id"], block["num_tokens"]) == (
                copy.source_block_id,
                copy.num_tokens,
            )
            assert all(h is None for h in kinds[k + 1 :]), kinds
            copied = copy.num_tokens
        assert look["cached_tokens"] == k * bs + copied
    first = info["lookups"][0]
    assert first["first_admission"] and first["cached_tokens"] == cached


def check_cold_means_unseen(events):
    """A lookup's miss reads ``cold`` only when no earlier prompt that has finished held its
    prefix up to and including the first missed token. (A prompt still in prefill may hold it
    in a full block it has not finished computing, which is no copy source yet.)"""
    prompts, done = {}, set()
    for e in events:
        t = type(e)
        if t is SequenceAdded:
            prompts[e.seq_id] = list(e.prompt_token_ids)
        elif t is SequenceFinished:
            done.add(e.seq_id)
        elif t is CacheLookup and e.reason == "cold":
            want = prompts[e.seq_id][: e.num_hit_tokens + 1]
            assert not any(prompts[s][: len(want)] == want for s in done), e


def check_prompt_rows(prompts, bs, mode):
    """``inspect --prompts``: the rows' hit column, and their missed tokens by the reason each
    row shows, add up to the headline's numbers (--json and text alike)."""
    info = map_prompt_blocks(prompts, bs, mode)
    rows = info["prompts"]
    assert sum(p["cached_tokens"] for p in rows) == info["hit_tokens"]
    missed = Counter()
    for p in rows:
        assert miss_label(p, bs).split()[0] == p["miss_reason"]  # the row's word is --json's
        missed[p["miss_reason"]] += p["num_tokens"] - p["cached_tokens"]
    assert {k: v for k, v in missed.items() if v} == info["miss_tokens"]
    assert info["prompt_tokens"] - info["hit_tokens"] == sum(info["miss_tokens"].values())
    shown = {}  # index -> the hit column, as the table prints it
    for line in text_of(render_prompt_map(info, None, 200)).splitlines():
        cells = line.split()[:3]
        if len(cells) == 3 and all(c.replace(",", "").isdigit() for c in cells):
            shown[int(cells[0])] = int(cells[2].replace(",", ""))
    assert shown == {p["index"]: p["cached_tokens"] for p in rows}
    return info


@st.composite
def conversations(draw):
    """Multi-turn chats on a shared system prompt, each turn's prompt the last one plus a reply
    and a new user turn, arriving over a few steps; and some prompts repeated later."""
    tokens = st.integers(1, 50)
    system = draw(st.lists(tokens, max_size=10))
    requests = []
    for _ in range(draw(st.integers(1, 3))):
        history, step = list(system), draw(st.integers(0, 4))
        for _ in range(draw(st.integers(1, 3))):
            history += draw(st.lists(tokens, min_size=1, max_size=8))
            requests.append((list(history), draw(st.integers(1, 6)), step))
            history += draw(st.lists(tokens, min_size=1, max_size=5))  # the reply
            step += draw(st.integers(1, 6))
    for _ in range(draw(st.integers(0, 3))):
        prompt, max_tokens, arrival = draw(st.sampled_from(requests))
        requests.append((prompt, max_tokens, arrival + draw(st.integers(1, 10))))
    return requests


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    conversations(),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.integers(4, 20),  # few blocks: evictions and preemptions
    st.integers(1, 16),
    st.sampled_from(["token", "block"]),
)
def test_copied_hits_are_shown_where_the_events_put_them(requests, bs, num_blocks, batch, mode):
    kw = dict(block_size=bs, num_blocks=num_blocks, max_batched=batch, prefix_match=mode)
    with record_workload(requests, **kw) as (reader, events):
        copies, finished = copies_by_lookup(events)
        if mode == "block":
            assert not any(c for cs in copies.values() for c in cs)
        for seq_id, cached in finished.items():
            check_request(reader, seq_id, copies[seq_id], cached, bs)
        check_cold_means_unseen(events)
    check_prompt_rows([p for p, _, _ in requests], bs, mode)


# -- the repeat of issue #45: a prompt again after it finished, another running with its prefix --


def repeat_after_finish(block_size):
    """Prompt P (585 tokens), then a longer-running prompt that shares P's first 571 tokens,
    then P again once the first finished: the cached tokens of the three lookups."""
    engine = dry_engine(num_blocks=64, block_size=block_size, max_num_batched_tokens=4096)
    lookups = []
    engine.events.subscribe(lambda e: lookups.append(e) if type(e) is CacheLookup else None)
    prompt = [1000 + (i * 7) % 500 for i in range(585)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = engine.add_request(prompt, params)
    engine.step()
    engine.add_request(prompt[:571] + [5] * 40, SamplingParams(max_tokens=60, ignore_eos=True))
    while any(s.seq_id == first for s in engine.scheduler.running):
        engine.step()
    engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return lookups


def test_a_repeat_reuses_all_but_its_last_token_at_any_block_size():
    for bs in (256, 16):
        first, other, repeat = repeat_after_finish(bs)
        assert (first.num_hit_tokens, other.num_hit_tokens) == (0, 571), bs
        # The finished prompt's own last block (free, its 73 tokens computed) lends them,
        # not the running one that parts from it 59 tokens in.
        assert (repeat.num_hit_tokens, repeat.reason) == (584, "last-token"), bs


def test_the_source_sharing_the_most_computed_tokens_lends_them():
    bm = BlockManager(16, 8)
    a = seq_of(range(12), block_size=8)  # block 1: tokens 8..11
    lookup_of(bm, a)
    compute(bm, a)
    bm.deallocate(a)  # its partial block stays a copy source in the free queue
    b = seq_of(list(range(10)) + [99, 98, 97, 96], block_size=8)  # newer, shares 2 of them
    lookup_of(bm, b)
    compute(bm, b)
    c = seq_of(list(range(12)) + [50, 51], block_size=8)
    look = lookup_of(bm, c)
    assert (look.num_hit_tokens, look.reason) == (12, "cold")
    assert c.kv_copy[2] == 4 and c.kv_copy[0] not in b.block_table
    bm.check_invariants([b, c])


def test_a_repeat_whose_source_was_overwritten_says_evicted_not_cold():
    bs = 8
    bm = BlockManager(4, bs)
    a = seq_of(range(12), block_size=bs)
    lookup_of(bm, a)
    compute(bm, a)
    b = seq_of(list(range(10)) + [99, 98], block_size=bs)  # shares block 0 and 2 tokens more
    lookup_of(bm, b)
    compute(bm, b)
    bm.deallocate(a)  # a's last block joins the free queue, behind the block never used
    filler = seq_of(range(100, 116), block_size=bs)  # takes both free blocks: a's is gone
    lookup_of(bm, filler)
    bm.deallocate(filler)
    c = seq_of(range(12), block_size=bs)
    look = lookup_of(bm, c)
    # Only b's 2 tokens were left to copy; a shared all of them, but its K/V had left.
    assert look.num_hit_tokens == 10 and look.reason == "evicted"
    bm.check_invariants([b, c])


def test_a_flood_of_running_sources_keeps_the_finished_one():
    bs = 8
    bm = BlockManager(64, bs)
    a = seq_of(range(12), block_size=bs)
    lookup_of(bm, a)
    compute(bm, a)
    bm.deallocate(a)
    running = []
    for i in range(6):  # more sources of the same prefix than are kept
        s = seq_of(list(range(9)) + [200 + i] * 3, block_size=bs)
        lookup_of(bm, s)
        compute(bm, s)
        running.append(s)
    c = seq_of(range(12), block_size=bs)
    assert lookup_of(bm, c).num_hit_tokens == 11
    bm.check_invariants([*running, c])


# -- what inspect shows ---------------------------------------------------------------------------


def test_inspect_request_shows_the_copy_on_its_block_before_the_misses():
    """A prompt that copies into logical block 1 and misses three blocks after it."""
    prompt = list(range(1, 11))
    later = [1, 2, 3, 4, 5, 6, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 33]
    requests = [(prompt, 2, 0), (later, 2, 4)]
    kw = dict(block_size=4, num_blocks=32, max_batched=64)
    with record_workload(requests, **kw) as (reader, events):
        info = explain_request(reader, 1)
        copy = next(e for e in events if type(e) is BlockCopied)
    blocks = info["lookups"][0]["blocks"]
    assert [b["hit"] for b in blocks] == ["revived", "copied", None, None, None]
    assert blocks[1]["block_id"] == copy.block_id and blocks[1]["num_tokens"] == 2
    out = text_of(render_request(info, 4))
    line = next(x for x in out.splitlines() if "copied" in x)
    assert line.lstrip().startswith("block    1") and f"→ {copy.block_id:>5}" in line
    assert "miss: cold" in line and out.count("follows the first miss") == 3


def test_inspect_prompts_rows_add_up_to_the_headline():
    prompts = [list(range(1, 21)), list(range(1, 14)) + [90], [7, 8], [7, 8, 9], [7, 8, 9]]
    token = check_prompt_rows(prompts, 4, "token")
    out = text_of(render_prompt_map(token, None, 160))
    # The third prompt's row: 14 tokens, 13 served (12 in blocks, 1 copied), then the last.
    assert token["prompts"][1]["cached_tokens"] == 13
    row = next(x for x in out.splitlines() if x.split()[:3] == ["1", "14", "13"])
    assert "last-token @3" in row
    block = check_prompt_rows(prompts, 4, "block")
    assert block["miss_tokens"]["below-block"] == 2 + 3 + 3
    out = text_of(render_prompt_map(block, None, 160))
    head = next(x for x in out.splitlines() if x.startswith("missed tokens:"))
    assert "below-block 8" in head
    reasons = {x.split()[-1] for x in out.splitlines() if x.split()[:1] in (["2"], ["3"], ["4"])}
    assert reasons == {"below-block"}
