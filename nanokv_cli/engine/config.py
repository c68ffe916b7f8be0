"""What a model is (``ModelConfig``, shared by the loaders and the model code) and how the
engine runs it (``EngineConfig``, passed once from ``LLM`` or the CLI down to every part)."""

import math
import os
import re
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

# No torch there either: the tier's spelling and its default restore speeds.
from .tiers.spec import TIER_BANDWIDTH_GBPS, TierSpec, parse_tier

# Hugging Face `architectures[0]` -> our family name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The weights describe an architecture nanokv cannot run."""


class ModelConfigError(ValueError):
    """A model's configuration holds a missing, mistyped or out-of-range value.

    ``field`` is the Hugging Face config name, so a loader can name the key of its own format
    (a GGUF file's ``llama.block_count``) in front of ``requirement``.
    """

    def __init__(self, field: str, value: Any, requirement: str) -> None:
        self.field, self.value, self.requirement = field, value, requirement
        super().__init__(self.named(field))

    def named(self, name: str) -> str:
        """The message with the field called ``name``."""
        return f"{name} is {_shown(self.value)}; {self.requirement}"


# Bounds for a model's sizes, checked before anything is sized from them: a few times past the
# largest published models (Llama 3.1 405B: hidden 16384, intermediate 53248, 126 layers, 128
# heads; Gemma 3: 262144 tokens, head_dim 256; Llama 4 Scout: 10M positions), so every real
# model passes and a hostile value (2**32 - 1 layers) is refused instead of allocating.
SIZE_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),
    "max_position_embeddings": (1, 1 << 24),
}
# rope_scaling types the rotary embedding implements (layers/rotary.py).
ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


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
        """A Hugging Face ``config.json`` (or a GGUF file's metadata in its form), validated.

        Raises UnsupportedModelError for an architecture nanokv cannot run, ModelConfigError
        for a bad value, KeyError naming a missing required key.
        """
        archs = cfg.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else cfg.get("model_type", "?")
        family = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
        if family is None:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r} (supported: {supported})"
            )
        # Checked before they are divided: head_dim and the KV heads default from them.
        hidden = _size("hidden_size", cfg["hidden_size"])
        heads = _size("num_attention_heads", cfg["num_attention_heads"])
        # transformers >= 5 folds rope_theta and rope_scaling into `rope_parameters`.
        rope = cfg.get("rope_parameters") or {}
        rope = dict(rope) if isinstance(rope, dict) else {}
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            rope_theta = rope.pop("rope_theta", 10000.0)
        rope_scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
        config = cls(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=_or_default(cfg.get("num_key_value_heads"), heads),
            head_dim=_or_default(cfg.get("head_dim"), hidden // heads),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings") or False,
            attention_bias=family == "qwen2" or cfg.get("attention_bias") or False,
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Refuse values that would size an allocation wildly, crash a layer or compute NaN.

        Raises ModelConfigError naming the first bad field. ``rope_theta`` and ``rms_norm_eps``
        come back as floats.
        """
        for name, (low, high) in SIZE_BOUNDS.items():
            _size(name, getattr(self, name), (low, high))
        if self.head_dim % 2:
            raise ModelConfigError("head_dim", self.head_dim, "rotary embeddings need it even")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"it must divide num_attention_heads ({self.num_attention_heads})",
            )
        self.rms_norm_eps = _number("rms_norm_eps", self.rms_norm_eps, below=1.0)
        self.rope_theta = _number("rope_theta", self.rope_theta)
        _check_rope_scaling(self.rope_scaling)
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ModelConfigError(name, getattr(self, name), "it must be true or false")
        ids = [] if self.bos_token_id is None else [self.bos_token_id]
        check_special_ids(ids + list(self.eos_token_ids), self.vocab_size)

    def parameter_count(self) -> int:
        """How many numbers the weights hold (a tied head counted once)."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q_rows = self.num_attention_heads * self.head_dim
        kv_rows = self.num_key_value_heads * self.head_dim
        layer = 2 * hidden + 2 * q_rows * hidden + 2 * kv_rows * hidden + 3 * inter * hidden
        layer += (q_rows + 2 * kv_rows) * self.attention_bias + 2 * self.head_dim * self.qk_norm
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * hidden + hidden + self.num_hidden_layers * layer


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _or_default(value: Any, default: Any) -> Any:
    # config.json writes null (and some writers 0) for "derive it".
    return default if value is None or value == 0 else value


def check_special_ids(ids: list[Any], vocab_size: int) -> None:
    """BOS and EOS ids must name rows of the embedding: an EOS past them could never be
    sampled, so generation would never stop on it, silently."""
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, Integral):
            raise ModelConfigError(
                "bos_token_id/eos_token_id", token_id, "token ids are integers >= 0"
            )
        if not 0 <= token_id < vocab_size:
            raise ModelConfigError(
                "bos_token_id/eos_token_id",
                token_id,
                f"it is outside the vocabulary ({vocab_size:,} ids: 0 to {vocab_size - 1:,})",
            )


def _size(name: str, value: Any, bounds: tuple[int, int] | None = None) -> int:
    low, high = SIZE_BOUNDS[name] if bounds is None else bounds
    if isinstance(value, bool) or not isinstance(value, Integral) or not low <= value <= high:
        raise ModelConfigError(name, value, f"it must be an integer from {low} to {high:,}")
    return int(value)


def _number(name: str, value: Any, *, below: float = math.inf) -> float:
    """A finite float in (0, below); NaN and infinity fail the comparison."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value < below:
        bound = "" if below == math.inf else f" and below {below:g}"
        raise ModelConfigError(name, value, f"it must be a finite number above 0{bound}")
    return float(value)


def _check_rope_scaling(scaling: Any) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ModelConfigError("rope_scaling", scaling, "it must be an object or null")
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    keys = {"linear": ("factor",), "llama3": _LLAMA3_ROPE_KEYS}.get(kind, ())
    for key in keys:
        if key not in scaling:
            raise ModelConfigError(f"rope_scaling.{key}", None, f"{kind} rope scaling needs it")
        if key == "original_max_position_embeddings":
            _size(f"rope_scaling.{key}", scaling[key], SIZE_BOUNDS["max_position_embeddings"])
        else:
            _number(f"rope_scaling.{key}", scaling[key])
    if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ModelConfigError(
            "rope_scaling.high_freq_factor",
            scaling["high_freq_factor"],
            f"it must exceed low_freq_factor ({scaling['low_freq_factor']})",
        )


def _flag(flag: str, help: str, **more: Any) -> dict[str, Any]:
    """A setting's command-line flag, as field metadata: the CLI offers every field that has
    one to the commands that run the engine (commands/engine_options.py); the engine reads
    none of it. Besides ``help``: ``min`` (the least number), ``choices``, ``metavar``,
    ``parse`` (the flag's text -> the value, raising ValueError with the reason) and
    ``default_help`` (the default as the help shows it, where the field's says nothing).
    A bool setting's flag turns its default around."""
    return {"flag": flag, "help": help, **more}


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
PREFIX_MATCH_MODES = ("token", "block")  # what BlockManager reuses: any token, or whole blocks
# run_plan.choose_attention: paged-c is the CPU's C kernel, triton our Triton kernel (CUDA, or
# CPU under TRITON_INTERPRET=1), flash flash-attn's (CUDA), sdpa torch's (anywhere).
ATTENTION_BACKENDS = ("auto", "triton", "flash", "sdpa", "paged-c")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1.5g"``, ``"1048576"`` -> bytes; ValueError otherwise."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"expected a size such as 512MiB or 2GB, got {text!r}")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    power = "kmgt".index(unit) + 1 if unit else 0
    size = int(number * (1024 if binary or not unit else 1000) ** power)
    if size <= 0:
        raise ValueError(f"the size must be positive, got {text!r}")
    return size


def _tier_spelling(text: str) -> str:
    """A ``--kv-tier`` value, checked and spelled one way (``disk:PATH:8GiB``)."""
    return str(parse_tier(text))


def parse_device(text: str) -> str:
    if not _DEVICE.match(text):
        raise ValueError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, with its one default. ``LLM`` and the CLI build one; the engine,
    the model runner, the dry-run executor and tensor-parallel workers read from it.

    Frozen: one object is shared by every part (and pickled to worker ranks); derive a variant
    with ``dataclasses.replace``. No torch here: dry runs and ``inspect`` import this too.
    A field with ``_flag`` metadata is a flag of every command that runs the engine.
    """

    # -- KV cache
    block_size: int = field(
        default=256, metadata=_flag("--block-size", "Tokens per KV block.", min=1)
    )
    # None: sized from kv_cache_memory, else by default (runner/kv_cache.py count_blocks)
    num_blocks: int | None = field(
        default=None, metadata=_flag("--num-blocks", "KV cache size in blocks.", min=1)
    )
    # bytes per rank; None: a share of available memory
    kv_cache_memory: int | None = field(
        default=None,
        metadata=_flag(
            "--kv-cache-memory",
            "KV cache size as memory, e.g. 512MiB or 2GB (instead of --num-blocks).",
            parse=parse_size,
        ),
    )
    gpu_memory_utilization: float = 0.9  # on CUDA without kv_cache_memory: fraction to fill
    enable_prefix_caching: bool = field(
        default=True, metadata=_flag("--no-prefix-cache", "Turn prefix caching off.")
    )
    # "token": past the last full-block hit, the shared leading tokens of the next block are
    # copied from a cached block continuing the same prefix; "block": whole blocks only (the
    # seed's semantics).
    prefix_match: str = field(
        default="token",
        metadata=_flag(
            "--prefix-match",
            "How far prefix reuse reaches: token (past the last whole cached block, the leading "
            "tokens shared with a cached block are copied) or block (whole blocks only, the "
            "seed's accounting).",
            choices=PREFIX_MATCH_MODES,
            metavar="token|block",
        ),
    )
    # A second cache tier (engine/tiers): blocks evicted from the device cache are kept there
    # and restored instead of recomputed. None: no tier.
    kv_tier: str | None = field(
        default=None,
        metadata=_flag(
            "--kv-tier",
            "A second KV cache tier: blocks evicted from the cache are kept there and restored "
            "instead of recomputed. disk:PATH:SIZE (a file per model in directory PATH, kept "
            "across restarts) or host:SIZE (CPU memory, CUDA only), e.g. disk:~/.cache/kv:8GiB.",
            parse=_tier_spelling,
            metavar="disk:PATH:SIZE|host:SIZE",
        ),
    )
    # Restore speed, GB/s, in "restore only when it pays": a block is restored while its bytes
    # take less time to read than its tokens to recompute. None: the medium's default.
    kv_tier_bandwidth: float | None = field(
        default=None,
        metadata=_flag(
            "--kv-tier-bandwidth",
            "The tier's restore speed in GB/s: a block is restored only while reading it "
            "takes less time than recomputing it (model runs measure their prefill speed; "
            "dry runs take their cost model's).",
            default_help=f"{TIER_BANDWIDTH_GBPS['disk']:g} for disk, "
            f"{TIER_BANDWIDTH_GBPS['host']:g} for host (measured: scripts/BENCHMARKS.md)",
        ),
    )
    # -- scheduling
    max_num_seqs: int = field(
        default=256, metadata=_flag("--max-num-seqs", "Most sequences per step.", min=1)
    )
    # Token budget per step (chunked prefill): LLM's and the CLI's model runs used 4096 before
    # this config (only dry runs took the engine's 8192).
    max_num_batched_tokens: int = field(
        default=4096,
        metadata=_flag(
            "--max-num-batched-tokens", "Token budget per step (chunked prefill).", min=1
        ),
    )
    # None: the model's own limit (see model_len)
    max_model_len: int | None = field(
        default=None,
        metadata=_flag("--max-model-len", "Longest prompt + output allowed.", min=1),
    )
    # While sequences decode, a step takes only the prompt tokens that keep it under this
    # many milliseconds, at the costs measured as the run goes (step_budget.py); None or 0:
    # up to max_num_batched_tokens (a throughput run: nobody is waiting for each token).
    step_latency_target_ms: float | None = field(
        default=None,
        metadata=_flag(
            "--step-latency-target-ms",
            "While sequences decode, a step takes only the prompt tokens that keep it under "
            "this many milliseconds (at costs measured as the run goes), so streams never "
            "freeze behind a burst of prompts; 0: up to the token budget.",
            min=0,
            default_help="off",
        ),
    )
    # -- model execution
    # None or "auto": float32 on CPU, bfloat16/float16 on CUDA
    dtype: str | None = field(
        default=None,
        metadata=_flag(
            "--dtype",
            f"Weights and KV dtype: {', '.join(DTYPES)}.",
            choices=DTYPES,
            default_help="auto: float32 on CPU, bfloat16 (else float16) on CUDA",
        ),
    )
    device: str | None = field(  # None: cuda if available, else cpu
        default=None,
        metadata=_flag(
            "--device", "cpu, cuda or cuda:N.", parse=parse_device, default_help="cuda if available"
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_flag(
            "--kv-cache-dtype",
            "K/V dtype: auto (float16 under --quantization auto on the CPU kernels, as "
            "llama.cpp; else the weights' dtype), float32, bfloat16 or float16.",
            choices=DTYPES,
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=_flag(
            "--attention-backend",
            "Attention kernels: auto, triton, flash, sdpa or paged-c (the CPU's C kernel). "
            "auto: on CUDA flash-attn where it is installed and the block "
            "size a multiple of 256, else our Triton kernel; on CPU the C kernel in float32, "
            "else SDPA. triton also runs on CPU under TRITON_INTERPRET=1 (slow: for tests).",
            choices=ATTENTION_BACKENDS,
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=_flag(
            "--enforce-eager", "CUDA: launch every decode step's kernels (no CUDA graphs)."
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_flag(
            "--tensor-parallel-size",
            "Split the model over N processes (tensor parallelism): gloo on CPU, NCCL with one "
            "GPU per rank. Heads, KV heads and vocabulary must divide by N (SmolLM2-135M: 3).",
            min=1,
        ),
    )
    # "auto", "none"/None, "int8", "int4": see quantize.py
    quantization: str | None = field(
        default="auto",
        metadata=_flag(
            "--quantization",
            "Quantized weights on CPU. auto: a GGUF's own Q4/Q8 blocks, held once, serve every "
            "step (~6x faster single-stream decoding than float32, the file's size in memory); "
            "K/V in float16 (as llama.cpp); none: float32 only; int8, int4: every layer "
            "quantized at load.",
            choices=QUANTIZATIONS,
        ),
    )
    # CPU threads of torch and the C kernels, per rank; None: thread_count's default.
    threads: int | None = field(
        default=None,
        metadata=_flag(
            "--threads",
            "CPU threads for the model (per rank with --tensor-parallel-size).",
            min=1,
            default_help="the CPUs this process may run on",
        ),
    )

    def __post_init__(self) -> None:
        for name in _COUNTS:
            _check_count(name, getattr(self, name), optional=False)
        for name in _OPTIONAL_COUNTS:
            _check_count(name, getattr(self, name), optional=True)
        for name in _SWITCHES:
            if not isinstance(getattr(self, name), bool):  # "yes" and 0 are not switches
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.threads is not None and self.threads > (cpus := available_cpus()):
            # More threads than cores only queue behind each other (and at hundreds, thread
            # creation and per-thread buffers fail): refused, not capped, so a setting is never
            # silently not what runs.
            raise ValueError(
                f"threads={self.threads}: this process may run on {cpus} CPU"
                f"{'s' if cpus != 1 else ''} (its affinity mask); use at most {cpus}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.prefix_match not in PREFIX_MATCH_MODES:
            raise ValueError(f"prefix_match must be 'token' or 'block', got {self.prefix_match!r}")
        target = self.step_latency_target_ms
        if target is not None and (
            isinstance(target, bool) or not isinstance(target, Real) or not 0 <= target < 1e9
        ):
            raise ValueError(
                f"step_latency_target_ms must be a number of milliseconds >= 0, got {target!r}"
            )
        self._check_tier()
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, Real) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")

    def _check_tier(self) -> None:
        if self.kv_tier is not None:
            if not isinstance(self.kv_tier, str):
                raise ValueError(
                    f"kv_tier must be a string such as disk:PATH:SIZE, got {self.kv_tier!r}"
                )
            parse_tier(self.kv_tier)  # ValueError naming the spelling
            if self.tensor_parallel_size > 1:
                # Each rank holds a shard of every block: one tier file per rank is not built.
                raise ValueError("kv_tier works with one rank only (tensor_parallel_size 1)")
        bw = self.kv_tier_bandwidth
        if bw is not None and (
            isinstance(bw, bool) or not isinstance(bw, Real) or not 0 < bw < math.inf
        ):
            raise ValueError(f"kv_tier_bandwidth must be a number of GB/s above 0, got {bw!r}")

    @property
    def tier_spec(self) -> TierSpec | None:
        """The tier ``kv_tier`` names, or None."""
        return None if self.kv_tier is None else parse_tier(self.kv_tier)

    def tier_bandwidth(self) -> float:
        """The tier's restore speed in bytes per second: the setting, else its medium's."""
        spec = self.tier_spec
        if self.kv_tier_bandwidth is not None:
            return self.kv_tier_bandwidth * 1e9
        return TIER_BANDWIDTH_GBPS[spec.medium if spec else "disk"] * 1e9

    def thread_count(self) -> int:
        """The threads each rank computes with: ``threads``, else the CPUs this process may
        run on (its affinity mask, which taskset and cgroup cpusets narrow) shared among the
        tensor-parallel ranks, which all run on this machine."""
        if self.threads is not None:
            return self.threads
        return max(1, available_cpus() // self.tensor_parallel_size)

    def model_len(self, limit: int) -> int:
        """The longest sequence (prompt + output) admitted on a model of ``limit`` positions."""
        return min(self.max_model_len or limit, limit)

    def describe(self) -> dict[str, Any]:
        """The cache settings a run's report, trace header and what-if rows name it by."""
        described: dict[str, Any] = {
            "block_size": self.block_size,
            "prefix_caching": self.enable_prefix_caching,
            "prefix_match": self.prefix_match,
        }
        if self.kv_tier is not None:  # named only when set: rows without one read as before
            described["kv_tier"] = self.kv_tier
        return described


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, which taskset and cgroup cpusets
    narrow (the machine's count where the platform has no affinity call)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows
        return os.cpu_count() or 1


# Settings that count something: integers >= 1 (the optional ones may also be None).
_COUNTS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
_OPTIONAL_COUNTS = ("num_blocks", "kv_cache_memory", "max_model_len", "threads")
_SWITCHES = ("enable_prefix_caching", "enforce_eager")


def _check_count(name: str, value: Any, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
