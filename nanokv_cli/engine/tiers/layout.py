"""The disk tier's file format (version 1).

One file per fingerprint, ``<digest>.kvtier`` (the digest covers the fingerprint and the
format version), in the tier's directory, beside its lock file ``<digest>.kvtier.lock``::

    offset 0       file header, one 4 KiB page:
                     magic b"NKVTIER\\0", u32 format version, u32 flags (0),
                     u64 slot size, u64 block bytes, u32 fingerprint length,
                     fingerprint (msgpack), u64 xxh3 of everything before it; zero padding
    offset 4096    slot 0, slot 1, ... each ``slot_size`` bytes (a multiple of 4 KiB):
                     payload: the block's K/V, C order of [layers, 2, block_size, kv_heads,
                       head_dim], raw little-endian elements
                     entry header: magic b"KVBK", u32 token count, u64 block hash,
                       u64 payload checksum (xxh3-64 of payload then token bytes),
                       token ids (int64 each), u64 xxh3 of the header so far,
                       u64 last-use tick (LRU order; outside the checksum: rewritten on
                       every hit, and a damaged tick only reorders eviction)
                     zero padding to the slot size

All integers little-endian. The payload comes first and its header after it, in one write,
and a reused slot's old header is zeroed before that write: a write torn by a kill leaves a
slot whose header is missing or fails its checksum, which the next open treats as empty. The
payload checksum is checked on every load, so bytes damaged later read as a miss too.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from .fingerprint import Fingerprint

FORMAT_VERSION = 1
FILE_MAGIC = b"NKVTIER\0"
ENTRY_MAGIC = b"KVBK"
PAGE = 4096
FILE_HEADER_BYTES = PAGE
SUFFIX = ".kvtier"

_FILE_HEAD = struct.Struct("<8sIIQQI")
_ENTRY_HEAD = struct.Struct("<4sIQQ")
_U64 = struct.Struct("<Q")
_VERSION_AT = len(FILE_MAGIC)


def file_name(fingerprint: Fingerprint) -> str:
    """The tier file of ``fingerprint``: another model, layout or format, another file."""
    return fingerprint.digest(salt=f"nanokv-tier-v{FORMAT_VERSION}".encode()) + SUFFIX


def entry_bytes(block_size: int) -> int:
    """Bytes of an entry header for blocks of ``block_size`` tokens."""
    return _ENTRY_HEAD.size + 8 * block_size + 2 * _U64.size


def slot_size(fingerprint: Fingerprint) -> int:
    """Bytes per slot: payload and entry header, rounded up to whole pages so every payload
    starts page-aligned (the OS reads it in whole pages)."""
    used = fingerprint.block_bytes + entry_bytes(fingerprint.block_size)
    return -(-used // PAGE) * PAGE


def file_header(fingerprint: Fingerprint) -> bytes:
    """The exact header page a file of ``fingerprint`` starts with."""
    identity = fingerprint.to_bytes()
    head = _FILE_HEAD.pack(
        FILE_MAGIC,
        FORMAT_VERSION,
        0,
        slot_size(fingerprint),
        fingerprint.block_bytes,
        len(identity),
    )
    body = head + identity
    page = body + _U64.pack(xxhash.xxh3_64_intdigest(body))
    if len(page) > FILE_HEADER_BYTES:
        raise ValueError("fingerprint too long for the tier file's header page")
    return page.ljust(FILE_HEADER_BYTES, b"\0")


def header_problem(found: bytes, expected: bytes) -> str | None:
    """Why the header page ``found`` is not ``expected`` (None when it is): the reason the
    file is started afresh, for the tier's stats."""
    if found == expected:
        return None
    if len(found) < _FILE_HEAD.size:
        return "file shorter than its header (truncated)"
    magic, version, _, _, _, length = _FILE_HEAD.unpack_from(found)
    if magic != FILE_MAGIC:
        return "not a KV tier file (bad magic)"
    if version != FORMAT_VERSION:
        newer = "newer" if version > FORMAT_VERSION else "older"
        return f"written in a {newer} format (version {version}; this reads {FORMAT_VERSION})"
    end = _FILE_HEAD.size + length
    if len(found) < end + _U64.size:
        return "file shorter than its header (truncated)"
    (checksum,) = _U64.unpack_from(found, end)
    if checksum != xxhash.xxh3_64_intdigest(found[:end]):
        return "damaged header (checksum)"
    if found[_FILE_HEAD.size : end] != expected[_FILE_HEAD.size : end]:
        return "another model's or cache layout's fingerprint"
    return "another block layout"


@dataclass
class Entry:
    """An entry header's contents: the slot it lives in, and its last-use tick."""

    slot: int
    block_hash: int
    tokens: bytes
    checksum: int
    tick: int


def pack_entry(entry: Entry) -> bytes:
    """The entry header of ``entry`` (its header checksum and tick included)."""
    body = (
        _ENTRY_HEAD.pack(ENTRY_MAGIC, len(entry.tokens) // 8, entry.block_hash, entry.checksum)
        + entry.tokens
    )
    return body + _U64.pack(xxhash.xxh3_64_intdigest(body)) + _U64.pack(entry.tick)


def unpack_entry(data: bytes, slot: int, block_size: int) -> Entry | str:
    """The entry in header bytes ``data``, or "empty" (a slot never written, or zeroed before
    a write that did not finish) or "corrupt" (anything else that fails its checks)."""
    if len(data) != entry_bytes(block_size):
        return "corrupt"
    magic, count, block_hash, checksum = _ENTRY_HEAD.unpack_from(data)
    if magic != ENTRY_MAGIC:
        return "empty" if magic == b"\0\0\0\0" else "corrupt"
    end = _ENTRY_HEAD.size + 8 * block_size
    if count != block_size or _U64.unpack_from(data, end)[0] != xxhash.xxh3_64_intdigest(
        data[:end]
    ):
        return "corrupt"
    tick = _U64.unpack_from(data, end + _U64.size)[0]
    return Entry(slot, block_hash, bytes(data[_ENTRY_HEAD.size : end]), checksum, tick)


def tick_offset(block_size: int) -> int:
    """Where, from an entry header's start, its last-use tick sits."""
    return entry_bytes(block_size) - _U64.size


def pack_tick(tick: int) -> bytes:
    return _U64.pack(tick)


def payload_checksum(payload: list[memoryview], tokens: bytes) -> int:
    """xxh3-64 of a block's payload runs, then its token bytes: covers the K/V and the
    tokens they belong to."""
    digest = xxhash.xxh3_64()
    for run in payload:
        digest.update(run)
    digest.update(tokens)
    return digest.intdigest()
