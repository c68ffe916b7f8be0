"""A GGUF file seen as a Hugging Face model: its config rebuilt from the metadata, its
tokenizer, and its tensors by Hugging Face name, dequantized when looked up and kept by none.

llama.cpp's converter changes a few things on the way in, undone here: Llama's Q/K rows are
reordered (`_unpermute_rows`), and Llama 3 rope scaling is stored as per-frequency factors
(`rope_freqs.weight`), from which the parameters are recovered (`_llama3_rope_scaling`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import ModelConfig
from .gguf_file import QuantizedTensor, check_dequantizable, dequantize, read_gguf
from .loaded_model import merge_eos_ids, model_config, tokenizer_errors
from .model_errors import ModelLoadError, UnsupportedArchitectureError
from .tokenizer import Tokenizer
from .weight_names import (
    GGUF_ARCHITECTURES,
    ROPE_FREQS,
    check_weights,
    expected_shapes,
    hf_tensor_name,
)

if TYPE_CHECKING:
    import torch


class _LazyTensors(Mapping[str, Any]):
    """A read-only mapping whose values are built when looked up and not kept, so a model's
    float32 weights exist one at a time while they are copied into the model."""

    def __init__(self, names: Iterable[str], build: Callable[[str], Any]) -> None:
        self._names = dict.fromkeys(names)
        self._build = build

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return self._build(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would build the value
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"<{len(self)} tensors, each built when looked up>"


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file seen as a Hugging Face model: config, tokenizer, tensors by HF name."""

    config: ModelConfig
    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    tensors: dict[str, QuantizedTensor]  # as stored, by Hugging Face name
    row_heads: dict[str, int]  # module ("q_proj") -> heads whose rows llama.cpp reordered

    def weights(self) -> Mapping[str, torch.Tensor]:
        return _LazyTensors(self.tensors, self.weight)

    def blocks(self) -> Mapping[str, QuantizedTensor]:
        return _LazyTensors((n for n, t in self.tensors.items() if len(t.shape) == 2), self.block)

    def weight(self, name: str) -> torch.Tensor:
        values = dequantize(self.tensors[name])
        heads = self.row_heads.get(name.split(".")[-2])
        return values if heads is None else _unpermute_rows(values, heads)

    def block(self, name: str) -> QuantizedTensor:
        raw = self.tensors[name]
        heads = self.row_heads.get(name.split(".")[-2])
        if heads is None:
            return raw
        return QuantizedTensor(_unpermute_rows(raw.data, heads), raw.qtype, raw.shape)


def open_gguf_model(path: Path) -> GGUFModel:
    """Read and check a GGUF file's metadata and tensor index (no tensor data is read)."""
    gguf = read_gguf(path)
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {supported})"
        )
    with tokenizer_errors(path):
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    hf_config = _hf_config_from_gguf(meta, arch, gguf.tensors, tokenizer, path)
    config = model_config(hf_config, path, arch)
    merge_eos_ids(config, tokenizer, [])
    tensors = {
        hf_tensor_name(name, path): tensor
        for name, tensor in gguf.tensors.items()
        if name != ROPE_FREQS
    }
    shapes = expected_shapes(config)
    check_weights(tensors, shapes, path)
    unused = sorted(set(tensors) - set(shapes))
    if unused:
        raise ModelLoadError(
            f"{path}: unexpected tensors for a {config.architecture} model: {unused[:3]}"
        )
    for name, tensor in tensors.items():
        check_dequantizable(tensor, name, path)
    row_heads = {}
    if arch == "llama":
        row_heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    return GGUFModel(config, hf_config, tokenizer, tensors, row_heads)


