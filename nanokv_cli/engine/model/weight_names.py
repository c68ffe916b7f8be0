"""Parameter names: the Hugging Face set a config implies, and llama.cpp's names mapped to it.

Every model is held by its Hugging Face parameter names ("model.layers.0.self_attn.q_proj.
weight"); a GGUF file's tensors (llama.cpp's "blk.0.attn_q.weight") and metadata keys are
translated here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ModelConfig
from .model_errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from .gguf_file import QuantizedTensor

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp tensor names (convert_hf_to_gguf.py) -> Hugging Face names.
_GGUF_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp stores Llama 3 rope scaling as per-frequency factors


def hf_tensor_name(name: str, path: Path) -> str:
    """The Hugging Face name of a GGUF tensor; ModelLoadError when it has none."""
    stem, _, kind = name.rpartition(".")
    if stem in _GGUF_GLOBAL_TENSORS and kind == "weight":
        return f"{_GGUF_GLOBAL_TENSORS[stem]}.weight"
    match = _GGUF_LAYER_NAME.fullmatch(name)
    if match and match.group(2) in _GGUF_LAYER_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_GGUF_LAYER_TENSORS[part]}.{kind}"
    raise ModelLoadError(
        f"{path}: tensor {name!r} has no counterpart in the supported architectures"
    )


# ModelConfig fields -> the GGUF metadata keys they come from (after "{arch}.").
_GGUF_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "rope_scaling.factor": "rope.scaling.factor",
    "rope_scaling.original_max_position_embeddings": "rope.scaling.original_context_length",
}


def gguf_key(arch: str, field: str) -> str:
    """The GGUF metadata key a ModelConfig field comes from, for error messages."""
    if field == "vocab_size":
        return f"tokenizer.ggml.tokens (or {arch}.vocab_size)"
    key = _GGUF_CONFIG_KEYS.get(field)
    return f"{arch}.{key}" if key else field


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, by Hugging Face name, with its shape."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows = config.num_attention_heads * head_dim
    kv_rows = config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (q_rows, hidden),
            layer + "self_attn.k_proj.weight": (kv_rows, hidden),
            layer + "self_attn.v_proj.weight": (kv_rows, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_rows),
            layer + "mlp.gate_proj.weight": (inter, hidden),
            layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                layer + "self_attn.q_proj.bias": (q_rows,),
                layer + "self_attn.k_proj.bias": (kv_rows,),
                layer + "self_attn.v_proj.bias": (kv_rows,),
            }
        if config.qk_norm:
            shapes |= {
                layer + "self_attn.q_norm.weight": (head_dim,),
                layer + "self_attn.k_norm.weight": (head_dim,),
            }
    return shapes


def check_weights(
    weights: Mapping[str, torch.Tensor | QuantizedTensor],
    shapes: dict[str, tuple[int, ...]],
    where: Path,
) -> None:
    """Refuse weights that miss a parameter of `shapes` or hold one of another shape."""
    for name, shape in shapes.items():
        if name not in weights:
            raise ModelLoadError(f"{where}: weight {name} is missing")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{where}: weight {name} has shape {tuple(weights[name].shape)}, "
                f"the config implies {shape}"
            )
