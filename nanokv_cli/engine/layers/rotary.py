"""Rotary position embedding (half-split "NeoX" layout, as in transformers' Llama/Qwen).

cos/sin are precomputed in float32 up to the longest position the engine allows, stored in the
form the rotation consumes (``cos`` duplicated over both halves, ``sin`` with the first half
negated), and looked up once per step for all layers.
"""

import math
from typing import Any

import torch
from torch import nn


def inv_frequencies(
    head_dim: int, base: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Per-pair rotation frequencies, with the config's ``rope_scaling`` applied."""
    # Same arithmetic as transformers (int64 arange cast to float) so fp32 results match bit for bit.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = (rope_scaling or {}).get("rope_type") or (rope_scaling or {}).get("type")
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inv_frequencies(head_dim, base, rope_scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        # [max_position, 2, head_dim]: one index_select per step fetches both.
        table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)
        self.register_buffer("cos_sin", table, persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [num_tokens, 1, head_dim] in ``dtype``, for these positions."""
        cs = self.cos_sin.index_select(0, positions).to(dtype)
        return cs[:, 0].unsqueeze(1), cs[:, 1].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim]: x*cos + rotate_half(x)*sin.

    rotate_half(x) = [-x2, x1]; with the sign folded into ``sin`` it is a roll by half the head.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
