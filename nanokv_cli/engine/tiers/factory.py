"""Opening the tier a TierSpec names."""

from __future__ import annotations

from .base import Tier
from .disk import DiskTier
from .fingerprint import Fingerprint
from .host import HostTier
from .spec import TierSpec, parse_tier


def open_tier(spec: TierSpec | str, fingerprint: Fingerprint, *, pin: bool = True) -> Tier:
    """The tier ``spec`` names (a TierSpec or its spelling, ``disk:PATH:SIZE``/``host:SIZE``)
    for blocks of ``fingerprint``. ValueError for a bad spelling; TierUnavailable when the
    tier cannot be opened (its message is one line for the engine to show). ``pin``: pin a
    host tier's buffers when CUDA is present."""
    if isinstance(spec, str):
        spec = parse_tier(spec)
    if spec.medium == "disk":
        return DiskTier(spec.path, spec.size_bytes, fingerprint)
    if spec.medium == "host":
        return HostTier(spec.size_bytes, fingerprint, pin=pin)
    raise ValueError(f"unknown tier medium {spec.medium!r}")
