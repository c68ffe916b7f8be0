"""A tier as a model run uses it: evicted blocks stored from the runner's K/V cache, restored
blocks read into staging buffers and written into their new blocks before the forward pass.

The block manager's books (books.py) call ``save`` when a block is evicted: its K/V are still
in the block then (nothing overwrote them yet), so the store reads the cache in place. A
restore is read from the tier at once (``fetch``: a block that fails the tier's checks is a
miss before anything is counted) into a staging buffer, and ``apply`` writes the buffers
into their blocks when the runner starts its next step: after the step's token-granular
copies (``ModelRunner.copy_kv``), whose sources may be blocks taken for restores in the same
step, and before the forward pass reads them. A block evicted again before that is stored
from its buffer, and a block taken for other data drops its buffer (``cancel``).

Blocks are keyed by the chained hash, checked against their token ids and kept in a file (or
host memory) of the ``Fingerprint``: the weights' identity, dtypes, quantization and block
shape, so another model or block size finds nothing of this one's.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import xxhash

from .base import Tier, TierUnavailable
from .buffers import staging_like
from .factory import open_tier
from .fingerprint import Fingerprint
from .spec import TierSpec

SPARE_BUFFERS = 64  # staging buffers kept for reuse: a few steps' restores, not a second cache
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")
_SAMPLE = 1 << 20  # bytes read from each end of a weights file for its identity


class KVTierWarning(UserWarning):
    """The tier asked for could not be opened; the engine runs on without it."""


def weights_identity(source: str | os.PathLike) -> str:
    """32 hex digits naming a model's weights: each weights file's name, size and first and
    last MiB (a fine-tune of the same shape differs there), with the folder's config. Where
    the model lies does not count, so a copy of it finds its tier; reading whole files would
    take seconds for large models at every start."""
    path = Path(source)
    files = (
        [path]
        if path.is_file()
        else sorted(
            p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json"
        )
    )
    digest = xxhash.xxh3_128()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(_SAMPLE))
            if size > _SAMPLE:
                f.seek(max(_SAMPLE, size - _SAMPLE))
                digest.update(f.read(_SAMPLE))
    return digest.hexdigest()


def check_tier_device(spec: TierSpec | None, device: torch.device) -> None:
    """ValueError for a host tier on a CPU run (before anything is loaded)."""
    if spec is not None and spec.medium == "host" and device.type != "cuda":
        raise ValueError(
            f"kv_tier {spec}: a host tier holds blocks evicted from a GPU's cache in CPU "
            "memory; on CPU the KV cache is in that memory already. Use disk:PATH:SIZE"
        )


class ModelTier:
    """The backend of a model run's tier books (see ``books.TierBackend``)."""

    def __init__(self, tier: Tier, kv_cache: torch.Tensor, bandwidth: float) -> None:
        fingerprint = tier.fingerprint
        self.tier = tier
        self.kv_cache = kv_cache
        self.medium = tier.medium
        self.block_bytes = fingerprint.block_bytes
        self.capacity_blocks = tier.capacity_bytes // fingerprint.block_bytes
        self.bandwidth = bandwidth
        self._shape, self._dtype = fingerprint.block_shape, fingerprint.torch_kv_dtype
        self._pin = kv_cache.device.type == "cuda"
        self._staged: dict[int, torch.Tensor] = {}  # block id -> its K/V, to write
        self._spare: list[torch.Tensor] = []
        self._s_per_token: float | None = None

    def save(self, block_id: int, block_hash: int, token_ids) -> bool:
        staged = self._staged.get(block_id)  # restored but not yet written: the buffer holds it
        source = staged if staged is not None else self.kv_cache[:, :, block_id]
        return self.tier.store(block_hash, token_ids, source)

    def fetch(self, block_hash: int, token_ids) -> torch.Tensor | None:
        buffer = (
            self._spare.pop() if self._spare else staging_like(self._shape, self._dtype, self._pin)
        )
        if self.tier.load(block_hash, token_ids, buffer):
            return buffer
        self._spare.append(buffer)
        return None

    def place(self, block_id: int, handle: torch.Tensor) -> None:
        self.cancel(block_id)
        self._staged[block_id] = handle

    def cancel(self, block_id: int) -> None:
        buffer = self._staged.pop(block_id, None)
        if buffer is not None and len(self._spare) < SPARE_BUFFERS:
            self._spare.append(buffer)

    def apply(self) -> None:
        """Write the staged blocks into the cache (the runner, before its forward pass)."""
        if not self._staged:
            return
        staged, self._staged = self._staged, {}
        cache = self.kv_cache
        for block_id, buffer in staged.items():
            cache[:, :, block_id].copy_(buffer)
        # The copies are synchronous (non_blocking off), so the buffers are free again.
        self._spare.extend(list(staged.values())[: SPARE_BUFFERS - len(self._spare)])

    @property
    def num_staged(self) -> int:
        return len(self._staged)

    def held(self) -> list[tuple[int, bytes]]:
        return self.tier.entries()

    def observe(self, tokens: int, seconds: float, block_size: int) -> None:
        """A step computed ``tokens`` in ``seconds``: the prefill speed restores are weighed
        against (steps of at least a block's tokens: decode steps cost per row, not token)."""
        if tokens >= block_size and seconds > 0:
            rate = seconds / tokens
            old = self._s_per_token
            self._s_per_token = rate if old is None else 0.7 * old + 0.3 * rate

    def recompute_s_per_token(self) -> float | None:
        return self._s_per_token

    def close(self) -> None:
        self.tier.close()


def open_model_tier(
    spec: TierSpec | None,
    bandwidth: float,
    kv_cache: torch.Tensor,
    source: str,
    dtype: torch.dtype,
    quantization: str | None,
) -> tuple[ModelTier | None, str | None]:
    """The tier ``spec`` names (``EngineConfig.tier_spec``; ``bandwidth``: its restore speed,
    bytes per second) for this cache and model, and the line to show at start-up. A tier that cannot be opened (path unusable, disk full, another process holds
    it) gives None, a one-line reason and a KVTierWarning: the engine runs on without it."""
    if spec is None:
        return None, None
    fingerprint = Fingerprint.for_cache(
        kv_cache,
        weights_identity(source),
        str(dtype).removeprefix("torch."),
        quantization or "none",
    )
    try:
        tier = open_tier(spec, fingerprint, pin=kv_cache.device.type == "cuda")
    except TierUnavailable as exc:
        note = f"nanokv: KV tier off, running without it: {exc}"
        warnings.warn(note, KVTierWarning, stacklevel=3)
        return None, note
    backend = ModelTier(tier, kv_cache, bandwidth)
    held = min(len(tier), backend.capacity_blocks)
    mb = fingerprint.block_bytes / 1e6
    note = (
        f"nanokv: KV tier {spec}: {backend.capacity_blocks:,} blocks of {mb:.2f} MB, "
        f"{held:,} kept from before"
    )
    stats = tier.stats()
    if stats.reset_reason:
        note += f" (a file there was set aside: {stats.reset_reason})"
    return backend, note
