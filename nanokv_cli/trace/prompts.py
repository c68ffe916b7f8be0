"""A trace's prompts: the only place its prompt tokens are stored, read record by record as a
view asks for them (token bytes, or the recipe a synthesized prompt is made from)."""

from __future__ import annotations

import bisect
from array import array
from typing import Any

from .format import (
    _PREFIX,
    MAX_HASH_IDS,
    TraceError,
    _MissingPrompt,
    _OverLimit,
    _reason,
    _short,
    _tokens,
)
from .records import Record, RecordFile


class PromptStore:
    """The prompts of a version-2 trace's prompt records, each record decoded once and kept;
    a record left out of the file's index (its events were never written) is checked too."""

    def __init__(self, file: RecordFile) -> None:
        self.file = file
        self.path = file.path
        self._cache: dict[int, dict[int, Any]] = {}  # record offset -> its prompts
        if file.left_out is not None:
            self._prompt_entries(file.left_out)
        self._records = [r for r in file.records if r[0] == b"P"]
        self._firsts = [r[1] for r in self._records]

    def prompts_of(self, seq_id: int) -> dict[int, Any]:
        # Prompt records come in seq-id order (an engine numbers requests as they arrive).
        if type(seq_id) is not int:
            raise TraceError(f"{self.path}: sequence id {_short(seq_id)} is not valid")
        i = bisect.bisect_right(self._firsts, seq_id) - 1
        if i >= 0 and seq_id <= self._records[i][2]:
            rec = self._records[i]
            got = self._cache.get(rec[3])
            if got is None:
                got = self._cache[rec[3]] = self._prompt_entries(rec)
            if seq_id in got:
                return got
        raise _MissingPrompt(f"{self.path}: the prompt of sequence {seq_id} is missing")

    def _prompt_entries(self, rec: Record) -> dict[int, Any]:
        """A prompt record's prompts by sequence id, each checked (tokens within the caps, a
        recipe that makes a prompt), so no reader of them meets a malformed one."""
        _, first, last, at, _ = rec
        items = self.file.payload(rec)
        where = at - _PREFIX.size
        got: dict[int, Any] = {}
        try:
            if type(items) is not list or not items:
                raise ValueError("not a list of prompts")
            previous = first - 1
            for item in items:
                if type(item) is not list or len(item) != 2:
                    raise ValueError(f"prompt entry {_short(item)} is not [sequence, prompt]")
                seq_id, entry = item
                if type(seq_id) is not int or not previous < seq_id <= last:
                    raise ValueError(f"sequence {_short(seq_id)} is out of order or range")
                got[seq_id] = self._checked_prompt(seq_id, entry)
                previous = seq_id
            if items[0][0] != first or previous != last:
                raise ValueError(f"its prompts are of sequences other than {first} to {last}")
        except _OverLimit as e:
            raise TraceError(f"{self.path}: the prompts record at byte {where}: {e}") from None
        except ValueError as e:
            raise TraceError(
                f"{self.path}: damaged record at byte {where} ({_reason(e)})"
            ) from None
        return got

    def _checked_prompt(self, seq_id: int, entry: Any) -> Any:
        limit = self.file.prompt_limit
        if type(entry) is bytes:
            if len(entry) % 4:
                raise ValueError(f"the prompt of sequence {seq_id} is not whole int32 tokens")
            n = len(entry) // 4
        else:
            from ..workload.mooncake import SynthesizedPrompt

            hash_ids = entry[1] if type(entry) is list and len(entry) == 4 else ()
            if isinstance(hash_ids, list) and len(hash_ids) > MAX_HASH_IDS:
                raise _OverLimit(
                    f"the prompt of sequence {seq_id} names {len(hash_ids):,} hash ids; "
                    f"the limit is {MAX_HASH_IDS:,}"
                )
            n = SynthesizedPrompt.from_recipe(entry).input_length
        if n > limit:
            raise _OverLimit(
                f"the prompt of sequence {seq_id} has {n:,} tokens; the limit is {limit:,} "
                "(the header's cache, or the most any prompt has)"
            )
        return entry

    @staticmethod
    def _prompt_len(entry: Any) -> int:
        return len(entry) // 4 if type(entry) is bytes else entry[2]

    def prompt(self, seq_id: int) -> tuple[array, list | None]:
        """A sequence's prompt tokens (a compact array), and its recipe if it was synthesized."""
        entry = self.prompts_of(seq_id)[seq_id]
        self.file.budget.spend_tokens(seq_id, self._prompt_len(entry))
        if isinstance(entry, bytes):
            return _tokens(entry), None
        from ..workload.mooncake import SynthesizedPrompt

        return SynthesizedPrompt.from_recipe(entry)(), entry

    def block_of(self, seq_id: int, start: int, end: int) -> Any:
        """The prompt entry a block of tokens ``start..end`` of ``seq_id`` comes from; a block
        past the prompt's end is a damaged reference, not an empty block."""
        entry = self.prompts_of(seq_id)[seq_id]
        if not 0 <= start < end <= self._prompt_len(entry):
            raise ValueError(
                f"tokens {start:,} to {end:,} are past the prompt of sequence {seq_id}"
            )
        return entry

    def prompt_slice(self, seq_id: int, start: int, end: int) -> list[int]:
        entry = self.block_of(seq_id, start, end)
        if isinstance(entry, bytes):
            return _tokens(entry[4 * start : 4 * end])
        from ..workload.mooncake import MOONCAKE_BLOCK_SIZE, synthesize_tokens

        _, hash_ids, _, vocab = entry
        lo, hi = start // MOONCAKE_BLOCK_SIZE, -(-end // MOONCAKE_BLOCK_SIZE)
        part = synthesize_tokens(hash_ids[lo:hi], (hi - lo) * MOONCAKE_BLOCK_SIZE, vocab)
        off = lo * MOONCAKE_BLOCK_SIZE
        return part[start - off : end - off]
