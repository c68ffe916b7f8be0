"""Token-granular prefix reuse (``prefix_match="token"``, the default): past the last full-block
hit, the leading tokens a prompt shares with a cached block continuing the same prefix are
copied, not computed. The books, the events, the scheduler's waiting, the hit rate against the
token-level bound, and the model's tokens with copied K/V against computed ones."""

import signal

import pytest
from support.engines import compute, dry_engine, lookup_of, seq_of

from nanokv_cli.engine.block_manager import BlockManager
from nanokv_cli.engine.core.events import BlockAllocated, BlockCopied, CacheLookup
from nanokv_cli.engine.core.scheduler import Scheduler
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.run.stats import InfiniteCache, RunStats


def events_of(bm, seq):
    seen = []
    bm.on_event = seen.append
    bm.allocate(seq, bm.can_allocate(seq))
    bm.on_event = None
    return seen


def test_a_prompt_shorter_than_a_block_lends_its_tokens():
    bm = BlockManager(64, 4)
    a = seq_of([7, 8, 9])  # one partial block: never registered, still a copy source
    lookup_of(bm, a)
    compute(bm, a)
    b = seq_of([7, 8, 9, 1, 2, 3])
    seen = events_of(bm, b)
    look = next(e for e in seen if type(e) is CacheLookup)
    copy = next(e for e in seen if type(e) is BlockCopied)
    assert (look.num_hit_tokens, look.reason, look.miss_block) == (3, "cold", 0)
    assert (copy.block_id, copy.source_block_id, copy.num_tokens) == (
        b.block_table[0],
        a.block_table[0],
        3,
    )
    # Announced after the block it fills was allocated, as every view expects.
    assert seen.index(copy) > next(i for i, e in enumerate(seen) if type(e) is BlockAllocated)
    assert b.kv_copy == (a.block_table[0], b.block_table[0], 3) and b.num_cached_tokens == 3
    assert bm.stats.copied_hits == 3 and bm.stats.hits == 3
    bm.check_invariants([a, b])


def test_a_prompt_diverging_inside_a_block_copies_what_it_shares():
    bm = BlockManager(64, 4)
    a = seq_of(range(10))
    lookup_of(bm, a)
    compute(bm, a)
    b = seq_of([0, 1, 2, 3, 4, 5, 99, 98, 97])  # 4 + 2 tokens in common
    look = lookup_of(bm, b)
    assert (look.num_hit_tokens, look.reason, look.miss_block) == (6, "cold", 1)
    assert bm.stats.shared_hits == 4 and bm.stats.copied_hits == 2
    assert b.kv_copy == (a.block_table[1], b.block_table[1], 2)


def test_a_fully_cached_prompt_computes_only_its_last_token():
    bm = BlockManager(64, 4)
    a = seq_of(range(10))
    lookup_of(bm, a)
    compute(bm, a)
    for n in (8, 10, 3):  # ends on a block boundary, inside a's partial block, in block 0
        c = seq_of(range(n))
        look = lookup_of(bm, c)
        assert (look.num_hit_tokens, look.reason) == (n - 1, "last-token"), n
        bm.deallocate(c)
    bm.check_invariants([a])


def test_block_mode_copies_nothing():
    bm = BlockManager(64, 4, prefix_match="block")
    a = seq_of([7, 8, 9])
    lookup_of(bm, a)
    compute(bm, a)
    b = seq_of([7, 8, 9, 1, 2, 3])
    assert not any(type(e) is BlockCopied for e in events_of(bm, b))
    assert b.kv_copy is None and bm.stats.hits == 0
    with pytest.raises(ValueError, match="prefix_match"):
        BlockManager(8, 4, prefix_match="tokens")


def test_a_source_leaves_with_its_block_and_a_freed_tail_stays_until_reused():
    bm = BlockManager(3, 4)
    a = seq_of([5, 6, 7, 8, 9, 10])  # block 1 holds 5 computed tokens of... 2
    lookup_of(bm, a)
    compute(bm, a)
    bm.deallocate(a)  # its partial last block goes to the free queue, content kept
    b = seq_of([5, 6, 7, 8, 9, 10, 11])
    look = lookup_of(bm, b)
    assert look.num_hit_tokens == 6  # block 0 revived, block 1's two tokens copied
    bm.deallocate(b)
    other = seq_of(range(100, 112))  # three blocks: every earlier content is overwritten
    lookup_of(bm, other)
    bm.deallocate(other)
    bm.check_invariants([])
    c = seq_of([5, 6, 7, 8, 9, 10, 11])
    assert lookup_of(bm, c).num_hit_tokens == 0 and c.kv_copy is None


