"""Quantized models end to end: ``LLM(quantization=...)`` against the same model in float32.

Thresholds come from what each mode changes, measured on this model and kept with a margin of
about 2x, far below what a wiring error gives (a swapped or misordered projection sends the
next-token KL above 1 and greedy agreement to ~0). Top-1 agreement is over 32 positions, so
one flip costs 3%.

- ``auto`` (the default) and int4 on the default GGUF: the Q4_1 layers and the Q8_0 LM head
  and embedding table are the file's own weights, exactly, each held once (cpu/formats.py).
  What moves the logits: every row's projection inputs are rounded to int16 per 32 values,
  decode and prompt rows alike (so a token's bits do not depend on its step): mean next-token
  KL ~5e-7 teacher-forced, 100% top-1, greedy tokens all equal to float32's here. (int8 decode
  inputs, as llama.cpp rounds them, gave KL ~4.6e-3 and 94% top-1; llama.cpp on the same
  file, same text: KL 4.3e-3, top-1 96%.)
- int8 from float weights (the float32 export of the same model): Q8_0-style groups on top.
- Tiny random models: the relative error of the logits follows the weights' rounding, about
  max|w| / 127 per 32 weights for int8 and (max - min) / 15 for int4, plus the inputs'.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from support.models import make_tiny_model
from typer.testing import CliRunner

from nanokv_cli import LLM, SamplingParams
from nanokv_cli.cli import app
from nanokv_cli.engine.cpu import kernels as cpu_kernels
from nanokv_cli.engine.cpu.formats import Q4, Q8, FloatLinear, PackedEmbedding, PackedLinear
from nanokv_cli.engine.layers.linear import LinearBase
from nanokv_cli.engine.model.loader import default_model_path, load_model
from nanokv_cli.engine.model.quantize import (
    check_quantization,
    parse_quantization,
    resident_weight_bytes,
)
from nanokv_cli.engine.sequence import Sequence

# One intra-op thread (conftest.py's one_thread): the kernels' parallel regions stall when
# another process holds the second core of a shared machine (20x slower measured), and results
# do not depend on it.
pytestmark = [
    pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler"),
    pytest.mark.usefixtures("one_thread"),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1492, Christopher Columbus",
]
TEXT = (
    "Paged attention stores the keys and values of each sequence in fixed-size blocks, much "
    "like virtual memory pages: a block table maps logical blocks to physical ones."
)
GREEDY_TOKENS = 16
# mode -> (max mean KL, min top-1 agreement, min fraction of greedy tokens before divergence)
DEFAULT_MODEL_LIMITS = {
    "int4": (1.2e-2, 0.9, 0.5),
    "int8": (2e-2, 0.85, 0.4),
    "auto": (1.2e-2, 0.9, 0.5),  # int4's blocks, plus float16 K/V
}
AUTO_PREFILL_MAX_KL = 1.2e-4
AUTO_DECODE_BATCH_MAX_KL = 2.5e-3
TINY_REL_ERROR = {"int8": 0.03, "int4": 0.25}
# A default `nanokv generate` on the default model, whole process (torch itself ~250 MB).
MAX_GENERATE_RSS = 600 << 20


def logits_along(llm: LLM, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits after a ``prefill``-token prompt, then after each later token fed one by one.

    A long prefill takes the layers' dequantize-and-GEMM path, the single tokens the kernels.
    """
    runner = llm.model_runner
    seq = Sequence(ids[:prefill], block_size=runner.block_size)
    seq.block_table = list(range(-(-len(ids) // runner.block_size)))
    seq.num_cached_tokens, seq.num_scheduled_tokens = 0, prefill
    rows = [runner.run_logits([seq])[0]]
    for i in range(prefill, len(ids)):
        seq.token_ids.append(ids[i])
        seq.num_cached_tokens, seq.num_scheduled_tokens = i, 1
        rows.append(runner.run_logits([seq])[0])
    return torch.stack(rows).float()


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    ref, oth = reference.log_softmax(-1), other.log_softmax(-1)
    return (ref.exp() * (ref - oth)).sum(-1).mean().item()


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    return [out["token_ids"] for out in llm.generate(PROMPTS, params)]


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- the default model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_llm():
    return LLM(kv_cache_memory=64 << 20, quantization="none")


@pytest.fixture(scope="module")
def reference(reference_llm):
    """The float32 default model's greedy outputs and teacher-forced logits over TEXT."""
    ids = reference_llm.encode(TEXT)
    return ids, greedy(reference_llm), logits_along(reference_llm, ids, 1)


@pytest.fixture(scope="module")
def int4_llm():
    return LLM(quantization="int4", kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def quantized(int4_llm, default_model_folder):
    """int4 from the GGUF's blocks; int8 quantized at load from the model's float32 export."""
    return {
        "int4": int4_llm,
        "int8": LLM(str(default_model_folder), quantization="int8", kv_cache_memory=64 << 20),
    }


@pytest.fixture(scope="module")
def auto_llm():
    return LLM(kv_cache_memory=64 << 20)  # the default: quantization="auto"


def test_auto_is_the_default_and_holds_the_file_once(auto_llm, int4_llm):
    assert auto_llm.quantization == "auto"
    runner = auto_llm.model_runner
    model = runner.model
    assert runner.plan.fused_decoder  # decode steps: one C program, any size
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    projections = [m for m in packed if m is not model.lm_head]
    assert len(projections) == 4 * len(model.model.layers)
    assert all(m.format is Q4 for m in projections)  # the Q4_1 blocks, as they are
    assert not any(isinstance(m, LinearBase) for m in model.modules())  # no float projection
    # The tied Q8_0 table serves the LM head and the token embedding: one copy.
    assert model.lm_head.format is Q8
    assert isinstance(model.model.embed_tokens, PackedEmbedding)
    assert model.model.embed_tokens.table is model.lm_head
    # Its layers are the int4 mode's exactly.
    qkv = model.model.layers[3].self_attn.qkv_proj
    int4_qkv = int4_llm.model_runner.model.model.layers[3].self_attn.qkv_proj
    assert torch.equal(qkv.dequantize(), int4_qkv.dequantize())
    # Resident weights: the file's bytes again (the bound: 1.5x), float norms aside.
    file_bytes = os.path.getsize(default_model_path())
    assert resident_weight_bytes(model) <= 1.1 * file_bytes
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    assert floats < 1e6  # norms only
    # K/V in float16, as llama.cpp keeps them, where the kernels convert in hardware (F16C).
    half = cpu_kernels.half_cache_supported()
    assert runner.kv_cache_dtype == (torch.float16 if half else torch.float32)
    assert runner.kv_cache.dtype == runner.kv_cache_dtype


def test_none_keeps_float32_end_to_end(reference_llm):
    runner = reference_llm.model_runner
    assert runner.kv_cache.dtype == torch.float32
    assert not any(isinstance(m, PackedLinear) for m in runner.model.modules())


def test_auto_prompts_stay_close_to_float(auto_llm, reference_llm):
    # Prompt rows, as every row, round the projections' inputs to 16 bits (cpu/formats.py):
    # what the file's weights give in float32, to ~1e-5 in KL; int8-rounded inputs give ~1e-2
    # on the first token of a chat answer, whose top two logits lie 0.08 apart ("The" vs "L"
    # for "What is the capital of France?"), and flip it. Short and long (over 300 tokens:
    # several row tiles and work items per thread) prompts alike.
    ids = auto_llm.encode(TEXT)
    long_ids = auto_llm.encode(" ".join([TEXT] * 10))
    assert len(long_ids) > 300
    for prompt in (ids[:2], ids[:5], ids[:16], ids, long_ids):
        ref = logits_along(reference_llm, prompt, len(prompt))
        assert mean_kl(ref, logits_along(auto_llm, prompt, len(prompt))) < AUTO_PREFILL_MAX_KL


def test_default_model_knows_paris_in_a_chat(auto_llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = auto_llm.tokenizer.apply_chat_template(chat)
    out = auto_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))
    assert "Paris" in out[0]["text"]


def decode_rows(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of one decode step of all ``prompts``' last tokens together, each prompt's other
    tokens prefilled first (a sequence of its own, its own blocks)."""
    runner, seqs = llm.model_runner, []
    per_seq = -(-max(map(len, prompts)) // runner.block_size)
    assert len(prompts) * per_seq <= runner.num_blocks
    for i, prompt in enumerate(prompts):
        seq = Sequence(prompt[:-1], block_size=runner.block_size)
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        seq.num_cached_tokens, seq.num_scheduled_tokens = 0, len(prompt) - 1
        runner.run_logits([seq])
        seq.token_ids.append(prompt[-1])
        seq.num_cached_tokens, seq.num_scheduled_tokens = len(prompt) - 1, 1
        seqs.append(seq)
    return runner.run_logits(seqs).float()


def test_auto_decode_batches_round_as_single_tokens_do(monkeypatch):
    # A decode step of 16 rows runs the whole decoder as one recorded C program on the same
    # blocks, with a single token's arithmetic, and about as close to float32. Measured mean
    # KL ~5e-7 (~1.1e-3 when decode rows were rounded to int8).
    auto, reference = (LLM(num_blocks=40, block_size=16, quantization=q) for q in ("auto", "none"))
    ids = auto.encode(TEXT)
    prompts = [ids[:n] for n in range(17, 33)]
    expected = decode_rows(reference, prompts)
    runner, steps = auto.model_runner, []
    real = runner._run_program
    monkeypatch.setattr(runner, "_run_program", lambda *a: steps.append(len(a[1])) or real(*a))
    logits = decode_rows(auto, prompts)  # recorded from the layers, as it runs
    assert steps == [16] and runner.program.rows == 16
    assert mean_kl(expected, logits) < AUTO_DECODE_BATCH_MAX_KL
    # Replayed, the step computes the layers' bits, and one sequence's step (a replay on one
    # row) its row of the batch, bit for bit (one layout for every row count).
    assert torch.equal(decode_rows(auto, prompts), logits)
    alone = decode_rows(auto, prompts[5:6])
    assert torch.equal(alone[0], logits[5])
    assert steps == [16, 16, 1] and runner.program.rows == 16


def test_int4_default_model_still_knows_paris(int4_llm):
    out = int4_llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8)
    )
    assert "Paris" in out[0]["text"]


@pytest.mark.parametrize("mode", ["int4", "int8", "auto"])
def test_default_model_stays_close_to_float(reference, quantized, auto_llm, mode):
    ids, ref_tokens, ref_logits = reference
    llm = auto_llm if mode == "auto" else quantized[mode]
    max_kl, min_top1, min_greedy = DEFAULT_MODEL_LIMITS[mode]
    logits = logits_along(llm, ids, 1)
    assert mean_kl(ref_logits, logits) <= max_kl
    top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    assert top1 >= min_top1
    tokens = greedy(llm)
    agreed = sum(agreeing_prefix(a, b) for a, b in zip(ref_tokens, tokens))
    assert agreed >= min_greedy * GREEDY_TOKENS * len(PROMPTS)


def test_int4_layers_hold_the_gguf_weights(int4_llm):
    model = int4_llm.model_runner.model
    floats = load_model().weights
    attn, mlp = model.model.layers[3].self_attn, model.model.layers[3].mlp
    prefix = "model.layers.3."
    fused = {
        attn.qkv_proj: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        mlp.gate_up_proj: ["mlp.gate_proj", "mlp.up_proj"],
        mlp.down_proj: ["mlp.down_proj"],
    }
    for layer, parts in fused.items():
        assert isinstance(layer, PackedLinear) and layer.format is Q4
        expected = torch.cat([floats[f"{prefix}{p}.weight"] for p in parts])
        assert torch.equal(layer.dequantize(), expected)  # the file's blocks, bit for bit
    head = model.lm_head
    assert isinstance(head, PackedLinear) and head.format is Q8
    assert model.model.embed_tokens.table is head  # tied: one table
    rows = torch.tensor([0, 2, 1000, 49151])
    assert torch.equal(model.model.embed_tokens(rows), floats["model.embed_tokens.weight"][rows])
    assert not any(isinstance(m, LinearBase) for m in model.modules())
    assert resident_weight_bytes(model) <= 100e6  # float32: 538 MB


def test_int8_takes_q4_blocks_as_q4_layers():
    # Requantizing a Q4_1 weight to 8 bits would only add error to the file's own weights.
    llm = LLM(quantization="int8", num_blocks=4, block_size=16)
    layer = llm.model_runner.model.model.layers[0]
    assert layer.mlp.down_proj.format is Q4 and layer.self_attn.qkv_proj.format is Q4
    assert llm.model_runner.model.lm_head.format is Q8  # the Q8_0 embedding table


def test_a_default_generate_stays_within_its_memory_bound():
    # The whole process: torch, the tokenizer, the file's blocks packed once, the KV cache's
    # touched pages. Measured ~525 MB (it was 1.5 GB with float and fixed-point copies).
    script = (
        "import sys\n"
        "from nanokv_cli.cli import main\n"
        "sys.argv = ['nanokv', 'generate', 'The capital of France is', '--max-tokens', '16']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        # VmHWM: this process's own peak (ru_maxrss would count the forking test process's).
        "print('RSS', next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    rss_kb = int(result.stdout.rsplit("RSS", 1)[1])
    assert rss_kb * 1024 <= MAX_GENERATE_RSS, rss_kb


# -- tiny Hugging Face models, quantized at load ---------------------------------------------------

TINY = {
    "llama": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", {}),
    # down_proj's 72 inputs do not split into groups of 32: that projection stays float32.
    "llama-tied-odd-mlp": ("llama", {"tie_word_embeddings": True, "intermediate_size": 72}),
}


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {key: make_tiny_model(arch, root / key, **kw) for key, (arch, kw) in TINY.items()}


@pytest.mark.parametrize("key", list(TINY))
def test_tiny_model_quantized_at_load_stays_close(tiny_folders, key):
    folder = str(tiny_folders[key])
    ids = list(range(3, 3 + 80))  # a 72-token prefill (dense path), then 8 decode steps
    options = dict(num_blocks=8, block_size=16)
    reference = logits_along(LLM(folder, **options), ids, 72)
    for mode, limit in TINY_REL_ERROR.items():
        llm = LLM(folder, quantization=mode, **options)
        logits = logits_along(llm, ids, 72)
        error = (logits - reference).norm(dim=-1) / reference.norm(dim=-1)
        assert error.max().item() < limit, (mode, error)
        out = llm.generate(["Hello world"], SamplingParams(max_tokens=5, ignore_eos=True))
        assert len(out[0]["token_ids"]) == 5
        modules = list(llm.model_runner.model.modules())
        quantized = [m for m in modules if isinstance(m, PackedLinear)]
        floats = [m for m in modules if isinstance(m, (LinearBase, FloatLinear))]
        vocab = llm.model_runner.config.vocab_size
        # The LM head and embedding table are q8 in both modes.
        fmt = {"int8": Q8, "int4": Q4}[mode]
        assert quantized and all(
            m.format is (Q8 if m.out_features == vocab else fmt) for m in quantized
        )
        # Exactly the projections whose input size is not a multiple of 32 stay float.
        assert all(m.weight.shape[1] % 32 for m in floats)
        if key == "llama-tied-odd-mlp":
            mlp = llm.model_runner.model.model.layers[0].mlp
            assert isinstance(mlp.down_proj, FloatLinear) and mlp.gate_up_proj.format is fmt
        else:
            assert not floats


def test_unquantized_is_the_default(tiny_folders):
    folder = str(tiny_folders["llama"])
    for value in (None, "none", "auto"):  # a safetensors folder has no blocks for auto
        llm = LLM(folder, quantization=value, num_blocks=4, block_size=16)
        assert llm.quantization is None
        assert not any(isinstance(m, PackedLinear) for m in llm.model_runner.model.modules())


# -- bad values -------------------------------------------------------------------------------------


def test_bad_values_fail_before_loading():
    with pytest.raises(
        ValueError, match=r"unknown quantization 'int3' \(choose one of: auto, none"
    ):
        LLM("/no/such/model", quantization="int3")
    with pytest.raises(ValueError, match="CPU only|--device cuda"):
        LLM("/no/such/model", quantization="int4", device="cuda")
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        LLM("/no/such/model", quantization="int8", tensor_parallel_size=3)
    assert parse_quantization("INT4") == "int4" and parse_quantization("none") is None
    assert check_quantization("int8", "cpu") == "int8"
    # auto never fails: where its kernels cannot run, it is no quantization.
    assert check_quantization("auto", "cpu") == "auto"
    assert check_quantization("auto", "cuda") is None
    assert check_quantization("auto", "cpu", tensor_parallel_size=2) is None


def test_without_the_c_kernels_quantization_is_refused_and_auto_is_none(monkeypatch):
    from nanokv_cli.engine.cpu import kernels as cpu_kernels

    with monkeypatch.context() as m:  # as on a machine without a C compiler
        m.setenv("NANOKV_CPU_KERNELS", "0")
        cpu_kernels._library.cache_clear()
        try:
            with pytest.raises(ValueError, match="needs nanokv's C kernels"):
                LLM("/no/such/model", quantization="int4")
            assert check_quantization("auto", "cpu") is None
            llm = LLM(kv_cache_memory=64 << 20)  # the default GGUF, default quantization
            assert llm.quantization is None and not llm.model_runner.plan.fused_decoder
        finally:
            cpu_kernels._library.cache_clear()


# -- command line -----------------------------------------------------------------------------------

cli = CliRunner()


def test_cli_generate_with_quantization_matches_the_python_api(tiny_folders):
    folder = tiny_folders["llama"]
    args = ["generate", "Hello world", "--model", str(folder), "--max-tokens", "5", "--json"]
    result = cli.invoke(app, [*args, "--quantization", "int4"])
    assert result.exit_code == 0, result.output
    llm = LLM(str(folder), quantization="int4")
    expected = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=5))
    assert json.loads(result.stdout)[0]["token_ids"] == expected[0]["token_ids"]


def test_cli_replay_reports_the_quantization(tiny_folders, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello world\nThe capital of France is\n")
    args = ["replay", str(prompts), "--model", str(tiny_folders["llama"]), "--max-tokens", "3"]
    result = cli.invoke(app, [*args, "--quantization", "int8", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["quantization"] == "int8" and report["output_tokens"] == 6


def test_cli_rejects_an_unknown_quantization(tiny_folders):
    args = ["generate", "hi", "--model", str(tiny_folders["llama"]), "--quantization", "fp4"]
    result = cli.invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--quantization" in result.output and "auto, none, int8, int4" in result.output
