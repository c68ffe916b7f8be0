"""Where token-granular reuse looks: the blocks whose content continues a prefix.

Filed under ``continuation_key(parent hash, first token)``, the newest blocks (at most
``CONTINUATIONS_KEPT``, oldest first) whose content continues that prefix with that token: a
registered block, a running sequence's last block, or the last block a finished one left in
the free queue. A lookup searches one short list, not the cache. Each block carries the key it
is filed under (``Block.tail_key``); it leaves when it is taken for new data or pushed out by
newer ones.
"""

from __future__ import annotations

from .blocks import Block
from .miss_reasons import CONTINUATIONS_KEPT, continuation_key


class CopySources:
    def __init__(self, blocks: list[Block]) -> None:
        self.blocks = blocks
        self._tails: dict[int, list[int]] = {}

    def continuing(self, parent: int, first_token: int) -> list[int]:
        """The blocks filed under the prefix ``parent`` and ``first_token``, oldest first (a
        key collision may add one of another prefix: check ``Block.parent``)."""
        return self._tails.get(continuation_key(parent, first_token), [])

    def offer(self, block: Block, first_token: int) -> None:
        """File ``block`` as the newest source for its prefix and first token."""
        if block.tail_key:  # offered again (full now, registered): it moves to the newest
            self.withdraw(block)
        key = continuation_key(block.parent, first_token)
        # The key first: a block filed under a key it does not carry could never leave.
        block.tail_key = key
        sources = self._tails.get(key)
        if sources is None:
            self._tails[key] = [block.block_id]
        else:
            sources.append(block.block_id)
            if len(sources) > CONTINUATIONS_KEPT:
                self._push_out(sources)

    def withdraw(self, block: Block) -> None:
        """``block`` stops being a source."""
        key = block.tail_key
        if key:
            sources = self._tails.get(key, ())
            if block.block_id in sources:  # not filed if an interrupt cut offer() short
                if len(sources) == 1:  # one change either way: no empty list left behind
                    del self._tails[key]
                else:
                    sources.remove(block.block_id)
            block.tail_key = 0

    def _push_out(self, sources: list[int]) -> None:
        """Drop one source of a full set: the oldest, unless it is the newest one no sequence
        is filling any more (a finished prompt's tail: what a repeat of that prompt needs,
        which sequences running with the same prefix would otherwise push out)."""
        blocks = self.blocks
        settled = [j for j, b in enumerate(sources) if blocks[b].owner is None]
        victim = 1 if settled and settled[-1] == 0 else 0
        blocks[sources.pop(victim)].tail_key = 0

    def clear(self) -> None:
        for block in self.blocks:
            block.owner = None
            block.tail_key = 0
        self._tails.clear()

    def check(self) -> None:
        """Each source is filed once, under the key it carries, and holds something. (A block
        may carry a key it is not filed under, if an interrupt cut ``offer`` short: harmless,
        it is simply no source.)"""
        for key, sources in self._tails.items():
            assert 0 < len(sources) <= CONTINUATIONS_KEPT, f"key {key}: {len(sources)} sources"
            assert len(set(sources)) == len(sources), f"key {key} files a block twice"
            for b in sources:
                block = self.blocks[b]
                assert block.tail_key == key, f"copy source {b} is filed under another key"
                assert block.hash != -1 or block.owner is not None or block.token_ids, (
                    f"copy source {b} holds nothing"
                )
