"""BlockManager and Sequence: the seed chapter's self-check list, then regressions from other
engines' bug reports."""

import numpy as np
import pytest
import xxhash

from nanokv_cli.engine.block_manager import Block, BlockManager
from nanokv_cli.engine.core.events import (
    BlockAllocated,
    BlockFreed,
    BlockHit,
    BlockRemoved,
    BlockStored,
    CacheLookup,
    CacheState,
)
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.engine.sequence import Sequence, SequenceStatus


def seq_of(tokens, block_size=4, **params):
    return Sequence(list(tokens), SamplingParams(**params), block_size=block_size)


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """What the engine does after a forward pass over the next ``n`` uncached tokens."""
    seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens if n is None else n
    bm.hash_blocks(seq)
    seq.num_cached_tokens += seq.num_scheduled_tokens
    seq.num_scheduled_tokens = 0


def admit(bm: BlockManager, seq: Sequence) -> int:
    hits = bm.can_allocate(seq)
    assert hits != -1
    bm.allocate(seq, hits)
    return hits


# -- seed self-check list ("自我检验清单") ---------------------------------------------------------


def test_paging_allocates_only_what_is_used_and_not_contiguously():
    """Why paging: a sequence takes ceil(len / block_size) blocks, not a max-length
    reservation, and its blocks need not be adjacent."""
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = seq_of(range(5)), seq_of(range(100, 103))
    admit(bm, a)
    admit(bm, b)
    assert a.num_blocks == 2 and len(a.block_table) == 2
    assert len(b.block_table) == 1
    assert len(bm.free_block_ids) == 4 - 3
    bm.deallocate(a)
    c = seq_of(range(200, 210))  # 3 blocks: the never-used one plus a's freed ones
    admit(bm, c)
    assert c.block_table == [3, 1, 0]  # scattered, and in free-queue order
    bm.check_invariants([b, c])


def test_block_fields_and_reset():
    block = Block(7)
    assert (block.block_id, block.ref_count, block.hash, block.token_ids) == (7, 0, -1, [])
    block.update(1234, [1, 2, 3, 4])
    assert block.hash == 1234 and block.token_ids == [1, 2, 3, 4]
    block.ref_count = 3
    block.reset()
    assert (block.ref_count, block.hash, block.token_ids) == (1, -1, [])