def _hf_config_from_gguf(
    meta: Mapping[str, Any],
    arch: str,
    tensors: Mapping[str, QuantizedTensor],
    tokenizer: Tokenizer,
    path: Path,
) -> dict[str, Any]:
    def get(key: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is ...:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    # Values go in as the file holds them: ModelConfig.validate checks types and bounds, and
    # model_config's message names the GGUF key (weight_names.gguf_key).
    intermediate = get("feed_forward_length")
    if isinstance(intermediate, list):  # per-layer sizes: not a plain Llama/Qwen model
        raise UnsupportedArchitectureError(
            f"{path}: per-layer feed-forward sizes are not supported"
        )
    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or get("vocab_size")
    heads, hidden = get("attention.head_count"), get("embedding_length")
    counts = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, hidden))
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        # Derived only from sound counts: else left to validate() to name the bad one.
        "head_dim": get("attention.key_length", hidden // heads if counts else None),
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _float32_value(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_ids,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    rope_scaling = _gguf_rope_scaling(get, config, tensors.get(ROPE_FREQS), path, arch)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


def _float32_value(value: Any) -> Any:
    # GGUF stores float32: 1e-5 comes back as 9.99999974e-06. The shortest decimal that rounds
    # to the same float32 recovers the number the model's config was written with. Anything
    # else (a string, NaN, a float64 past float32's range) is left for validate() to refuse.
    if not isinstance(value, float) or not abs(value) <= np.finfo(np.float32).max:
        return value
    return float(np.format_float_positional(np.float32(value), unique=True))


def _gguf_rope_scaling(
    get: Callable[..., Any],
    config: Mapping[str, Any],
    rope_freqs: QuantizedTensor | None,
    path: Path,
    arch: str,
) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", None)
    factor = get("rope.scaling.factor", None) or get("rope.scale_linear", None)
    if kind in (None, "none") and factor and rope_freqs is None:
        kind = "linear"  # older files wrote only rope.scale_linear
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": kind, "factor": factor or 1.0}
        if original := get("rope.scaling.original_context_length", None):
            scaling["original_max_position_embeddings"] = original
        return scaling
    if rope_freqs is None:
        return None
    check_dequantizable(rope_freqs, ROPE_FREQS, path)
    factors = dequantize(rope_freqs).numpy().astype(np.float64).ravel()
    base = model_config(dict(config), path, arch)  # head_dim and rope_theta checked first
    head_dim = base.head_dim
    finite = bool(np.isfinite(factors).all())
    if factors.size != head_dim // 2 or not finite:
        held = f"{factors.size} values" + ("" if finite else ", not all finite")
        raise ModelLoadError(
            f"{path}: {ROPE_FREQS} should hold {head_dim // 2} finite factors for head_dim "
            f"{head_dim}; it holds {held}"
        )
    inv_freq = 1.0 / base.rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return _llama3_rope_scaling(factors, inv_freq, path)


def _llama3_rope_scaling(
    factors: np.ndarray, inv_freq: np.ndarray, path: Path
) -> dict[str, Any] | None:
    """Recover Llama 3 rope-scaling parameters from llama.cpp's per-frequency divisors."""
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    # Between the two cut-offs the divisor d satisfies 1/d = (1-s)/factor + s with
    # s = (orig_ctx / wavelen - low) / (high - low): linear in 1/wavelen. Only the ratios
    # orig_ctx/(high-low) and low/(high-low) are observable, so fix low_freq_factor = 1.
    inv_wavelen = inv_freq / (2 * math.pi)
    middle = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    candidates = [(1.0, 4.0, 8192)]  # Llama 3.1 / 3.2 values
    if np.count_nonzero(middle) >= 2:
        smooth = (1.0 / factors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        design = np.stack([inv_wavelen[middle], -np.ones_like(smooth)], axis=1)
        slope, intercept = np.linalg.lstsq(design, smooth, rcond=None)[0].tolist()
        if intercept > 0:
            candidates.insert(0, (1.0, round(1.0 + 1.0 / intercept, 6), round(slope / intercept)))
    for low, high, original in candidates:
        if np.allclose(
            _llama3_factors(inv_wavelen, factor, low, high, original), factors, rtol=1e-4
        ):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise UnsupportedArchitectureError(f"{path}: rope_freqs does not match Llama 3 rope scaling")


def _llama3_factors(
    inv_wavelen: np.ndarray, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    ratio = original * inv_wavelen  # original context length / wavelength
    smooth = np.clip((ratio - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _unpermute_rows(values: Any, n_head: int) -> Any:
    # llama.cpp's converter reorders each head's Q/K rows so rotary pairs sit side by side
    # (dims 2i, 2i+1); Hugging Face's Llama rotates dims i and i + head_dim/2. Undo it. A row of
    # blocks moves whole, so the raw blocks (numpy) and float values (torch) are reordered alike.
    rows = values.shape[0]
    split = values.reshape(n_head, rows // n_head // 2, 2, *values.shape[1:])
    return split.swapaxes(1, 2).reshape(values.shape)
