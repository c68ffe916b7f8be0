"""A version-2 trace file's records: the index its prefixes make, each checked against the
others as the writer writes them, and any record's payload, decoded within the reading limits."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import msgpack

from .budget import ViewBudget
from .format import (
    _DECODE_ERRORS,
    _KIND_NAMES,
    _PREFIX,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_HEADER_STRING,
    MAX_NUM_BLOCKS,
    MAX_PROMPT_TOKENS,
    MAX_RECORD_BYTES,
    MAX_RECORD_EVENTS,
    TRACE_FORMAT,
    TRACE_VERSION,
    TraceError,
    _check_header,
    _OverLimit,
    _reason,
    _short,
)
from .frames import _array_len, _decompress, _frame_end

Record = tuple[bytes, int, int, int, int]  # kind, first, last, payload offset, payload size


class RecordFile:
    """The records of a version-2 trace (its magic already read), its header and the budget
    of the view being read.

    ``left_out`` is a last prompt record whose events were never written (the run was cut
    short): dropped from ``records``, for the prompt store to check all the same."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.note: str | None = None  # set when a torn last record was dropped
        self.header: dict[str, Any] | None = None  # read once the scan has found it
        self.budget = ViewBudget(path)
        self.left_out: Record | None = None
        self._scan()
        self.header = self.payload(self.records[0])
        self._check_header()
        self.prompt_limit = min(MAX_PROMPT_TOKENS, self.num_blocks * self.block_size)
        self._check_order()

    def _scan(self) -> None:
        self.records: list[Record] = []
        size = self.path.stat().st_size
        torn = "the last record is torn (the run was cut short); it was left out"
        with open(self.path, "rb") as f:
            at = len(MAGIC)
            while at < size:
                f.seek(at)
                prefix = f.read(_PREFIX.size)
                if len(prefix) < _PREFIX.size:
                    self.note = torn
                    break
                n, kind, first, last = _PREFIX.unpack(prefix)
                if kind not in b"HPEC":
                    if self.records:
                        raise TraceError(
                            f"{self.path}: damaged record at byte {at} (kind {kind!r})"
                        )
                    self.note = torn
                    break
                if at + _PREFIX.size + n > size:
                    self._check_torn(f, at, kind, n, size)
                    self.note = torn
                    break
                self.records.append((kind, first, last, at + _PREFIX.size, n))
                at += _PREFIX.size + n
        if not self.records or self.records[0][0] != b"H":
            raise TraceError(f"{self.path}: the trace has no header record")

    def _check_torn(self, f: IO[bytes], at: int, kind: bytes, n: int, size: int) -> None:
        """A record whose length runs past the end of the file is torn only if the file ends
        inside its payload; one whose payload ends before that has a damaged length."""
        start = at + _PREFIX.size
        try:
            end = _frame_end(f, start, size, self._cap(kind))
        except _OverLimit as e:
            where = f"{self.path}: the {_KIND_NAMES[kind]} record at byte {at}"
            raise TraceError(f"{where} {e}") from None
        except _DECODE_ERRORS as e:
            raise TraceError(f"{self.path}: damaged record at byte {at} ({_reason(e)})") from None
        if end is not None:
            raise TraceError(
                f"{self.path}: damaged record at byte {at} (its length says {n:,} bytes, "
                f"but its payload is {end - start:,} and the file goes on)"
            )

    def _check_order(self) -> None:
        """Record prefixes checked against each other, as the writer writes them: one header,
        then per flush the prompts it introduces, the events of the steps after the last
        record's (none repeated or skipped), and a checkpoint of the last of those steps."""
        step = 0  # the first step the next events record must hold
        seq_id = -1  # the last sequence a prompt record holds
        for i, (kind, first, last, at, _) in enumerate(self.records):
            where = f"{self.path}: the {_KIND_NAMES[kind]} record at byte {at - _PREFIX.size}"
            after = self.records[i - 1] if i else None
            if kind == b"H" and (i or first or last):
                raise TraceError(f"{where} is a second header (a record repeated or damaged)")
            if kind == b"E":
                if first != step or not first <= last < first + MAX_RECORD_EVENTS:
                    raise TraceError(
                        f"{where} holds steps {first:,} to {last:,}, but the records before it "
                        f"end at step {step - 1:,} (a record repeated, out of order or damaged)"
                    )
                step = last + 1
            elif kind == b"P":
                if not seq_id < first <= last:
                    raise TraceError(
                        f"{where} holds sequences {first:,} to {last:,}, but the records before "
                        f"it reach sequence {seq_id:,} (a record repeated, out of order or damaged)"
                    )
                seq_id = last
                following = self.records[i + 1][0] if i + 1 < len(self.records) else None
                if following not in (b"E", None):
                    raise TraceError(f"{where} is not followed by the events that use it")
            elif kind == b"C" and (
                after is None or after[0] != b"E" or not first == last == after[2]
            ):
                raise TraceError(f"{where} (step {first:,}) does not follow the events of its step")
        if self.records[-1][0] == b"P":
            # Cut short between a prompt record and its events: checked, then left out.
            self.left_out = self.records.pop()
            self.note = self.note or (
                "the last record holds prompts of steps never recorded (the run was cut short); "
                "it was left out"
            )

    def _cap(self, kind: bytes) -> int:
        """The most bytes a record of ``kind`` may decompress to."""
        if kind == b"H":
            return MAX_HEADER_BYTES
        if kind == b"C":  # a ref count, hash, table entry and source fit in 64 bytes a block
            # While the scan runs (telling a torn end from a damaged length) there is no
            # header yet: the largest cache a header may declare bounds it.
            blocks = self.num_blocks if self.header is not None else MAX_NUM_BLOCKS
            return MAX_RECORD_BYTES + 64 * blocks
        return MAX_RECORD_BYTES

    def _limits(self, kind: bytes) -> dict[str, int]:
        """msgpack's limits for a record of ``kind``, checked before each list, map, string or
        byte string is built: no list longer than the record can hold, no token bytes longer
        than a block (events) or a prompt (prompts) or the cache (checkpoints)."""
        if kind == b"H":
            strings, arrays = MAX_HEADER_STRING, 1024
            return {
                "max_str_len": strings,
                "max_bin_len": strings,
                "max_array_len": arrays,
                "max_map_len": arrays,
                "max_ext_len": 0,
            }
        n, bs = self.num_blocks, self.block_size
        if kind == b"C":
            arrays, bins = max(n, MAX_RECORD_EVENTS), 4 * max(n, bs)
        elif kind == b"P":
            arrays, bins = MAX_RECORD_EVENTS, 4 * self.prompt_limit
        else:
            arrays, bins = MAX_RECORD_EVENTS, 4 * bs
        return {
            "max_str_len": 256,
            "max_bin_len": bins,
            "max_array_len": arrays,
            "max_map_len": 256,
            "max_ext_len": 0,
        }

    def payload(self, record: Record) -> Any:
        kind, _, _, at, n = record
        where = at - _PREFIX.size  # the record's own offset, as the scan names a prefix
        cap = self._cap(kind)
        try:
            if n > cap + (cap >> 7) + 1024:  # zstd grows incompressible data by under 1%
                raise _OverLimit(f"is {n:,} bytes; the limit is {cap:,}")
            with open(self.path, "rb") as f:
                f.seek(at)
                data = f.read(n)
            raw = _decompress(data, cap)
            if kind == b"E":
                self.budget.spend_events(_array_len(raw))
            return msgpack.unpackb(raw, raw=False, strict_map_key=False, **self._limits(kind))
        except _OverLimit as e:
            name = _KIND_NAMES[kind]
            raise TraceError(f"{self.path}: the {name} record at byte {where} {e}") from None
        except _DECODE_ERRORS as e:
            if type(e) is ValueError and " exceeds max_" in str(e):  # one of msgpack's limits
                name = _KIND_NAMES[kind]
                raise TraceError(
                    f"{self.path}: the {name} record at byte {where} is over a reading limit "
                    f"({_reason(e)})"
                ) from None
            raise TraceError(
                f"{self.path}: damaged record at byte {where} ({_reason(e)})"
            ) from None

    def _check_header(self) -> None:
        h = self.header
        if not isinstance(h, dict) or h.get("format") != TRACE_FORMAT:
            raise TraceError(f"{self.path}: not a nanokv trace")
        if h.get("version") != TRACE_VERSION:
            raise TraceError(
                f"{self.path}: trace format version {_short(h.get('version'))} is not supported "
                f"(this nanokv reads versions 1 and {TRACE_VERSION})"
            )
        self.model_note = _check_header(self.path, h, TRACE_VERSION)

    @property
    def block_size(self) -> int:
        return self.header["block_size"]

    @property
    def num_blocks(self) -> int:
        return self.header["num_blocks"]
