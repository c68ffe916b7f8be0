"""What the scripts share: the benchmarks (scripts/bench/), the profilers (scripts/profile/) and
the checks (scripts/check/) each reach this one module with a line before their other imports:

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py
    from common import ROOT, emit  # noqa: E402

Importing it puts this checkout first on the path, so a script runs the nanokv it sits in,
installed or not. It imports no torch itself (each function that needs torch imports it): a
command timed in a fresh process counts its parent's peak RSS in its own (Linux keeps the
high-water mark across exec), so the scripts that measure one stay small. In it:

- the checkout (``ROOT``), the bundled Mooncake trace, and the tests' tiny-model builder;
- the side-by-side benchmarks' arguments, models and timing. Every benchmark runs nanokv and
  its baseline (Hugging Face transformers on the *same* weights, dtype, device and prompts) in
  one invocation and prints the ratio, because absolute numbers move with the machine and its
  load. The transformers model is built from a Hugging Face folder of the same weights: the
  model folder, or for a GGUF file its float32 export (``loader.export_hf_folder``) in the
  benchmark's temporary directory, or - with ``--random-weights`` - a folder of random weights
  written from a config dict (no model hub needed);
- a nanokv command in a fresh process, timed, with its peak RSS;
- the roofline: the physical limits the CPU benchmarks print their speed against (issue 32);
- the serving benchmarks' requests and settling (the server itself is
  ``nanokv_cli.serve.process.ServerProcess``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from nanokv_cli.serve.process import ServerProcess, ServerStartError  # noqa: E402

if TYPE_CHECKING:  # torch is imported where it is used: see the module's docstring
    import torch

TRACE = ROOT / "examples" / "traces" / "mooncake_conversation_trace.jsonl"


def test_support(name: str) -> ModuleType:
    """``tests/support/NAME.py`` (e.g. ``models``: the seeded tiny models the tests build),
    loaded from its file: scripts that check what the tests check build the same models."""
    path = ROOT / "tests" / "support" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tests_support_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the side-by-side benchmarks -----------------------------------------------------------------


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

# The same architecture at the tiny shapes of scripts/check/gpu_check.sh --dry (the Triton kernels
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
    import torch

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
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def resolve_dtype_name(dtype: str, device: str) -> torch.dtype:
    import torch

    from nanokv_cli.engine.runner.run_plan import resolve_dtype

    return resolve_dtype(dtype, torch.device(device))


def model_folder(args: argparse.Namespace, dtype: torch.dtype, workdir: str) -> str:
    """A Hugging Face folder both engines can load: the model's own, a GGUF's float32 export
    into ``workdir``, or random weights."""
    from nanokv_cli.engine.model.loader import default_model_path, export_hf_folder

    if args.random_weights:
        return write_random_model(RANDOM_CONFIGS[args.random_weights], dtype, args.device, workdir)
    model = args.model or default_model_path()
    if os.path.isdir(model):
        return model
    return str(export_hf_folder(model, Path(workdir) / "hf-model"))


def write_random_model(config: dict[str, Any], dtype: torch.dtype, device: str, out: str) -> str:
    """A Hugging Face folder with ``config`` and seeded random weights, plus a stub tokenizer."""
    import torch
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
    import torch

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
    import torch

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
    import torch

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


# -- a nanokv command in a fresh process ---------------------------------------------------------

# Runs the CLI in-process and reports the peak RSS of this process and of its largest child
# (advise's pool workers, say); a child's peak may come from an earlier run of the same process
# tree, so a caller comparing runs reads the process's own.
_MEASURED = """
import resource, sys
from nanokv_cli.cli import app
sys.argv = ["nanokv", *sys.argv[1:]]
try:
    app(prog_name="nanokv")
except SystemExit as e:
    if e.code:
        raise
finally:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print("\\n@rss", own, child, flush=True)
"""


def run_measured(*args: str) -> tuple[float, float, float, str]:
    """``nanokv ARGS`` in a fresh process: wall seconds, peak RSS of the process and of its
    largest child (MB), and its stdout. Exits with its stderr if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURED, *args], capture_output=True, text=True, cwd=ROOT
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed: nanokv {' '.join(args)}\n{proc.stderr}")
    out, _, rss = proc.stdout.rpartition("\n@rss ")
    own, child = (float(x) / 1024 for x in rss.split())
    return wall, own, child, out


# -- the roofline ---------------------------------------------------------------------------------
# - ``read_bandwidth(threads)``: bytes per second one pass of the C kernels' own pool reads from a
#   buffer well past the last-level cache (csrc/probe.c), the best of a few passes, measured in
#   the benchmark's own run. ``nbytes=`` reads a buffer of another size again and again: at a
#   decode step's own size it is what a step's re-reads can reach where they fit the last-level
#   cache in part, a tighter bound than the first.
# - ``kernel_peak_flops(fmt, threads)``: the multiply-adds per second of the kernels' inner loop
#   on a layer held in cache (no memory traffic), for a weight format: the compute limit of a
#   batch or a prompt.
# - ``decode_bytes(llm, context)``: what one decode step of one sequence must read, from the
#   model's actual formats: every weight the step multiplies by (packed or float, a tied
#   table once), plus the K/V of ``context`` positions.
# - ``step_flops(llm, rows, context)``: a step's multiply-adds times two.
# A step's bound is ``max(bytes / bandwidth, flops / peak)``; a benchmark prints its measured
# speed as a fraction of the speed that bound allows. scripts/profile/roofline.py prints the
# machine's limits alone.

