"""Micro-benchmark of ModelRunner decode steps on SmolLM2-135M shapes with random weights.

    python scripts/profile/runner.py --dtype bfloat16 --batch 1 64 --block-size 256
    python scripts/profile/runner.py --profile   # torch profiler table of one batch-64 step

Prints ms per decode step and tokens/s for each batch size, next to the "linear ceiling": the
same model's linear layers alone (qkv, o, gate/up, down, LM head) at that batch size. CPU time
per thread is printed too: on a shared machine it is steadier than wall time (and with other
busy processes, OMP_NUM_THREADS=1 avoids threads waiting on each other at every op).
"""

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

import common  # noqa: E402, F401  (it puts this checkout first on the path)

from nanokv_cli.engine.config import EngineConfig, ModelConfig  # noqa: E402
from nanokv_cli.engine.models import build_model, hf_weight_names  # noqa: E402
from nanokv_cli.engine.runner.model_runner import ModelRunner
from nanokv_cli.engine.runner.run_plan import resolve_plan
from nanokv_cli.engine.sampling_params import SamplingParams  # noqa: E402
from nanokv_cli.engine.sequence import Sequence  # noqa: E402

SMOLLM2 = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def random_weights(config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    shapes = {}
    with torch.device("meta"):
        model = build_model(config, max_position=16)
    params = dict(model.named_parameters())
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    for name in hf_weight_names(model):
        if ".q_proj." in name:
            shapes[name] = (q, config.hidden_size)
        elif ".k_proj." in name or ".v_proj." in name:
            shapes[name] = (kv, config.hidden_size)
        elif ".gate_proj." in name or ".up_proj." in name:
            shapes[name] = (config.intermediate_size, config.hidden_size)
        else:
            shapes[name] = tuple(params[name].shape)
    gen = torch.Generator().manual_seed(0)
    return {
        n: (torch.randn(s, generator=gen) * 0.02 + (1.0 if "norm" in n else 0.0)).to(dtype)
        for n, s in shapes.items()
    }


def decode_batch(runner: ModelRunner, batch: int, contexts: list[int]) -> list[Sequence]:
    """`batch` sequences whose prompts are cached (filled by one prefill), ready to decode."""
    bs = runner.block_size
    next_block = 0
    seqs = []
    for ctx in contexts[:batch]:
        seq = Sequence(
            [random.randrange(10000) for _ in range(ctx)], SamplingParams(0.6), block_size=bs
        )
        need = (ctx + 256 + bs - 1) // bs  # room for the decode steps
        seq.block_table = list(range(next_block, next_block + need))
        next_block += need
        seq.num_cached_tokens = ctx - 1  # K/V content is irrelevant to the timing
        seq.num_scheduled_tokens = 1
        seqs.append(seq)
    return seqs


def step(runner: ModelRunner, seqs: list[Sequence]) -> None:
    tokens = runner.run(seqs)
    for seq, tok in zip(seqs, tokens):
        seq.num_cached_tokens += 1
        seq.append_token(tok)


def linear_ceiling(runner: ModelRunner, batch: int, steps: int) -> tuple[float, float]:
    """Wall and per-thread CPU seconds per step of just the model's linear layers."""
    weights = [
        m.weight
        for m in runner.model.modules()
        if hasattr(m, "weight") and m.weight is not None and m.weight.dim() == 2
    ]
    x = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=runner.dtype) for w in weights}
    with torch.inference_mode():
        for w in weights:
            F.linear(x[w.shape[1]], w)
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            for w in weights:
                F.linear(x[w.shape[1]], w)
    cpu = (time.process_time() - c) / steps / torch.get_num_threads()
    return (time.perf_counter() - t) / steps, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: runner's choice)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="torch profiler table for the last batch")
    args = p.parse_args()

    random.seed(0)
    config = ModelConfig.from_hf(SMOLLM2)
    probe_dtype = torch.bfloat16 if args.dtype in ("bfloat16", "bf16") else torch.float32
    weights = random_weights(config, probe_dtype)
    settings = EngineConfig(
        block_size=args.block_size,
        dtype=args.dtype,
        kv_cache_memory=4 << 30,
        max_model_len=2048,
        device="cpu",
        quantization="none",  # random float weights: no file blocks
    )
    runner = ModelRunner(config, weights, resolve_plan(config, settings))
    print(f"dtype={runner.dtype} threads={torch.get_num_threads()} block_size={args.block_size}")
    # The throughput benchmark's shape: prompts of 64..512 tokens, up to 256 generated.
    contexts = [random.randint(64, 512) + random.randint(0, 256) for _ in range(max(args.batch))]
    contexts[0] = 300
    for batch in args.batch:
        seqs = decode_batch(runner, batch, contexts)
        step(runner, seqs)  # warm-up
        t, c = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step(runner, seqs)
        dt = (time.perf_counter() - t) / args.steps
        cpu = (time.process_time() - c) / args.steps / torch.get_num_threads()
        ceiling, ceiling_cpu = linear_ceiling(runner, batch, max(2, args.steps // 2))
        print(
            f"batch {batch:3d}: {dt * 1000:7.1f} ms/step {batch / dt:7.1f} tok/s | linear only "
            f"{ceiling * 1000:7.1f} ms {batch / ceiling:7.1f} tok/s ({ceiling / dt:.0%} of ceiling)"
            f" | cpu time per thread: step {cpu * 1000:.1f} ms, linear {ceiling_cpu * 1000:.1f} ms"
        )
        if args.profile and batch == args.batch[-1]:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(runner, seqs)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
