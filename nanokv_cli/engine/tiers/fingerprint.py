"""What a stored block's K/V depends on besides its tokens: the model and the cache's layout.

Two engines may exchange blocks only when every field agrees; a tier keyed by the block hash
alone would hand one model's K/V to another (same tokens, same hash, different numbers). The
disk tier keeps one file per fingerprint (its name carries the digest) and repeats the
fingerprint in the file's header, so several models can share one tier directory and none
ever reads another's blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import msgpack
import torch
import xxhash

# The header page must hold the fingerprint: an identity longer than a digest is a mistake.
MAX_TEXT_FIELD = 512


def kv_dtype_of(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``bfloat16``, ``torch.float16``); ValueError if none."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV dtype {name!r} (expected a torch dtype name, e.g. bfloat16)")
    return dtype


@dataclass(frozen=True)
class Fingerprint:
    """The identity of a block's K/V apart from its tokens.

    ``model`` names the weights (a digest of their files, say); ``dtype`` the compute dtype;
    ``quantization`` the weights' format ("none", "q8_0"...); ``kv_dtype`` the cache's element
    type. The rest is the shape of one block: ``[num_layers, 2, block_size, num_kv_heads,
    head_dim]``. A quantized cache whose blocks carry scales needs those in the shape first.
    """

    model: str
    dtype: str
    quantization: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type == "str":
                if not isinstance(value, str) or len(value) > MAX_TEXT_FIELD:
                    raise ValueError(
                        f"fingerprint {field.name} must be a string of at most "
                        f"{MAX_TEXT_FIELD} characters, got {value!r:.80}"
                    )
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"fingerprint {field.name} must be a positive int, got {value!r}")
        # One spelling per dtype, so "torch.bfloat16" and "bfloat16" share a digest.
        object.__setattr__(self, "kv_dtype", str(kv_dtype_of(self.kv_dtype)).removeprefix("torch."))

    @classmethod
    def for_cache(
        cls, kv_cache: torch.Tensor, model: str, dtype: str, quantization: str = "none"
    ) -> Fingerprint:
        """The fingerprint of the engine's cache tensor
        ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                "expected a KV cache [num_layers, 2, num_blocks, block_size, num_kv_heads, "
                f"head_dim], got shape {tuple(kv_cache.shape)}"
            )
        layers, _, _, block_size, heads, head_dim = kv_cache.shape
        kv_dtype = str(kv_cache.dtype).removeprefix("torch.")
        return cls(model, dtype, quantization, kv_dtype, block_size, layers, heads, head_dim)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return kv_dtype_of(self.kv_dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """The shape of one block of the cache, ``kv[:, :, b]``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of K/V in one block."""
        count = 1
        for size in self.block_shape:
            count *= size
        return count * self.torch_kv_dtype.itemsize

    def to_bytes(self) -> bytes:
        """A canonical serialisation (keys sorted), the same bytes for equal fingerprints."""
        return msgpack.packb(dict(sorted(asdict(self).items())), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> Fingerprint:
        """The fingerprint ``to_bytes`` wrote; ValueError for anything else."""
        try:
            values = msgpack.unpackb(data, raw=False)
            return cls(**values)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"not a serialised fingerprint: {exc}") from None

    def digest(self, salt: bytes = b"") -> str:
        """32 hex digits that differ for different fingerprints (and salts)."""
        return xxhash.xxh3_128_hexdigest(salt + self.to_bytes())