def test_followers_of_a_partial_block_wait_for_it_then_copy():
    bm = BlockManager(64, 64)
    sched = Scheduler(bm, max_num_batched_tokens=1000)
    system = list(range(40))  # shorter than one block
    seqs = [seq_of(system + [100 + i, 200 + i], block_size=64) for i in range(4)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert first == [seqs[0]]  # the others would copy 40 tokens by waiting one step
    sched.postprocess(first, [1])
    second = sched.schedule()
    assert set(second) >= set(seqs[1:])
    sources = {seqs[0].block_table[0]}
    for s in seqs[1:]:  # each copies from the leader, or a follower copying before it
        assert s.num_prefix_hit_tokens == 40 and s.kv_copy[0] in sources
        sources.add(s.block_table[0])
    assert bm.stats.copied_hits == 3 * 40
    # A leader that is aborted stops holding them back.
    bm2 = BlockManager(64, 64)
    sched2 = Scheduler(bm2, max_num_batched_tokens=1000)
    leader, follower = seq_of(system + [1], block_size=64), seq_of(system + [2], block_size=64)
    sched2.add(leader)
    sched2.add(follower)
    assert sched2.schedule() == [leader]
    assert sched2.abort(leader.seq_id)
    assert follower in sched2.schedule()


def _hit_rate(prompts, block_size, prefix_match="token", together=False, max_tokens=8):
    engine = dry_engine(block_size=block_size, prefix_match=prefix_match)
    stats = RunStats(InfiniteCache(block_size))
    engine.events.subscribe(stats)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        while not together and engine.has_unfinished_requests():
            engine.step()
            engine.scheduler.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
    return stats.report(duration=1.0, wall_time=1.0)["hit_rate"]


@pytest.mark.parametrize("together", [False, True])
def test_hit_rate_reaches_the_token_level_bound_at_a_large_block_size(together):
    shared = list(range(1000, 1400))  # a 400-token policy prompt, then a variable line
    prompts = [shared + [2000 + i] * (5 + i % 7) + [3000 + i, 3001] for i in range(10)]
    bound = _hit_rate(prompts, 1, together=together)
    token = _hit_rate(prompts, 256, together=together)
    block = _hit_rate(prompts, 256, "block", together=together)
    assert token >= 0.99 * bound and bound > 0.8
    assert block < 0.7 * bound  # what the seed's whole blocks leave on the table


def test_copied_kv_gives_transformers_tokens_through_the_engine(tmp_path):
    """The whole path on a tiny model (whose greedy tokens no rounding flips): prompts that
    share a prefix ending inside a block, one at a time, in a cache so small that copy sources
    are taken for new data in the very step they are copied from. Every answer equals
    transformers' greedy one."""
    import torch
    import transformers
    from support.models import make_tiny_model

    from nanokv_cli import LLM

    folder = make_tiny_model("llama", tmp_path / "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def greedy(prompt, n):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    shared = [(i * 37) % 290 + 3 for i in range(16 + 9)]
    prompts = [shared + [(i * 13 + k) % 290 + 3 for k in range(4 + i)] for i in range(5)]
    prompts.append(shared)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    llm = LLM(str(folder), block_size=16, num_blocks=6, quantization="none", threads=1)
    copies = []
    llm.engine.events.subscribe(lambda e: copies.append(e) if type(e) is BlockCopied else None)
    for prompt in prompts:
        assert llm.generate([prompt], params)[0]["token_ids"] == greedy(prompt, 6)
        llm.engine.scheduler.check_invariants()
    assert len(copies) >= 4 and llm.engine.block_manager.stats.evictions > 0


@pytest.mark.slow
def test_a_system_prompt_shorter_than_a_block_is_reused_through_serve(tmp_path):
    """The issue's new user: the default model at the default block size (256), two chat
    requests through the ``openai`` client sharing a ~140-token system prompt."""
    import openai
    from support.servers import KEY

    from nanokv_cli.serve.process import ServerProcess

    system = (
        "You are the support assistant of a small hardware store. Answer in one or two short "
        "sentences, name the aisle when you know it, never invent prices or stock levels, and "
        "say so plainly when a question is outside what a hardware store sells. Customers "
        "often ask about screws, nails, paint, garden hoses, light bulbs, key cutting, and "
        "tool rental. Opening hours are nine to six on weekdays and ten to four on Saturdays; "
        "the store is closed on Sundays and public holidays. Returns need a receipt and are "
        "accepted within thirty days. Staff can mix paint to "
        "order while the customer waits, and "
        "deliveries go out on Tuesdays."
    )
    srv = ServerProcess(["--num-blocks", "32", "--no-live"], tmp_path, env={"NANOKV_API_KEY": KEY})
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        usages = []
        for question in ("Where are the screws?", "Do you cut keys?"):
            out = client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
                max_tokens=4,
                temperature=0,
            )
            usages.append(out.usage)
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.wait() == 0, srv.log()
    first, second = usages
    assert 150 <= first.prompt_tokens < 256  # the whole prompt fills no block
    assert second.prompt_tokens_details.cached_tokens >= 130


def test_the_infinite_cache_bound_counts_shared_tokens_past_whole_blocks():
    bound, blocks = InfiniteCache(4), InfiniteCache(4, "block")
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 9, 9], [1, 2, 3], [1, 2, 3, 4, 5, 6, 7]]
    gains = []
    for p in prompts:
        before = bound.hit_tokens
        bound.add(p)
        blocks.add(p)
        gains.append(bound.hit_tokens - before)
    # Nothing before the first; 4 + 2 shared; 2 (never the last token); all but the last.
    assert gains == [0, 6, 2, 6]
    assert blocks.hit_tokens == 4 + 0 + 4  # whole blocks only, never the last one
