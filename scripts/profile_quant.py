"""Time the linear layers of one model step: dense float32/bf16 against the quantized kernels.

    python scripts/profile_quant.py                   # SmolLM2-135M shapes
    python scripts/profile_quant.py --threads 1 --repeats 9 --batches 1,64

Every layer gets its own random weights, so a step streams the whole model from memory as a
real decode step does (one shared weight would sit in cache and flatter the dense path).
Each layer call is timed on its own and a step is the sum of the per-layer minimums over
--repeats runs: on a shared machine, noise only adds time, and short calls often dodge it.

Prints: per-step time for each variant and batch size; the batch size from which
dequantize-then-float32-GEMM beats each quantized kernel (what DENSE_MIN_ROWS is set from);
resident bytes; and the Python overhead of QuantizedLinear.forward over the bare kernel.

    python scripts/profile_quant.py --accuracy        # needs transformers

instead compares next-token distributions of the default model (its GGUF blocks converted by
QuantizedLinear.from_gguf, swapped into transformers' Llama) with the float32 model dequantized
from the same file, for several body/LM-head mode pairs: mean and max KL, top-1 agreement.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanokv_cli.engine.layers.quant import DENSE_MIN_ROWS, QuantizedLinear

# (out, in) of one decoder layer with fused projections: qkv, o, gate/up, down.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
VOCAB = 49152
HIDDEN = 576
MODES = ("int8", "int4", "int4x2")
Layer = tuple[Callable[[torch.Tensor], torch.Tensor], int]  # (call, in_features)


def step_ms(layers: list[Layer], batch: int, dtype: torch.dtype, repeats: int) -> float:
    """Sum over layers of each layer's fastest call."""
    inputs = {k: torch.randn(batch, k, dtype=dtype) for _, k in layers}
    best = [float("inf")] * len(layers)
    for _ in range(repeats + 1):  # the first round warms up
        for i, (call, k) in enumerate(layers):
            start = time.perf_counter()
            call(inputs[k])
            best[i] = min(best[i], time.perf_counter() - start)
    return sum(best) * 1e3


def dense(weights: list[torch.Tensor], dtype: torch.dtype) -> list[Layer]:
    return [(lambda x, w=w.to(dtype): F.linear(x, w), w.shape[1]) for w in weights]


def kernel_path(modules: list[QuantizedLinear]) -> list[Layer]:
    """forward() held to the weight-only kernel (float32 in and out, as the model calls it)."""
    for m in modules:
        m.dense_min_rows = float("inf")
    return [(m, m.in_features) for m in modules]


def dense_path(modules: list[QuantizedLinear]) -> list[Layer]:
    """forward() held to dequantize + float32 GEMM."""
    for m in modules:
        m.dense_min_rows = 0
    return [(m, m.in_features) for m in modules]


def bare_kernel(modules: list[QuantizedLinear]) -> list[Layer]:
    """The kernel call alone, on bf16 input (the floor forward() adds Python work to)."""
    return [(m._kernel_matmul, m.in_features) for m in modules]


ACCURACY_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Within a few decades printing shops had spread across Europe, books became cheaper, and "
    "literacy rose. Scholars argue about how much the press changed society, but few doubt that "
    "it accelerated the spread of ideas during the Renaissance and the Reformation. Today, the "
    "phrase 'the printing press moment' describes any technology that suddenly lowers the cost "
    "of sharing knowledge."
)
# (decoder linears, LM head and tied embedding) from the default model's Q4_1 / Q8_0 blocks.
ACCURACY_MODES = [("int4", "int8"), ("int4", "int4x2"), ("int8", "int8"), ("int4", "int4")]


def accuracy() -> None:
    from transformers import AutoModelForCausalLM

    from nanokv_cli.engine.layers.quant import QuantizedEmbedding
    from nanokv_cli.engine.loader import load_gguf_quantized, load_model

    loaded, blocks = load_model(), load_gguf_quantized()
    ids = torch.tensor([loaded.tokenizer.encode(ACCURACY_TEXT)])

    def hf_model() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(loaded.cache_path, dtype=torch.float32).eval()

    def quantized(name: str, mode: str, dense_min_rows: float) -> QuantizedLinear:
        t = blocks[name]
        layer = QuantizedLinear.from_gguf(t.data, t.qtype, t.shape, mode)
        layer.dense_min_rows = dense_min_rows
        return layer

    with torch.no_grad():
        reference = torch.log_softmax(hf_model()(ids).logits[0], dim=-1)
    print(f"{ids.shape[1]} tokens; KL(float32 || quantized) per position")
    for body_mode, head_mode in ACCURACY_MODES:
        for path, rows in (("kernel", float("inf")), ("deq+fp32", 0)):
            model = hf_model()
            for name, module in list(model.named_modules()):
                for child, linear in list(module.named_children()):
                    full = f"{name}.{child}.weight"
                    if isinstance(linear, torch.nn.Linear) and full in blocks:
                        setattr(module, child, quantized(full, body_mode, rows))
            model.lm_head = quantized("model.embed_tokens.weight", head_mode, rows)
            model.model.embed_tokens = QuantizedEmbedding(model.lm_head)
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0], dim=-1)
            kl = (reference.exp() * (reference - logp)).sum(-1)
            top1 = (reference.argmax(-1) == logp.argmax(-1)).float().mean()
            print(
                f"body {body_mode:>6} head {head_mode:>6} {path:>8}: mean KL {kl.mean():.2e}  "
                f"max KL {kl.max():.2e}  top-1 agreement {top1:.3f}"
            )


