"""Tiny random Hugging Face models for tests, and their GGUF twins.

    from support.models import make_tiny_model, write_gguf

    folder = make_tiny_model("llama", tmp_path / "llama")          # or "qwen2", "qwen3"
    gguf_file = write_gguf(folder, tmp_path / "llama.gguf")         # F32; quantization="Q8_0" too

`make_tiny_model` writes a complete model folder (config.json, safetensors weights,
generation_config.json, tokenizer.json, tokenizer_config.json with a ChatML template) that
transformers' `from_pretrained` and nanokv's loader both read. Everything is built from a fixed
seed, so two calls with the same arguments give the same weights.

`write_gguf` converts such a folder the way llama.cpp's convert_hf_to_gguf.py does (tensor names,
metadata keys, Llama Q/K row permutation, byte-level BPE vocabulary, rope_freqs for Llama 3 rope
scaling), so tests can check nanokv's GGUF path against the safetensors one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from nanokv_cli.engine.config import ModelConfig

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
BOS_ID, EOS_ID = 1, 2

_CORPUS = [
    "The capital of France is Paris.",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A prefix cache lets requests that share a prompt reuse its blocks.",
    "In 2024 the model generated 12345 tokens per second!",
    "Crème brûlée, naïve café, déjà vu — and a few emoji: 🙂 🚀.",
    "def add(a, b):\n    return a + b\n",
    "Hello world. Hello again, world.",
]

_ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
_BASE_CONFIG: dict[str, Any] = {
    "vocab_size": 320,  # more rows than the tokenizer's ~300 ids, as real models pad
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}
# Qwen3's head_dim differs from hidden_size / num_heads in real models; do the same here.
_ARCH_CONFIG: dict[str, dict[str, Any]] = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 32}}


def make_tokenizer_files(folder: str | Path) -> Path:
    """Write a small trained byte-level BPE tokenizer (SmolLM2-style) into `folder`.

    Files: tokenizer.json (digits split one by one, then GPT-2 byte-level BPE; ids 0-2 are
    <|endoftext|>, <|im_start|>, <|im_end|>) and tokenizer_config.json (ChatML chat template,
    bos <|im_start|>, eos <|im_end|>). Returns the folder.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[0],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def make_tiny_model(
    arch: str,
    folder: str | Path,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Build a random tiny `arch` model ("llama", "qwen2", "qwen3") and save it into `folder`.

    Defaults: 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 320, untied embeddings; any
    transformers config field can be overridden (e.g. `tie_word_embeddings=True`,
    `rope_scaling={...}`). Norm weights and biases are randomized too (transformers initializes
    them to 1 and 0), so a mixed-up tensor cannot go unnoticed. `max_shard_size` (e.g. "40KB")
    saves sharded safetensors with an index. Returns the folder.
    """
    import transformers

    config_name, model_name = _ARCH_CLASSES[arch]
    settings = {**_BASE_CONFIG, **_ARCH_CONFIG[arch], **overrides}
    config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    folder = Path(folder)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    make_tokenizer_files(folder)
    return folder


_GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_gguf(
    folder: str | Path, out: str | Path, *, quantization: str = "F32", arch_name: str | None = None
) -> Path:
    """Convert a tiny model folder into a GGUF file the way llama.cpp's converter does.

    `quantization` is "F32" or "Q8_0" (2-D weights whose rows are a multiple of 32 are
    quantized, 1-D tensors stay F32, as llama.cpp does). `arch_name` overrides the GGUF
    architecture string (to build files of unsupported architectures). Returns `out`.
    """
    import gguf
    from safetensors.torch import load_file

    folder, out = Path(folder), Path(out)
    config = json.loads((folder / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights |= load_file(str(file))
    arch = _GGUF_ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}

    writer = gguf.GGUFWriter(str(out), arch_name or arch)
    writer.add_name(folder.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta") or config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _add_gguf_tokenizer(writer, folder, config["vocab_size"])

    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, head_dim))
    for name, tensor in weights.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        data = tensor.float()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = _permute_rows(data, heads if ".q_proj." in name else kv_heads)
        _add_gguf_tensor(writer, _gguf_tensor_name(name), data.numpy(), quantization)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _permute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: interleave each head's two rotary halves."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_tensor_name(name: str) -> str:
    if name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{kind}"


def _add_gguf_tensor(writer: Any, name: str, data: np.ndarray, quantization: str) -> None:
    import gguf

    if quantization == "Q8_0" and data.ndim == 2 and data.shape[1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))


def _add_gguf_tokenizer(writer: Any, folder: Path, vocab_size: int) -> None:
    import gguf

    spec = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    tokens, types = [], []
    for i in range(vocab_size):  # the converter pads the list to the embedding's row count
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        if i not in by_id:
            types.append(gguf.TokenType.UNUSED)
        else:
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")  # digits one by one, then GPT-2's regex
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok_config["chat_template"])


def _llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per-frequency divisors, computed as llama.cpp's converter does for rope_type llama3."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# -- a model as a runner takes it ---------------------------------------------------------------


def read_model(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """A tiny model's config and weights, as a runner takes them, and its folder."""
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights |= load_file(str(file))
    return config, weights, folder
