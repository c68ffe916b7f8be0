"""Shared pieces of the side-by-side benchmarks (bench_throughput, bench_prefix, bench_decode).

Every benchmark runs nanokv and its baseline (Hugging Face transformers on the *same* weights,
dtype, device and prompts) in one invocation and prints the ratio, because absolute numbers
move with the machine and its load. The transformers model is built from a Hugging Face
folder of the same weights: the model folder, or for a GGUF file its float32 export
(``loader.export_hf_folder``) in the benchmark's temporary directory, or - with
``--random-weights`` - a folder of random weights written from a config dict (no model hub
needed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from nanokv_cli.engine.loader import default_model_path, export_hf_folder  # noqa: E402

# Qwen3-0.6B's config.json (nano-vllm's benchmark model), written out because hubs may be
# unreachable; --random-weights fills it with random weights.
QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# The same architecture at the tiny shapes of scripts/gpu_check.sh --dry (the Triton kernels
# under the interpreter on CPU): GQA, head_dim 32, every random prompt id (< 10,000) in range.
QWEN3_TINY = {
    **QWEN3_0_6B,
    "head_dim": 32,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "max_window_layers": 2,
    "vocab_size": 10240,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

RANDOM_CONFIGS = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-tiny": QWEN3_TINY}


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    p.add_argument(
        "--random-weights",
        choices=sorted(RANDOM_CONFIGS),
        default=None,
        help="use this architecture with random weights instead of --model",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU), bfloat16, ...")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for both engines (default: torch's choice, one per core)",
    )
    p.add_argument("--quick", action="store_true", help="a smaller workload (smoke test)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")


def parse_modes(p: argparse.ArgumentParser, text: str, device: str) -> list[str]:
    """``--modes``: comma-separated nanokv quantization modes, each once; only ``none`` off
    the CPU (the quantized kernels are CPU-only)."""
    modes = [m.strip() for m in text.split(",")]
    if not all(modes):
        p.error(f"--modes: comma-separated quantization modes, got {text!r}")
    repeated = sorted({m for m in modes if modes.count(m) > 1})
    if repeated:
        p.error(f"--modes lists {', '.join(repeated)} more than once")
    if torch.device(device).type != "cpu" and modes != ["none"]:
        p.error(f"quantized modes run on the CPU only: use --modes none with --device {device}")
    return modes


def set_threads(threads: int | None) -> int:
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def resolve_dtype_name(dtype: str, device: str) -> torch.dtype:
    from nanokv_cli.engine.model_runner import resolve_dtype

    return resolve_dtype(dtype, torch.device(device))


def model_folder(args: argparse.Namespace, dtype: torch.dtype, workdir: str) -> str:
    """A Hugging Face folder both engines can load: the model's own, a GGUF's float32 export
    into ``workdir``, or random weights."""
    if args.random_weights:
        return write_random_model(RANDOM_CONFIGS[args.random_weights], dtype, args.device, workdir)
    model = args.model or default_model_path()
    if os.path.isdir(model):
        return model
    return str(export_hf_folder(model, Path(workdir) / "hf-model"))


def write_random_model(config: dict[str, Any], dtype: torch.dtype, device: str, out: str) -> str:
    """A Hugging Face folder with ``config`` and seeded random weights, plus a stub tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models

    folder = Path(out) / "random-model"
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.save_pretrained(folder)
    del model
    # The benchmarks feed token ids; the loader still wants a tokenizer file.
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(
        str(folder / "tokenizer.json")
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return str(folder)


def load_transformers(folder: str, dtype: torch.dtype, device: str) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.to(device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    sync(device)
    t = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - t, result


def hf_generate(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float,
    device: str,
    pad_id: int = 0,
) -> torch.Tensor:
    """transformers' batched generate as a user calls it: left-padded, EOS ignored."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        if temperature > 0
        else dict(do_sample=False)
    )
    with torch.inference_mode():
        return model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            eos_token_id=None,  # ignore EOS, as nanokv's ignore_eos
            pad_token_id=pad_id,
            **sampling,
        )


def summary(times: list[float]) -> dict[str, float]:
    return {"min": min(times), "median": statistics.median(times), "runs": len(times)}


def workdir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="nanokv-bench-")


def emit(result: dict[str, Any], as_json: bool, lines: list[str]) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print("\n".join(lines))


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The 2-D weights a forward pass multiplies by: every projection and the LM head."""
    seen: set[int] = set()
    weights = []
    for name, w in model.named_parameters():
        if w.dim() != 2 or id(w) in seen:
            continue
        seen.add(id(w))
        if "embed_tokens" in name and not _tied_head(model, w):
            continue  # an untied embedding is a lookup, not a matmul
        weights.append(w)
    return weights


def _tied_head(model: torch.nn.Module, w: torch.Tensor) -> bool:
    head = getattr(model, "lm_head", None)
    return head is not None and head.weight is w


def linear_ceiling_tok_s(
    model: torch.nn.Module, batch: int, device: str, min_time: float = 1.0
) -> float:
    """Tokens/s of the model's linear layers alone at ``batch`` rows: the best a step can do."""
    weights = linear_weights(model)
    dtype = weights[0].dtype
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype, device=device) for w in weights}

    def one_pass() -> None:
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    with torch.inference_mode():
        one_pass()
        best = float("inf")
        t_end = time.perf_counter() + min_time
        while time.perf_counter() < t_end or best == float("inf"):
            dt, _ = timed(one_pass, device)
            best = min(best, dt)
    return batch / best