PROBE_BYTES = 512 << 20  # far past any last-level cache here (32-260 MiB)
# The peak's layer: 192 rows of 576 inputs against ~384 KB of weights in the format, so the
# weights stay in a core's L2 (1-2 MB here) and a call's fixed costs (ctypes, rounding the rows,
# the pool's hand-off) are a few percent of it. A layer of 192 x 576 x 96 rows measured ~45%
# below this one's peak at one thread and two, so a 256-token prefill read "138%" of it.
PEAK_ROWS, PEAK_INPUTS, PEAK_WEIGHT_BYTES = 192, 576, 384 << 10


def read_bandwidth(threads: int, repeats: int = 5, nbytes: int = PROBE_BYTES) -> float:
    """Best bytes/s of ``repeats`` passes of ``threads`` threads over ``nbytes``."""
    import torch

    from nanokv_cli.engine.cpu import kernels

    buffer = torch.ones(nbytes, dtype=torch.uint8)  # written: every page is there
    kernels.read_probe(buffer, threads)  # warm the pool's threads
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.read_probe(buffer, threads)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def kernel_peak_flops(fmt: str, threads: int, repeats: int = 20) -> float:
    """Best FLOP/s (2 per multiply-add) of the C product on a cache-resident layer of format
    ``fmt`` ("q4", "q8" or "f32") over ``PEAK_ROWS`` rows, with ``threads`` threads."""
    import torch

    from nanokv_cli.engine.cpu.formats import FORMATS, FloatLinear, PackedLinear

    in_features, rows = PEAK_INPUTS, PEAK_ROWS
    packed = FORMATS.get(fmt)
    per_weight = packed.bytes_per_weight if packed else 4.0  # f32
    out_features = int(PEAK_WEIGHT_BYTES / (in_features * per_weight)) // 16 * 16
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    layer = FloatLinear(weight, None) if fmt == "f32" else PackedLinear.from_parts(packed, [weight])
    x = torch.randn(rows, in_features)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernels run torch's thread count
    try:
        with torch.inference_mode():
            layer(x)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(10):
                    layer(x)
                best = min(best, (time.perf_counter() - start) / 10)
    finally:
        torch.set_num_threads(previous)
    return 2 * out_features * in_features * rows / best


def _weight_bytes(module: torch.nn.Module) -> int:
    from nanokv_cli.engine.cpu.formats import PackedLinear

    if isinstance(module, PackedLinear):
        return module.nbytes
    return sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))


def decode_bytes(llm, context: int) -> int:
    """Bytes one decode step of one sequence at ``context`` positions reads: the weights it
    multiplies by, each once (a packed embedding sharing the LM head's table is the head's
    read; an embedding of its own gives one row), and the K/V of ``context`` positions."""
    runner = llm.model_runner
    model = runner.model
    embed = model.model.embed_tokens
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if module is embed or id(module) in seen:
            continue
        seen.add(id(module))
        total += _weight_bytes(module)
    kv = context * runner.cache_shape.block_bytes // runner.block_size
    return total + kv


def step_flops(llm, rows: int, context: int, logits_rows: int | None = None) -> int:
    """FLOPs (2 per multiply-add) of a step of ``rows`` query rows at a mean ``context``:
    every projection per row, the LM head per row of ``logits_rows`` (default: all, a decode
    step; a prompt's prefill projects its last row only), and attention's scores and weighted
    sums over the context."""
    model = llm.model_runner.model
    head = model.lm_head
    head_size = _matmul_size(head)
    layers = sum(_matmul_size(m) for m in model.modules() if m is not head)
    config = llm.config
    attention = 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    logits = rows if logits_rows is None else logits_rows
    return 2 * (rows * (layers + attention * context) + logits * head_size)


def _matmul_size(module: torch.nn.Module) -> int:
    """Multiply-adds per row of a projection (packed, float kernel or torch layer), else 0."""
    from nanokv_cli.engine.cpu.formats import FloatLinear, PackedLinear
    from nanokv_cli.engine.layers.embed_head import ParallelLMHead
    from nanokv_cli.engine.layers.linear import LinearBase

    if isinstance(module, PackedLinear):
        return module.in_features * module.out_features
    if isinstance(module, (FloatLinear, LinearBase, ParallelLMHead)):
        weight = module.weight
        return weight.shape[0] * weight.shape[1]
    return 0


def bound_tok_s(
    bytes_per_step: float, flops_per_step: float, bandwidth: float, peak: float, rows: int
) -> tuple[float, str]:
    """Tokens/s the tighter limit allows a step of ``rows`` rows, and which limit binds."""
    memory, compute = bytes_per_step / bandwidth, flops_per_step / peak
    return rows / max(memory, compute), "bandwidth" if memory >= compute else "compute"


# -- serving --------------------------------------------------------------------------------------


def launch_server(
    args: list[str], workdir: str, deadline: float, threads: int | None, name: str = "server"
) -> ServerProcess:
    """``nanokv serve --port 0 --no-live ARGS``, ready before ``deadline`` (``time.monotonic``);
    ``name`` names its log files in ``workdir``; ``threads``: OMP_NUM_THREADS for it (None:
    inherited). Exits with its log if it does not start."""
    env = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    timeout = max(0.0, deadline - time.monotonic())
    try:
        return ServerProcess(["--no-live", *args], workdir, env, name=name, timeout=timeout)
    except ServerStartError as e:
        raise SystemExit(str(e)) from None


def settled(server: ServerProcess, timeout: float) -> dict[str, float]:
    """A ``ServerProcess``'s /metrics once nothing runs (the last step's snapshot may lag a
    disconnect by a step), or as it stands at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        busy = m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]
        if (busy == 0 and m["nanokv:kv_cache_blocks{state=used}"] == 0) or (
            time.monotonic() > deadline
        ):
            return m
        time.sleep(0.1)


def chat_body(messages, max_tokens: int) -> dict:
    """A greedy streaming chat request of exactly ``max_tokens`` tokens, with its usage."""
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