def print_row(name: str, values: list[float]) -> None:
    print(f"{name:>16}" + "".join(f"{v:10.2f}" for v in values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--crossover-batches", default="4,8,16,32,48,64,96,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--accuracy", action="store_true", help="default model KL instead")
    parser.add_argument(
        "--bf16", action="store_true", help="also dense bf16 (slow without AVX512-BF16)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.accuracy:
        return accuracy()
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    crossover_batches = [int(b) for b in args.crossover_batches.split(",")]
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.layers} layers"
    )
    weights = [0.05 * torch.randn(n, k) for _ in range(args.layers) for n, k in LAYER_SHAPES]
    head = [0.05 * torch.randn(VOCAB, HIDDEN)]

    print(f"\nlinear layers per step, ms (sum of per-layer minimums of {args.repeats})")
    print(f"{'':>16}" + "".join(f"{'b=' + str(b):>10}" for b in batches) + f"{'head b=1':>10}")
    dtypes = [torch.float32, torch.bfloat16] if args.bf16 else [torch.float32]
    for dtype in dtypes:  # one variant resident at a time: memory is small and shared
        body, lm = dense(weights, dtype), dense(head, dtype)
        times = [step_ms(body, b, dtype, args.repeats) for b in batches]
        print_row(str(dtype).removeprefix("torch."), times + [step_ms(lm, 1, dtype, args.repeats)])
    sizes, crossover, overhead = {}, {}, {}
    for mode in modes:
        body = [QuantizedLinear.from_float(w, mode) for w in weights]
        lm = [QuantizedLinear.from_float(w, mode) for w in head]
        sizes[mode] = (sum(m.nbytes for m in body), lm[0].nbytes)
        for name, path in (("kernel", kernel_path), ("deq+fp32", dense_path)):
            times = [step_ms(path(body), b, torch.float32, args.repeats) for b in batches]
            head_ms = step_ms(path(lm), 1, torch.float32, args.repeats)
            print_row(f"{mode} {name}", times + [head_ms])
        crossover[mode] = next(
            (
                b
                for b in crossover_batches
                if step_ms(dense_path(body), b, torch.float32, args.repeats)
                < step_ms(kernel_path(body), b, torch.float32, args.repeats)
            ),
            None,
        )
        overhead[mode] = step_ms(kernel_path(body), 1, torch.float32, args.repeats) - step_ms(
            bare_kernel(body), 1, torch.bfloat16, args.repeats
        )
        del body, lm

    print("\nresident MB: decoder linears, LM head (= tied embedding table)")
    dense_body = sum(n * k for n, k in LAYER_SHAPES) * args.layers
    print(f"{'float32':>8}: {dense_body * 4 / 1e6:8.1f} {VOCAB * HIDDEN * 4 / 1e6:8.1f}")
    print(f"{'bfloat16':>8}: {dense_body * 2 / 1e6:8.1f} {VOCAB * HIDDEN * 2 / 1e6:8.1f}")
    for mode, (body_bytes, head_bytes) in sizes.items():
        print(f"{mode:>8}: {body_bytes / 1e6:8.1f} {head_bytes / 1e6:8.1f}")

    print(f"\nfirst batch size where deq+fp32 beats the kernel (of {crossover_batches})")
    for mode in modes:
        print(f"{mode:>8}: {crossover[mode]}  (DENSE_MIN_ROWS: {DENSE_MIN_ROWS[mode]})")
    print("\nforward() over the bare kernel at b=1 (float32 in/out vs bf16), ms per step")
    for mode in modes:
        print(f"{mode:>8}: {overhead[mode]:.2f}")


if __name__ == "__main__":
    main()
