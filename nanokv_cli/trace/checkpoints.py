"""Checkpoints: the cache state a version-2 trace holds at the end of every
``CHECKPOINT_EVERY``-th step, restored (and checked against the header's cache) so that
reading step N replays at most that many steps of events."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..engine.core.events import CacheState, StepSnapshot
from .checks import _check_event
from .format import TraceError, _reason, _short, _tokens
from .prompts import PromptStore
from .records import Record, RecordFile


class Checkpoints:
    """Restores a checkpoint record into a ``CacheState``, its block tokens and prompts made
    from the trace's prompts."""

    def __init__(self, file: RecordFile, prompts: PromptStore) -> None:
        self.file = file
        self.prompts = prompts
        self.path = file.path

    def restore(self, state: CacheState, checkpoint: Record) -> None:
        """The whole state: books, block tokens, unfinished prompts, the last snapshot."""
        cp = self.file.payload(checkpoint)
        try:
            state.ref_count, state.block_hash, state.block_tables = self._books(cp)
            self._resolve_sources(state, cp["sources"])
            for seq_id in cp["unfinished"]:
                state.prompts[seq_id] = self.prompts.prompt(seq_id)[0]
            state.last_snapshot = self._checkpoint_snapshot(cp, checkpoint)
        except TraceError:
            raise  # already says what is wrong
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise TraceError(f"{self.path}: damaged checkpoint ({_reason(e)})") from None

    def restore_tables(self, state: CacheState, checkpoint: Record) -> None:
        """Ref counts and block tables only (no tokens), for following one request."""
        cp = self.file.payload(checkpoint)
        try:
            state.ref_count, _, state.block_tables = self._books(cp)
            self._checkpoint_snapshot(cp, checkpoint)
        except TraceError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise TraceError(f"{self.path}: damaged checkpoint ({_reason(e)})") from None

    def _checkpoint_snapshot(self, cp: dict[str, Any], checkpoint: Record) -> StepSnapshot:
        """The checkpoint's last snapshot, checked: its step is the checkpoint's, the end of
        the events before it."""
        snap = StepSnapshot(*cp["snapshot"])
        _check_event(snap, self.file.num_blocks)
        if snap.step != checkpoint[1]:
            raise ValueError(f"its snapshot is of step {snap.step:,}, not {checkpoint[1]:,}")
        snap.scheduled = [tuple(x) for x in snap.scheduled]
        return snap

    def _books(self, cp: dict[str, Any]) -> tuple[list[int], list[int], dict[int, list[int]]]:
        """A checkpoint's ref counts, hashes and block tables, checked against the header's
        cache: a list of another length, or a block id out of range, corrupts the state."""
        n = self.file.num_blocks
        ref_count = np.frombuffer(cp["ref_count"], dtype="<i4")
        block_hash = list(cp["block_hash"])
        if len(ref_count) != n or len(block_hash) != n or (ref_count < 0).any():
            raise ValueError(f"its ref counts and hashes do not fit {n:,} blocks")
        tables = {}
        for seq_id, table in cp["tables"]:
            if type(seq_id) is not int or seq_id < 0:
                raise ValueError(f"sequence id {_short(seq_id)}")
            if type(table) is not list or not all(type(b) is int and 0 <= b < n for b in table):
                raise ValueError(f"the block table of sequence {seq_id} is out of range")
            tables[seq_id] = list(table)
        return ref_count.tolist(), block_hash, tables

    def _resolve_sources(self, state: CacheState, sources: list) -> None:
        """Fill ``state.block_tokens`` from a checkpoint's block sources, synthesizing every
        recipe-made block in one batch (a cache can hold thousands of them)."""
        from ..workload.mooncake import MOONCAKE_BLOCK_SIZE as M
        from ..workload.mooncake import synthesize_tokens

        bs, n = self.file.block_size, self.file.num_blocks
        wanted: list[tuple[int, int, int]] = []  # block, start in the batch, its first id
        ids: list[int] = []
        vocab = 32000
        for b, seq_id, ref in sources:
            if type(b) is not int or not 0 <= b < n:
                raise ValueError(f"source block {_short(b)} is out of range")
            if seq_id == -1:
                if type(ref) is not bytes or len(ref) != 4 * bs:
                    raise ValueError(f"the tokens of block {b} are not one block's")
                state.block_tokens[b] = _tokens(ref)
                continue
            if type(ref) is not int:
                raise ValueError(f"block {b} names block index {_short(ref)}")
            start, end = ref * bs, (ref + 1) * bs
            entry = self.prompts.block_of(seq_id, start, end)
            if isinstance(entry, bytes):
                state.block_tokens[b] = _tokens(entry[4 * start : 4 * end])
                continue
            lo, hi = start // M, -(-end // M)
            if entry[3] != vocab:  # made with another vocabulary: not part of the batch
                state.block_tokens[b] = self.prompts.prompt_slice(seq_id, start, end)
                continue
            wanted.append((b, len(ids) * M + start - lo * M, end - start))
            ids.extend(entry[1][lo:hi])
        if wanted:
            tokens = synthesize_tokens(ids, len(ids) * M, vocab)
            for b, at, n in wanted:
                state.block_tokens[b] = tokens[at : at + n]
