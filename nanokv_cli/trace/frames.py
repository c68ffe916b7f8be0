"""Reading a record's payload safely: one zstd frame, bounded before its output is allocated,
and the length of the msgpack array it opens with, read before it is unpacked."""

from __future__ import annotations

import struct
from typing import IO

import zstandard

from .format import _OverLimit


def _array_len(raw: bytes) -> int:
    """The length of the msgpack array ``raw`` opens with, or -1: read before unpacking, so an
    oversized record is refused without being built."""
    c = raw[0] if raw else 0
    if 0x90 <= c <= 0x9F:
        return c & 0x0F
    if c == 0xDC and len(raw) >= 3:
        return struct.unpack_from(">H", raw, 1)[0]
    if c == 0xDD and len(raw) >= 5:
        return struct.unpack_from(">I", raw, 1)[0]
    return -1


def _decompress(data: bytes, cap: int) -> bytes:
    """One zstd frame, refused before its output is allocated when it declares more than
    ``cap`` bytes (or, declaring nothing, makes more)."""
    size = zstandard.frame_content_size(data)
    if size > cap:
        raise _OverLimit(f"declares {size:,} bytes decompressed; the limit is {cap:,}")
    if size >= 0:  # zstd checks that the frame makes exactly what it declares
        return zstandard.ZstdDecompressor().decompress(data)
    raw = zstandard.ZstdDecompressor().stream_reader(data).read(cap + 1)
    if len(raw) > cap:
        raise _OverLimit(f"makes over {cap:,} bytes decompressed; the limit is {cap:,}")
    return raw


def _frame_end(f: IO[bytes], start: int, end: int, cap: int) -> int | None:
    """Where the zstd frame at ``start`` ends, if before ``end``; None if the file ends inside
    it (a torn write). Fed in small pieces, so no piece makes more than a few MB."""
    d = zstandard.ZstdDecompressor().decompressobj()
    made = 0
    f.seek(start)
    at = start
    while at < end:
        chunk = f.read(min(1 << 16, end - at))
        if not chunk:
            return None
        for i in range(0, len(chunk), 256):
            piece = chunk[i : i + 256]
            made += len(d.decompress(piece))
            if d.eof:
                return at + i + len(piece) - len(d.unused_data)
            if made > cap:
                raise _OverLimit(f"makes over {cap:,} bytes decompressed; the limit is {cap:,}")
        at += len(chunk)
    return None
