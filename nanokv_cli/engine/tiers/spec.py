"""The spelling of a KV tier setting: ``disk:PATH:SIZE`` or ``host:SIZE``.

SIZE is a byte count or a number with a unit. Units follow ``dd``: a bare letter or one with
``i`` is binary (``2G`` = ``2GiB`` = 2 * 1024**3 bytes), a letter with ``B`` is decimal
(``2GB`` = 2 * 1000**3 bytes). Units ignore case; fractions are allowed (``1.5GiB``) and round
down to whole bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

SPELLING = (
    "disk:PATH:SIZE or host:SIZE, SIZE a byte count or a number with a unit "
    "(8GiB, 512MiB, 2G, 100M, 5GB)"
)
MEDIA = ("disk", "host")
# Restore speeds a tier is assumed to have, GB/s, where ``--kv-tier-bandwidth`` gives none:
# scripts/bench/tier.py on the development VM (scripts/BENCHMARKS.md). disk: a cold read
# from the storage device (a file in the page cache reads ~6 GB/s); host: a memory copy,
# below what pinned memory reaches over PCIe, so a host tier is never assumed faster than it is.
TIER_BANDWIDTH_GBPS = {"disk": 1.6, "host": 8.8}

_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)", re.IGNORECASE)


@dataclass(frozen=True)
class TierSpec:
    """Where a tier keeps evicted blocks and how many bytes it may use there."""

    medium: Literal["disk", "host"]
    size_bytes: int
    path: str | None = None

    def __str__(self) -> str:
        size = format_size(self.size_bytes)
        return f"disk:{self.path}:{size}" if self.medium == "disk" else f"host:{size}"


def parse_size(text: str) -> int:
    """Bytes in ``text`` (``8GiB``, ``2G``, ``100MB``, ``4096``); ValueError when unreadable
    or not positive."""
    match = _SIZE.fullmatch(text.strip())
    # "2iB" or "2i" name no unit: only a unit letter may carry the "i".
    if match is None or (match.group(3) and not match.group(2)):
        raise ValueError(f"unreadable size {text!r}: expected {SPELLING}")
    number, unit, binary, byte_suffix = match.groups()
    decimal = bool(byte_suffix) and not binary and bool(unit)
    base = 1000 if decimal else 1024
    power = _POWERS[unit.lower()]
    # Whole numbers stay integers so a large byte count is exact (no float rounding).
    if "." in number:
        size = int(float(number) * base**power)
    else:
        size = int(number) * base**power
    if size <= 0:
        raise ValueError(f"tier size must be above zero bytes, got {text!r}: expected {SPELLING}")
    return size


def format_size(size: int) -> str:
    """``size`` bytes in the largest binary unit that keeps it whole, e.g. ``8GiB``; a byte
    count when none does, so parse_size(format_size(n)) == n."""
    for unit, power in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if size % 1024**power == 0:
            return f"{size // 1024**power}{unit}"
    return str(size)


def parse_tier(text: str) -> TierSpec:
    """The TierSpec ``text`` spells; ValueError naming the accepted spelling when it is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"empty tier setting: expected {SPELLING}")
    text = text.strip()
    medium, sep, rest = text.partition(":")
    medium = medium.strip().lower()
    if medium not in MEDIA:
        raise ValueError(f"unknown tier medium {medium!r} in {text!r}: expected {SPELLING}")
    if not sep or not rest.strip():
        raise ValueError(f"tier {text!r} has no SIZE: expected {SPELLING}")
    if medium == "host":
        if ":" in rest:
            raise ValueError(f"a host tier takes no path, got {text!r}: expected host:SIZE")
        return TierSpec("host", _size_of(rest, text))
    # A path may itself hold ':'; SIZE never does, so it is split off the right end.
    path, sep, size = rest.rpartition(":")
    if not sep:
        raise ValueError(f"a disk tier needs a path, got {text!r}: expected disk:PATH:SIZE")
    if not path.strip():
        raise ValueError(f"empty path in tier {text!r}: expected disk:PATH:SIZE")
    return TierSpec("disk", _size_of(size, text), path)


def _size_of(size: str, text: str) -> int:
    try:
        return parse_size(size)
    except ValueError as exc:
        raise ValueError(f"in tier {text!r}: {exc}") from None
