"""Decoder-only transformer covering Llama (SmolLM2, Llama 3.x), Qwen2 and Qwen3.

The three families differ only in flags of ``ModelConfig``: ``attention_bias`` (Qwen2's q/k/v
bias) and ``qk_norm`` (Qwen3's per-head RMSNorm on q and k before RoPE). Module and parameter
names mirror transformers' so Hugging Face weight names map one to one, except the fused
projections listed in ``packed_modules_mapping``.
"""

import torch
from torch import nn

from ..config import ModelConfig
from ..cpu import kernels as cpu_kernels
from ..layers.activation import SiluAndMul
from ..layers.attention import Attention, AttentionMetadata
from ..layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, apply_rotary

# (cos, signed sin) per token, each [tokens, 1, head_dim]; on the C path instead
# (the [max_position, 2, head_dim] table, positions), and q/k are rotated in place.
Rope = tuple[torch.Tensor, torch.Tensor]


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size, bias=False
        )
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        n = qkv.shape[0]
        qk_end = self.q_size + self.kv_size
        v = qkv[:, qk_end:].view(n, self.num_kv_heads, self.head_dim)
        if cpu_kernels.runs(qkv):
            q, k = self._rotate_in_place(qkv, rope)
        elif self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_end].view(n, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        else:
            # q and k sit side by side in the fused output: rotate both with one set of kernels.
            qk = apply_rotary(qkv[:, :qk_end].view(n, -1, self.head_dim), *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.o_proj(self.attn(q, k, v, meta))

    def _rotate_in_place(self, qkv: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as views of the fused projection output, (normed and) rotated in place."""
        n, hd = qkv.shape[0], self.head_dim
        table, positions = rope
        qk_end = self.q_size + self.kv_size
        q = qkv[:, : self.q_size].view(n, self.num_heads, hd)
        k = qkv[:, self.q_size : qk_end].view(n, self.num_kv_heads, hd)
        if self.qk_norm:
            cpu_kernels.rms_norm(q, self.q_norm.weight, self.q_norm.eps, out=q)
            cpu_kernels.rms_norm(k, self.k_norm.weight, self.k_norm.eps, out=k)
        cpu_kernels.rotary_(qkv[:, :qk_end].view(n, -1, hd), table, positions)
        return q, k


class DecoderMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size])
        self.down_proj = RowParallelLinear(size, config.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_kernels.runs(gate_up):
            act = cpu_kernels.silu_mul(gate_up)
        else:
            act = self.act(gate_up)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is carried into the next norm (pre-norm block), saving one pass.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.decode(self.embed_tokens(input_ids), positions, meta)

    def decode(
        self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The layers and the final norm over the token embeddings ``hidden`` (which the C
        path overwrites): the part of a step the runner records (cpu/kernels.py)."""
        if cpu_kernels.runs(hidden):
            rope = (self.rotary_emb.cos_sin, positions)
        else:
            rope = self.rotary_emb.lookup(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    # HF projection name -> (our fused module, shard id inside it)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, max_position)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] (logits are computed only where needed)."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab]; ``None`` on tensor-parallel ranks other than 0."""
        return self.lm_head(hidden)
