"""Model architecture description shared by the loaders and the model code."""

from dataclasses import dataclass, field
from typing import Any

# Hugging Face `architectures[0]` -> our family name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The weights describe an architecture nanokv cannot run."""


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"  # dtype the weights were published in

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else cfg.get("model_type", "?")
        family = ARCHITECTURES.get(arch)
        if family is None:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r} (supported: {supported})"
            )
        heads = cfg["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into `rope_parameters`.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = cfg.get("rope_theta") or rope.pop("rope_theta", 10000.0)
        rope_scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )
