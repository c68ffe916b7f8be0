"""Quantized models end to end: ``LLM(quantization=...)`` against the same model in float32.

Thresholds come from what each mode changes, measured on this model and kept with a margin of
about 2x, far below what a wiring error gives (a swapped or misordered projection sends the
next-token KL above 1 and greedy agreement to ~0). Top-1 agreement is over 32 positions, so
one flip costs 3%.

- int4 on the default GGUF (and ``auto``, the default, which runs the same blocks, for batches
  unpacked into panels): the Q4_1 layers and the Q8_0 LM head are the file's own weights, exactly; what moves
  the logits is that the layers' kernels round their inputs to int8 per 32 values, as
  llama.cpp does. Measured: mean next-token KL 4.6e-3 (max 3.4e-2), 94% top-1 agreement,
  92% of greedy tokens before the first divergence. llama.cpp on the same file, same text:
  KL 4.3e-3, top-1 96%.
- int8 from float weights (the same model's float32 copy): Q8_0-style groups on top of that.
  Measured: mean KL 6.4e-3, 91% top-1, 77% of greedy tokens.
- Tiny random models: the relative error of the logits follows the weights' rounding, about
  max|w| / 127 per 32 weights for int8 and (max - min) / 15 for int4, plus the inputs'.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nanokv_cli import LLM, SamplingParams
from nanokv_cli.cli import app
from nanokv_cli.engine.layers import cpu_kernels
from nanokv_cli.engine.layers.linear import LinearBase, auto_twin, prefill_step
from nanokv_cli.engine.layers.quant import FixedPointLinear, PanelInt4Linear, QuantizedLinear
from nanokv_cli.engine.loader import load_model
from nanokv_cli.engine.quantize import (
    check_quantization,
    parse_quantization,
    resident_weight_bytes,
)
from nanokv_cli.engine.sequence import Sequence

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_model  # noqa: E402

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
    "auto": (1.2e-2, 0.9, 0.5),  # int4's blocks for single tokens, plus float16 K/V
}
AUTO_BATCH_MAX_KL = 1.2e-4
AUTO_DECODE_BATCH_MAX_KL = 2.5e-3
TINY_REL_ERROR = {"int8": 0.03, "int4": 0.25}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the kernels' parallel regions stall when another process holds the
    second core of a shared machine (20x slower measured), and results do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
def quantized(int4_llm):
    """int4 from the GGUF's blocks; int8 quantized at load from the model's float32 copy."""
    float_folder = load_model().cache_path
    return {
        "int4": int4_llm,
        "int8": LLM(float_folder, quantization="int8", kv_cache_memory=64 << 20),
    }


@pytest.fixture(scope="module")
def auto_llm():
    return LLM(kv_cache_memory=64 << 20)  # the default: quantization="auto"


def test_auto_is_the_default_and_trades_the_float_weights_for_two_copies(auto_llm, int4_llm):
    assert auto_llm.quantization == "auto"
    runner = auto_llm.model_runner
    assert runner.cpu_decoder is not None  # decode steps of few rows: one C call
    layers = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all(m.quantized.mode == "int4" for m in layers)  # the Q4_1 blocks
    head = runner.model.lm_head
    assert head.quantized.mode == "int8" and head.quantized.float_inputs  # Q8_0, unrounded
    # The twins are the int4 mode's layers exactly.
    qkv = runner.model.model.layers[3].self_attn.qkv_proj
    int4_qkv = int4_llm.model_runner.model.model.layers[3].self_attn.qkv_proj
    assert torch.equal(qkv.quantized.dequantize(), int4_qkv.dequantize())
    # For decode steps of more rows, the same blocks unpacked to a byte per weight in panels
    # (1.25 bytes with the scales): the twin's products in a tiled GEMM.
    x = torch.randn(64, qkv.batched.in_features, generator=torch.Generator().manual_seed(0))
    rows = cpu_kernels.linear(qkv.quantized.spec, x)
    assert ((qkv.batched(x) - rows).norm() / rows.norm()).item() < 1e-6
    panels = [m.batched for m in layers]
    assert all(isinstance(p, PanelInt4Linear) for p in panels)
    panel_bytes = sum(p.nbytes for p in panels)
    linear_weights = sum(p.in_features * p.out_features for p in panels)
    assert panel_bytes == 1.25 * linear_weights
    # For prefills, a fixed-point copy of the same weights (the blocks dequantized), two bytes
    # per weight, which computes what the blocks' float values would, to ~1e-4; the head's
    # blocks are int8 (Q8_0) and it has only this copy.
    exact = x @ int4_qkv.dequantize().T
    assert ((qkv.exact(x) - exact).norm() / exact.norm()).item() < 5e-4
    fixed = [m.exact for m in layers] + [head.batched]
    assert all(isinstance(f, FixedPointLinear) for f in fixed) and head.exact is None
    fixed_bytes = sum(f.nbytes for f in fixed)
    fixed_weights = sum(f.in_features * f.out_features for f in fixed)
    assert 2 * fixed_weights < fixed_bytes < 2.01 * fixed_weights
    # With both copies the projections' float weights are gone; the tied head's table stays,
    # as the token embedding.
    assert all(m.weight.numel() == 0 for m in layers)
    assert head.weight.data_ptr() == runner.model.model.embed_tokens.weight.data_ptr()
    float_bytes = sum(p.numel() * 4 for p in runner.model.parameters())
    assert float_bytes < 0.3 * linear_weights * 4
    copies = panel_bytes + fixed_bytes
    assert 0 < resident_weight_bytes(runner.model) - float_bytes - copies < 100e6
    # K/V in float16, as llama.cpp keeps them, where the kernels convert in hardware (F16C).
    half = cpu_kernels.half_cache_supported()
    assert runner.kv_cache_dtype == (torch.float16 if half else torch.float32)
    assert runner.kv_cache.dtype == runner.kv_cache_dtype


def test_auto_serves_each_step_size_from_its_copy(auto_llm):
    qkv = auto_llm.model_runner.model.model.layers[3].self_attn.qkv_proj
    assert auto_twin(qkv, 1) is auto_twin(qkv, 3) is qkv.quantized  # the file's blocks
    # Decode steps of more rows: the panels; steps with prefill rows: the fixed-point copy.
    assert auto_twin(qkv, 16) is auto_twin(qkv, 255) is auto_twin(qkv, 4096) is qkv.batched
    with prefill_step(True):
        assert auto_twin(qkv, 16) is auto_twin(qkv, 4096) is qkv.exact
        assert auto_twin(qkv, 3) is qkv.quantized


def test_none_keeps_float32_end_to_end(reference_llm):
    runner = reference_llm.model_runner
    assert runner.kv_cache.dtype == torch.float32
    assert all(
        m.quantized is None and m.batched is None
        for m in runner.model.modules()
        if isinstance(m, LinearBase)
    )


def test_auto_batches_stay_close_to_float(auto_llm, reference_llm):
    # Prefills of 4 tokens or more run on the fixed-point copies: 14-bit weights, 13-bit
    # inputs. Measured KL 0.8-5.5e-5 after 4-330 tokens, against ~4e-3 for a prefill on the
    # blocks' int8-rounded arithmetic (which turned the default model's answer to "What is the
    # capital of France?" from Paris to "L'Etoile, la Marseillaise, ..."); the long prompt (over
    # 300 tokens, several tiles of rows and work items per thread) too.
    ids = auto_llm.encode(TEXT)
    long_ids = auto_llm.encode(" ".join([TEXT] * 10))
    assert len(long_ids) > 300
    for prompt in (ids[:5], ids[:16], ids[:24], ids, long_ids):
        ref = logits_along(reference_llm, prompt, len(prompt))
        assert mean_kl(ref, logits_along(auto_llm, prompt, len(prompt))) < AUTO_BATCH_MAX_KL


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
    # A decode step of 16 rows runs on the panels: the blocks' arithmetic, as a lone
    # sequence's single-token steps, and about as close to float32. Measured mean KL 1.1e-3
    # (one token at a time, on the blocks: 1.25e-3).
    auto, reference = (LLM(num_blocks=40, block_size=16, quantization=q) for q in ("auto", "none"))
    qkv = auto.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(auto_twin(qkv, 16), PanelInt4Linear)
    ids = auto.encode(TEXT)
    prompts = [ids[:n] for n in range(17, 33)]
    calls = []
    real = cpu_kernels.decode_step
    monkeypatch.setattr(cpu_kernels, "decode_step", lambda *a: calls.append(len(a[1])) or real(*a))
    logits = decode_rows(auto, prompts)
    assert calls == [16]  # the whole decoder in one C call, over the panels
    assert mean_kl(decode_rows(reference, prompts), logits) < AUTO_DECODE_BATCH_MAX_KL
    # The same kernels called layer by layer from Python compute the same step.
    auto.model_runner.cpu_batch_decoder = None
    torch.testing.assert_close(decode_rows(auto, prompts), logits, atol=1e-4, rtol=0)
    assert calls == [16]


def test_int4_default_model_still_knows_paris(int4_llm):
    out = int4_llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
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
        assert isinstance(layer, QuantizedLinear) and layer.mode == "int4"
        expected = torch.cat([floats[f"{prefix}{p}.weight"] for p in parts])
        # Q4_1's float16 scale and minimum rounded to bf16: within 2**-8 of the group's range.
        error = (layer.dequantize() - expected).norm() / expected.norm()
        assert error < 1e-2
    head = model.lm_head
    assert isinstance(head, QuantizedLinear) and head.mode == "int8"
    assert model.model.embed_tokens.table is head  # tied: one table
    rows = torch.tensor([0, 2, 1000, 49151])
    embedded = model.model.embed_tokens(rows)
    expected = floats["model.embed_tokens.weight"][rows]
    # Per-row int8: a step of max|w| / 127, about 5x these rows' RMS: ~1.2% RMS error.
    assert ((embedded - expected).norm() / expected.norm()).item() < 3e-2
    assert not any(isinstance(m, LinearBase) for m in model.modules())
    # The target: int4 weights resident in <= 100 MB (float32: 538 MB).
    assert resident_weight_bytes(model) <= 100e6


def test_int8_takes_q4_blocks_as_int4_layers():
    # Per-row int8 of a Q4_1 weight would only add error to the file's own weights.
    llm = LLM(quantization="int8", num_blocks=4, block_size=16)
    layer = llm.model_runner.model.model.layers[0]
    assert layer.mlp.down_proj.mode == "int4" and layer.self_attn.qkv_proj.mode == "int4"
    assert llm.model_runner.model.lm_head.mode == "int8"  # Q8_0 embedding table


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
        quantized = [m for m in modules if isinstance(m, QuantizedLinear)]
        floats = [m for m in modules if isinstance(m, LinearBase)]
        vocab = llm.model_runner.config.vocab_size
        # The LM head and embedding table are int8 in both modes.
        assert quantized and all(
            m.mode == ("int8" if m.out_features == vocab else mode) for m in quantized
        )
        # Exactly the projections whose input size is not a multiple of 32 stay float.
        assert all(m.weight.shape[1] % 32 for m in floats)
        if key == "llama-tied-odd-mlp":
            mlp = llm.model_runner.model.model.layers[0].mlp
            assert isinstance(mlp.down_proj, LinearBase) and mlp.gate_up_proj.mode == mode
        else:
            assert not floats


def test_unquantized_is_the_default(tiny_folders):
    folder = str(tiny_folders["llama"])
    for value in (None, "none", "auto"):  # a safetensors folder has no blocks for auto
        llm = LLM(folder, quantization=value, num_blocks=4, block_size=16)
        assert llm.quantization is None
        assert not any(isinstance(m, QuantizedLinear) for m in llm.model_runner.model.modules())


# -- bad values -------------------------------------------------------------------------------------


def test_bad_values_fail_before_loading():
    with pytest.raises(
        ValueError, match=r"unknown quantization 'int3' \(choose one of: auto, none"
    ):
        LLM("/no/such/model", quantization="int3")
    with pytest.raises(ValueError, match="CPU only"):
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
    from nanokv_cli.engine.layers import cpu_kernels

    with monkeypatch.context() as m:  # as on a machine without a C compiler
        m.setenv("NANOKV_CPU_KERNELS", "0")
        cpu_kernels._library.cache_clear()
        try:
            with pytest.raises(ValueError, match="needs nanokv's C kernels"):
                LLM("/no/such/model", quantization="int4")
            assert check_quantization("auto", "cpu") is None
            llm = LLM(kv_cache_memory=64 << 20)  # the default GGUF, default quantization
            assert llm.quantization is None and llm.model_runner.cpu_decoder is None
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