def test_block_table_is_a_page_table():
    """Logical block i of a sequence lives in physical block block_table[i]; reading the
    physical blocks in table order gives back the sequence."""
    bm = BlockManager(num_blocks=6, block_size=4)
    filler = seq_of(range(1000, 1008))
    admit(bm, filler)
    bm.deallocate(filler)  # free queue order is now scrambled relative to ids
    seq = seq_of(range(10))
    admit(bm, seq)
    physical = {}
    for pos, tok in enumerate(seq.token_ids):
        physical[(seq.block_table[pos // 4], pos % 4)] = tok
    rebuilt = [physical[(seq.block_table[p // 4], p % 4)] for p in range(len(seq))]
    assert rebuilt == seq.token_ids
    assert [seq.block(i) for i in range(seq.num_blocks)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert seq.last_block_num_tokens == 2


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_can_append_needs_a_block_exactly_when_a_token_opens_one(block_size):
    bm = BlockManager(num_blocks=64, block_size=block_size)
    seq = seq_of(range(3), block_size=block_size)
    admit(bm, seq)
    compute(bm, seq)
    for step in range(3 * block_size + 1):
        seq.append_token(50 + step)
        opens_block = len(seq) % block_size == 1 or block_size == 1
        before = len(seq.block_table)
        assert bm.can_append(seq)
        bm.may_append(seq)
        assert len(seq.block_table) - before == int(opens_block)
        assert len(seq.block_table) == seq.num_blocks
        compute(bm, seq)
        bm.check_invariants([seq])


def test_can_append_false_when_a_block_is_needed_and_none_is_free():
    bm = BlockManager(num_blocks=1, block_size=4)
    seq = seq_of(range(4))
    admit(bm, seq)
    compute(bm, seq)
    seq.append_token(9)  # len 5: opens block 2
    assert not bm.can_append(seq)
    other = BlockManager(num_blocks=1, block_size=4)
    seq2 = seq_of(range(3))
    admit(other, seq2)
    compute(other, seq2)
    seq2.append_token(9)  # len 4: still fits
    assert other.can_append(seq2)


def test_deallocate_decrements_before_recycling_shared_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(9))
    admit(bm, a)
    compute(bm, a)
    b = seq_of(list(range(8)) + [77])
    assert admit(bm, b) == 2
    shared = a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert all(i in bm.used_block_ids for i in shared)
    assert a.block_table == [] and a.num_cached_tokens == 0
    bm.deallocate(b)
    assert not bm.used_block_ids
    bm.check_invariants([])


def test_hash_chain_includes_the_prefix_and_matches_the_seed_formula():
    block = [5, 6, 7, 8]
    h1 = BlockManager.compute_hash(block)
    h2 = BlockManager.compute_hash(block, prefix=h1)
    ref = xxhash.xxh64()
    ref.update(h1.to_bytes(8, "little"))
    ref.update(np.array(block).tobytes())
    assert h2 == ref.intdigest()
    assert BlockManager.compute_hash(block) == xxhash.xxh64(np.array(block).tobytes()).intdigest()
    # Same content after a different prefix is a different block.
    assert BlockManager.compute_hash(block, prefix=123) != h2


def test_only_full_computed_blocks_are_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = seq_of(range(10))
    admit(bm, seq)
    assert bm.hash_to_block_id == {}  # never at allocation time
    compute(bm, seq, 6)  # block 0 full, block 1 half computed
    assert len(bm.hash_to_block_id) == 1
    compute(bm, seq)  # block 1 full now; block 2 (2 tokens) stays unhashed
    assert len(bm.hash_to_block_id) == 2
    assert bm.blocks[seq.block_table[2]].hash == -1


def test_generated_tokens_are_cached_for_the_next_turn():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = seq_of(range(3))
    admit(bm, seq)
    compute(bm, seq)
    for t in (3, 4, 5):  # decode: the prompt+answer fills block 1 at token 7
        seq.append_token(t)
        bm.may_append(seq)
        compute(bm, seq)
    seq.append_token(6)
    bm.may_append(seq)
    compute(bm, seq)
    seq.append_token(7)
    bm.deallocate(seq)
    follow_up = seq_of(list(range(8)) + [100, 101])
    assert bm.can_allocate(follow_up) == 1  # block 1 held token 7 uncomputed: only block 0


def test_shared_and_revived_hits_are_counted_in_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(9))
    admit(bm, a)
    compute(bm, a)
    b = seq_of(list(range(8)) + [50])
    admit(bm, b)  # a still running: shared
    assert bm.stats.shared_hits == 8 and bm.stats.revived_hits == 0
    bm.deallocate(a)
    bm.deallocate(b)
    c = seq_of(list(range(8)) + [60])
    admit(bm, c)  # both gone: revived from the free queue
    assert bm.stats.revived_hits == 8
    assert bm.stats.queries == 27 and bm.stats.hits == 16
    assert bm.stats.hit_rate == pytest.approx(16 / 27)
    bm.check_invariants([c])


# -- regressions -------------------------------------------------------------------------------


def test_fully_cached_prompt_still_prefills_at_least_one_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(8))  # exactly 2 blocks
    admit(bm, a)
    compute(bm, a)
    bm.deallocate(a)
    again = seq_of(range(8))
    hits = admit(bm, again)
    assert hits == 1  # the block with the last token is never a hit
    assert again.num_tokens - again.num_cached_tokens >= 1


def test_preempted_sequence_hits_its_own_freed_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = seq_of(range(10))
    admit(bm, seq)
    compute(bm, seq)
    for t in range(3):
        seq.append_token(20 + t)
        bm.may_append(seq)
        compute(bm, seq)
    old_table = list(seq.block_table)
    bm.deallocate(seq)  # preemption by recompute
    hits = admit(bm, seq)
    assert hits == 3 and seq.block_table[:3] == old_table[:3]
    # A re-admission's hits are counted apart: they never inflate the headline hit rate.
    assert bm.stats.readmission_revived_hits == 12 and bm.stats.revived_hits == 0
    assert bm.stats.readmission_queries == 13 and bm.stats.queries == 10
    assert bm.stats.miss_tokens["preempted"] == 1


def test_same_new_prefix_admitted_together_gets_separate_blocks_then_a_later_hit():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    a, b = seq_of(prompt), seq_of(prompt)
    admit(bm, a)
    admit(bm, b)  # nothing registered yet: b cannot share uncomputed blocks
    assert set(a.block_table).isdisjoint(b.block_table)
    compute(bm, a)
    compute(bm, b)
    bm.check_invariants([a, b])
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h
    c = seq_of(prompt + [99])
    assert admit(bm, c) == 2
    for i in range(2):
        assert bm.blocks[c.block_table[i]].token_ids == c.block(i)
    bm.deallocate(a)
    bm.deallocate(b)
    bm.deallocate(c)
    bm.check_invariants([])


def test_reused_cached_block_loses_its_mapping():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq_of(range(5))
    admit(bm, a)
    compute(bm, a)
    first = a.block_table[0]
    bm.deallocate(a)  # both blocks free; block 0's hash kept
    h = a.block_hashes[0]
    assert bm.hash_to_block_id[h] == first and bm.num_cached_free_blocks == 1
    other = seq_of(range(100, 108))  # needs both blocks: evicts
    admit(bm, other)
    assert h not in bm.hash_to_block_id
    assert bm.stats.evictions == 1
    bm.check_invariants([other])
    assert bm.can_allocate(seq_of(range(5))) == -1


def test_forced_hash_collision_is_rejected_by_the_token_check():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(5))
    admit(bm, a)
    compute(bm, a)
    b = seq_of([9, 9, 9, 9, 9])
    b.block_hashes.append(a.block_hashes[0])  # pretend xxh64 collided
    assert bm.can_allocate(b) == 0
    bm.allocate(b, 0)
    assert set(b.block_table).isdisjoint(a.block_table)


def test_free_queue_is_fifo_and_removal_is_by_id():
    bm = BlockManager(num_blocks=4, block_size=2)
    assert list(bm.free_block_ids) == [0, 1, 2, 3]
    seq = seq_of(range(6), block_size=2)
    admit(bm, seq)
    compute(bm, seq)
    bm.deallocate(seq)
    # Released tail first: the sequence's last block is evicted first.
    assert list(bm.free_block_ids) == [3, 2, 1, 0]
    again = seq_of([0, 1, 2, 3, 99], block_size=2)
    assert admit(bm, again) == 2  # revived 0 and 1 from the middle/tail
    assert list(bm.free_block_ids) == [2]
    assert len(bm.free_block_ids) == 1


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq_of(range(9))
    admit(bm, a)
    compute(bm, a)
    assert bm.hash_to_block_id == {}
    assert bm.can_allocate(seq_of(range(9))) == 0


def test_can_allocate_counts_revived_hits_against_the_free_queue():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq_of(range(9))  # 3 blocks
    admit(bm, a)
    compute(bm, a)
    bm.deallocate(a)
    # 2 hits (both free, revived) + 1 miss = 3 free blocks needed: fits exactly.
    assert bm.can_allocate(seq_of(list(range(8)) + [5])) == 2
    # 13 tokens: 2 hits + 2 misses = 4 > 3.
    assert bm.can_allocate(seq_of(list(range(8)) + [5] * 5)) == -1


def test_events_replay_into_the_same_books():
    events = []
    bm = BlockManager(num_blocks=6, block_size=2, on_event=events.append)
    a = seq_of(range(5), block_size=2)
    admit(bm, a)
    compute(bm, a)
    b = seq_of([0, 1, 2, 3, 7], block_size=2)
    admit(bm, b)
    bm.deallocate(a)
    bm.deallocate(b)
    c = seq_of(range(40, 52), block_size=2)  # all 6 blocks: evicts the hashed prefix
    admit(bm, c)
    kinds = [type(e) for e in events]
    assert kinds[:4] == [CacheLookup] + [BlockAllocated] * 3
    assert BlockStored in kinds and BlockHit in kinds and BlockFreed in kinds
    assert BlockRemoved in kinds  # c needed a block that still held a hash
    state = CacheState(6)
    for e in events:
        state.apply(e)
    assert state.ref_count == [blk.ref_count for blk in bm.blocks]
    assert state.block_hash == [blk.hash for blk in bm.blocks]
    assert state.block_tables == {c.seq_id: c.block_table}
    assert bm.stats.evictions == 2


def test_sequence_fields():
    seq = Sequence([1, 2, 3], SamplingParams(temperature=0.5, max_tokens=7), block_size=2)
    assert seq.status == SequenceStatus.WAITING and seq.is_prefill
    assert (seq.num_tokens, seq.num_prompt_tokens, len(seq)) == (3, 3, 3)
    assert (seq.temperature, seq.max_tokens, seq.ignore_eos) == (0.5, 7, False)
    assert seq.num_blocks == 2 and seq.last_block_num_tokens == 1
    seq.append_token(4)
    assert seq.token_ids == [1, 2, 3, 4] and seq.num_completion_tokens == 1
    assert seq.completion_token_ids == [4] and seq.last_token == 4
    other = Sequence([1], block_size=16)
    assert other.seq_id > seq.seq_id and other.block_size == 16 and seq.block_size == 2


def test_reset_prefix_cache_forgets_every_hash_and_says_so():
    events = []
    bm = BlockManager(num_blocks=4, block_size=2, on_event=events.append)
    a = seq_of(range(5), block_size=2)
    admit(bm, a)
    compute(bm, a)
    bm.deallocate(a)
    assert bm.num_cached_free_blocks == 2
    bm.reset_prefix_cache()
    assert bm.hash_to_block_id == {} and bm.num_cached_free_blocks == 0
    assert bm.can_allocate(seq_of(range(5), block_size=2)) == 0
    state = CacheState(4)
    for e in events:
        state.apply(e)
    assert state.block_hash == [-1] * 4
    bm.check_invariants([])
