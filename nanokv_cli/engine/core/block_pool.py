"""The physical KV blocks and their books: ref counts, the FIFO free queue, and the prefix
cache's map from chained hash to the block holding that content.

The pool records; the ``BlockManager`` decides, per sequence, which blocks to take and when,
and announces each change once every book balances. Each method here does whatever may raise
before it changes anything, so a change is either done or not begun.
"""

from __future__ import annotations

from .blocks import Block, FreeBlockQueue, same_tokens


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids = FreeBlockQueue(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.hash_to_block_id: dict[int, int] = {}
        # Older copies of a registered hash (the newest serves it): they still hold the
        # content, so it leaves the cache, an eviction, only when the last copy is reused.
        self._duplicates: dict[int, list[int]] = {}
        self.num_cached_free_blocks = 0  # free blocks still holding a hash (reusable until evicted)

    def cached(self, h: int, token_ids) -> int:
        """The block holding the content ``token_ids`` registered under ``h``, or -1."""
        block_id = self.hash_to_block_id.get(h, -1)
        # A hash match alone is not proof: verify the tokens (xxh64 can collide).
        if block_id != -1 and not same_tokens(self.blocks[block_id].token_ids, token_ids):
            return -1
        return block_id

    def take_hit(self, block: Block) -> str:
        """One more sequence holds cached ``block``: "shared" if others hold it, "revived"
        if it came out of the free queue."""
        if block.ref_count:
            block.ref_count += 1
            return "shared"
        self.free_block_ids.remove(block.block_id)  # first: if it raises, nothing has changed
        self.num_cached_free_blocks -= 1
        self.used_block_ids.add(block.block_id)
        block.ref_count = 1
        return "revived"

    def is_last_copy(self, block: Block) -> bool:
        """Whether taking cached ``block`` takes its content out of the cache (no older copy
        of it would serve its hash): an eviction."""
        return not self._duplicates.get(block.hash)

    def take_free(self) -> Block:
        """The head of the free queue, emptied, with ref count 1. If it holds a hash, that is
        not the last copy's (the manager lets the last go first: ``uncache``), so the hash
        moves to an older copy, in the same change: the events see no hash leave."""
        block_id = self.free_block_ids.popleft()  # first: if it raises, nothing has changed
        block = self.blocks[block_id]
        if block.hash != -1:
            self._drop_hash(block)
        block.reset()
        self.used_block_ids.add(block_id)
        return block

    def release(self, block: Block) -> None:
        """One sequence fewer holds ``block``; at 0 it goes to the free queue's tail, hash kept:
        reusable until it reaches the head."""
        if block.ref_count == 1:
            self.free_block_ids.append(block.block_id)  # first: if it raises, nothing changed
            self.used_block_ids.discard(block.block_id)
            self.num_cached_free_blocks += block.hash != -1
        block.ref_count -= 1

    def register(self, block: Block, h: int, token_ids: list[int]) -> None:
        """``block`` now holds the computed content ``token_ids``, found under ``h``."""
        older = self.hash_to_block_id.get(h, -1)
        if older != -1:
            # A duplicate (a prompt's recomputed last block, an answer another sequence also
            # generated): the newest copy serves the hash, as a re-registration does in the
            # seed, and sits farthest from the free queue's head; the older one keeps its
            # content until it is reused (see _drop_hash).
            self._duplicates.setdefault(h, []).append(older)
        block.update(h, token_ids)
        self.hash_to_block_id[h] = block.block_id

    def uncache(self, block: Block) -> None:
        """Free ``block``, the last copy of its content, is about to be overwritten: its hash
        leaves the cache (an eviction)."""
        assert self.is_last_copy(block), f"block {block.block_id} is not its hash's last copy"
        self._drop_hash(block)

    def _drop_hash(self, block: Block) -> None:
        """Free ``block`` stops holding its hash. If an older copy of the content is still
        cached, the hash moves to it (the newest remaining copy)."""
        h = block.hash
        block.hash = -1
        block.token_ids = []
        self.num_cached_free_blocks -= 1
        copies = self._duplicates.get(h)
        if not copies:
            del self.hash_to_block_id[h]
            return
        if self.hash_to_block_id[h] == block.block_id:
            self.hash_to_block_id[h] = copies.pop()
        else:
            copies.remove(block.block_id)
        if not copies:
            del self._duplicates[h]

    def clear(self) -> None:
        """Forget every registered hash."""
        for block in self.blocks:
            block.hash = -1
            block.token_ids = []
        self.hash_to_block_id.clear()
        self._duplicates.clear()
        self.num_cached_free_blocks = 0

    def check(self) -> None:
        """Assert the pool's books balance."""
        blocks = self.blocks
        free = list(self.free_block_ids)
        assert len(free) == len(set(free)), "duplicate ids in the free queue"
        assert set(free).isdisjoint(self.used_block_ids), "a block is both free and used"
        assert len(free) + len(self.used_block_ids) == len(blocks), (
            "free and used do not cover all blocks"
        )
        for block in blocks:
            assert (block.ref_count > 0) == (block.block_id in self.used_block_ids), block
            assert block.ref_count >= 0, block
        cached_free = sum(1 for b in free if blocks[b].hash != -1)
        assert cached_free == self.num_cached_free_blocks, "cached-free counter drifted"
        for h, b in self.hash_to_block_id.items():
            assert blocks[b].hash == h, f"hash {h} maps to block {b} holding {blocks[b].hash}"
        for h, copies in self._duplicates.items():
            assert copies and h in self.hash_to_block_id, f"stray copies of hash {h}"
            for b in copies:
                assert blocks[b].hash == h and self.hash_to_block_id[h] != b, (h, b)
        hashed = sum(1 for b in blocks if b.hash != -1)
        copies = sum(len(c) for c in self._duplicates.values())
        assert hashed == len(self.hash_to_block_id) + copies, (
            "a hashed block the prefix cache cannot reach"
        )
