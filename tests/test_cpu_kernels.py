"""The float32 CPU fast paths against their torch references.

C kernels (cpu/kernels.py): paged decode attention, residual add + RMSNorm, rotary,
K/V stores, silu * mul, float32 weights (FloatLinear). And the runner with every fast path
switched off, so the torch paths other machines take stay checked here.
"""

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from support.models import make_tiny_model

from nanokv_cli.engine.config import EngineConfig, ModelConfig
from nanokv_cli.engine.cpu import build
from nanokv_cli.engine.cpu import kernels as cpu_kernels
from nanokv_cli.engine.cpu import program as cpu_program
from nanokv_cli.engine.cpu.formats import FloatLinear
from nanokv_cli.engine.layers.rotary import RotaryEmbedding, apply_rotary
from nanokv_cli.engine.runner.model_runner import ModelRunner
from nanokv_cli.engine.runner.run_plan import resolve_plan
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.engine.sequence import Sequence

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")


@pytest.fixture(autouse=True)
def each_test_starts_on_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_decode(q, k_cache, v_cache, tables, lens, scale):
    """SDPA over each sequence's gathered K/V, GQA by repeating KV heads."""
    _, block_size, kv_heads, dim = k_cache.shape
    group = q.shape[1] // kv_heads
    rows_k, rows_v = k_cache.reshape(-1, kv_heads, dim), v_cache.reshape(-1, kv_heads, dim)
    outs = []
    for i, length in enumerate(lens.tolist()):
        slots = (tables[i].unsqueeze(1) * block_size + torch.arange(block_size)).view(-1)[:length]
        k = rows_k[slots].transpose(0, 1).repeat_interleave(group, 0)
        v = rows_v[slots].transpose(0, 1).repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=scale)[:, 0])
    return torch.stack(outs)


# (heads, kv_heads, head_dim, block_size): SmolLM2's shape, MHA with 128 dims, blocks of one
# token, a head_dim that leaves a tail after the 64-wide vector loop, one that is no multiple of 8;
# four query heads a KV head (Llama 3.2 1B), more than one tile of GQA heads.
SHAPES = [
    (9, 3, 64, 256),
    (4, 4, 128, 16),
    (8, 2, 16, 1),
    (6, 2, 72, 7),
    (4, 1, 20, 5),
    (8, 2, 64, 16),
]


def test_float16_cache_support_follows_the_variant():
    # The AVX2 and AVX-512 builds convert float16 in hardware (F16C); the plain-C one does not.
    assert cpu_kernels.half_cache_supported() == ("f16c" in build.active_variant().requires)


CACHE_DTYPES = [torch.float32] + ([torch.float16] if cpu_kernels.half_cache_supported() else [])


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("many", [False, True])
def test_paged_decode_matches_sdpa_and_reads_only_the_context(
    heads, kv_heads, dim, block_size, threads, cache_dtype, many
):
    # A few sequences: a work item per KV head; many (4 per thread or more): per sequence,
    # read in chunks of 16 or 32 rows that stop at block ends.
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(heads * dim + block_size)
    lens = torch.tensor([1, 3, 17, 40, 300][: 5 if block_size > 1 else 4])
    if many:
        lens = torch.cat([lens, torch.tensor([33, 16, 2, 65])])
    width = -(-int(lens.max()) // block_size)
    num_blocks = width * len(lens) + 3
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"))
    v_cache = k_cache.clone()
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for i, length in enumerate(lens.tolist()):
        used = -(-length // block_size)
        tables[i, :used] = order[i * width : i * width + used]
        for t in range(length):  # only the context is written; the rest stays NaN
            block, offset = tables[i, t // block_size], t % block_size
            k_cache[block, offset] = torch.randn(kv_heads, dim, generator=g)
            v_cache[block, offset] = torch.randn(kv_heads, dim, generator=g)
    # q and out as row slices of wider tensors, as the model passes them.
    q = torch.randn(len(lens), heads + 2, dim, generator=g)[:, :heads]
    out = torch.zeros(len(lens), heads + 1, dim)[:, :heads]
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, dim**-0.5, out)
    # A float16 cache is read exactly: the kernel computes in float32 on its values.
    expected = reference_decode(q, k_cache.float(), v_cache.float(), tables, lens, dim**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 64), (8, 2, 128), (3, 3, 16)])
def test_paged_decode_serves_prefill_rows_each_with_its_own_context(
    threads, cache_dtype, heads, kv_heads, dim
):
    # A prefill chunk's rows are queries whose contexts end at their own positions, over the
    # same blocks: a 13-row chunk after 5 cached tokens, a decode row, a 20-token prompt (a
    # full tile of 16 rows, then 4), and two sequences sharing their first two blocks, with
    # consecutive lengths.
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(7)
    block_size = 16
    num_blocks = 24
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    seq_tables = {"a": order[0:2], "b": order[2:5], "c": order[5:7], "d": order[7:9]}
    seq_tables["e"] = seq_tables["d"] + order[9:10]  # d's blocks, then one of its own
    rows = [("a", n) for n in range(6, 19)] + [("b", 40)] + [("c", n) for n in range(1, 21)]
    rows += [("d", 32), ("e", 33)]
    width = 3
    tables = torch.tensor([(seq_tables[s] + [0] * width)[:width] for s, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    q = torch.randn(len(rows), heads, dim, generator=g)
    out = torch.zeros(len(rows), heads, dim)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, dim**-0.5, out)
    expected = reference_decode(q, k_cache.float(), v_cache.float(), tables, lens, dim**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_transformers_formula(with_residual):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=g) * 3
    weight = torch.randn(96, generator=g)
    residual = torch.randn(7, 96, generator=g) if with_residual else None
    total = x + residual if with_residual else x
    variance = total.pow(2).mean(-1, keepdim=True)
    expected = weight * (total * torch.rsqrt(variance + 1e-6))
    got = cpu_kernels.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    if with_residual:
        assert torch.equal(residual, total)  # the sum is left in the residual stream


def test_per_head_rms_norm_in_place_on_a_strided_view():
    g = torch.Generator().manual_seed(2)
    fused = torch.randn(5, 3 * 32 + 16, generator=g)
    view = fused[:, : 3 * 32].view(5, 3, 32)  # token rows strided, heads packed
    untouched = fused[:, 96:].clone()
    weight = torch.randn(32, generator=g)
    expected = F.rms_norm(view.clone(), (32,), weight, 1e-6)
    cpu_kernels.rms_norm(view, weight, 1e-6, out=view)
    torch.testing.assert_close(view, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(fused[:, 96:], untouched)


def test_rotary_in_place_equals_torch_rotation():
    rope = RotaryEmbedding(head_dim=64, max_position=512, base=10000.0)
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(6, 5 * 64 + 64, generator=g)
    positions = torch.tensor([0, 1, 7, 100, 311, 511])
    cos, sin = rope.lookup(positions, torch.float32)
    expected = apply_rotary(fused[:, : 5 * 64].view(6, 5, 64), cos, sin)
    cpu_kernels.rotary_(fused[:, : 5 * 64].view(6, 5, 64), rope.cos_sin, positions)
    # Same products and sums, no FMA contraction: the same floats.
    assert torch.equal(fused[:, : 5 * 64].view(6, 5, 64), expected)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_store_kv_writes_each_row_to_its_slot(cache_dtype):
    fused = torch.randn(4, 30, generator=torch.Generator().manual_seed(3)) * 100
    fused[0, :3] = torch.tensor([70000.0, 1e-6, -0.0])  # overflow, subnormal, signed zero
    k, v = fused[:, :12].view(4, 2, 6), fused[:, 12:24].view(4, 2, 6)
    k_cache = torch.zeros(3, 4, 2, 6, dtype=cache_dtype)
    v_cache = torch.zeros(3, 4, 2, 6, dtype=cache_dtype)
    slots = torch.tensor([11, 0, 5, 6])
    cpu_kernels.store_kv(k, v, slots, k_cache, v_cache)
    # float16: rounded to nearest as torch rounds (inf past the range, subnormals kept).
    assert torch.equal(k_cache.view(-1, 2, 6)[slots], k.to(cache_dtype))
    assert torch.equal(v_cache.view(-1, 2, 6)[slots], v.to(cache_dtype))
    assert k_cache.view(-1, 2, 6)[[1, 2, 3, 4, 7]].abs().sum() == 0


def test_kernels_refuse_other_cache_dtypes(monkeypatch):
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 8)
    with pytest.raises(TypeError, match="bfloat16"):
        cpu_kernels.store_kv(k, k, torch.tensor([0]), cache, cache)
    # A build without F16C refuses a float16 cache instead of storing nothing into it.
    monkeypatch.setattr(cpu_kernels, "half_cache_supported", lambda: False)
    half = torch.zeros(2, 4, 1, 8, dtype=torch.float16)
    with pytest.raises(TypeError, match="F16C"):
        cpu_kernels.store_kv(k, k, torch.tensor([0]), half, half)


def test_silu_mul_matches_torch():
    x = torch.randn(9, 2 * 50, generator=torch.Generator().manual_seed(4)) * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    gate, up = x.chunk(2, -1)
    torch.testing.assert_close(cpu_kernels.silu_mul(x), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


def test_kernels_can_be_switched_off():
    # A process reads the switch once, when it first needs the kernels: ask a fresh one.
    probe = (
        "from nanokv_cli.engine.cpu import kernels, library; s = library.status(); "
        "assert not kernels.available() and s.switched_off and s.lib is None, s"
    )
    env = {**os.environ, "NANOKV_CPU_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", probe], env=env, check=True, timeout=120)


# (out, in): SmolLM2's q/k/v (a tail of outputs past the tiles), an input that is no multiple
# of the vector width, a few outputs and inputs (one tile, a scalar tail only)
FLOAT_SHAPES = [(960, 576), (1030, 100), (5, 7)]


@pytest.mark.parametrize("shape", FLOAT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_float_layer_computes_a_row_the_same_in_any_batch(shape, threads):
    # One C product for every row count (csrc/linear.c): close to torch's, and a row's bits do
    # not depend on its batch, its place in it, the row stride or the thread count.
    torch.set_num_threads(threads)
    out_features, in_features = shape
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(shape, generator=g), torch.randn(out_features, generator=g)
    layer = FloatLinear(weight, bias)
    x = torch.randn(70, in_features, generator=g)
    full = layer(x)
    torch.testing.assert_close(full, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    for start, n in [(0, 1), (9, 1), (0, 2), (3, 3), (5, 4), (1, 13), (20, 50)]:
        assert torch.equal(layer(x[start : start + n]), full[start : start + n])
    strided = torch.randn(70, in_features + 9, generator=g)[:, 4 : 4 + in_features]
    strided.copy_(x)
    assert torch.equal(layer(strided), full)
    if threads == 2:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), full)


# -- the runner with and without its fast paths -------------------------------------------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = make_tiny_model("qwen3", Path(tmp_path_factory.mktemp("tiny")) / "qwen3")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return config, load_file(str(folder / "model.safetensors"))


def greedy_run(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[list, list]:
    """Prefill all prompts in one step, then decode them together; tokens and last logits."""
    seqs = [
        Sequence(p, SamplingParams(temperature=0.0), block_size=runner.block_size) for p in prompts
    ]
    next_block = 0
    for seq in seqs:
        need = -(-(len(seq) + steps) // runner.block_size)
        seq.block_table = list(range(next_block, next_block + need))
        next_block += need
        seq.num_scheduled_tokens = len(seq)
    logits = None
    for _ in range(steps):
        logits = runner.run_logits(seqs)
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.append_token(token)
            seq.num_scheduled_tokens = 1
    return [s.completion_token_ids for s in seqs], logits


@contextmanager
def without_fast_paths(monkeypatch):
    """As on a machine without a C compiler: every layer takes its torch path (the
    layers ask ``kernels.runs`` at each call, so the switch holds while it is on)."""
    with monkeypatch.context() as m:
        m.setenv("NANOKV_CPU_KERNELS", "0")
        cpu_kernels._library.cache_clear()
        try:
            yield
        finally:
            cpu_kernels._library.cache_clear()


def test_runner_fast_paths_agree_with_the_torch_paths(qwen3, monkeypatch):
    config, weights = qwen3

    def make():
        settings = EngineConfig(
            block_size=16, num_blocks=64, dtype="float32", device="cpu", quantization="none"
        )
        return ModelRunner(config, weights, resolve_plan(config, settings))

    fast = make()
    assert fast.plan.cpu_kernels and isinstance(fast.model.lm_head, FloatLinear)
    prompts = [[(i * 7 + j * 3) % 250 + 3 for i in range(n)] for j, n in enumerate((1, 19, 40))]
    for batch in (prompts, prompts[1:2]):  # a batch, and one sequence (1-row matmuls)
        fast_tokens, fast_logits = greedy_run(fast, batch, 6)
        with without_fast_paths(monkeypatch):
            slow = make()
            assert slow.plan.attention == "sdpa" and not slow.plan.fused_decoder
            slow_tokens, slow_logits = greedy_run(slow, batch, 6)
        assert fast_tokens == slow_tokens
        torch.testing.assert_close(fast_logits, slow_logits, atol=1e-5, rtol=0)


# -- recorded decode steps ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_archs(tmp_path_factory):
    root = Path(tmp_path_factory.mktemp("archs"))
    models = {}
    for arch in ("llama", "qwen2", "qwen3"):  # plain, q/k/v bias, per-head q/k norms
        folder = make_tiny_model(arch, root / arch)
        config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        models[arch] = (config, load_file(str(folder / "model.safetensors")))
    return models


def decode_dropping(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list:
    """Prefill all prompts, then decode greedily, the last sequence leaving after each step
    (steps of fewer and fewer rows); every step's logits."""
    seqs = [
        Sequence(p, SamplingParams(temperature=0.0), block_size=runner.block_size) for p in prompts
    ]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(8 * i, 8 * i + 8))
        seq.num_scheduled_tokens = len(seq)
    every = []
    for step in range(steps):
        logits = runner.run_logits(seqs)
        every.append(logits)
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.append_token(token)
            seq.num_scheduled_tokens = 1
        if step > 1 and len(seqs) > 1:
            seqs.pop()
    return every


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])  # None: float32 weights
def test_replayed_decode_steps_compute_what_the_layers_compute(
    tiny_archs, arch, quantization, monkeypatch
):
    config, weights = tiny_archs[arch]
    replays = []
    real = cpu_program.StepProgram.run
    monkeypatch.setattr(cpu_program.StepProgram, "run", lambda *a: replays.append(a[3]) or real(*a))

    def make(recorded: bool) -> ModelRunner:
        settings = EngineConfig(
            block_size=8, num_blocks=64, dtype="float32", device="cpu", quantization=quantization
        )
        plan = resolve_plan(config, settings)
        assert plan.fused_decoder
        # The layers' own path: the same runner, its plan's decoder unfused.
        return ModelRunner(config, weights, replace(plan, fused_decoder=recorded))

    # Contexts crossing block edges (the tables widen); 1, 3 and 5 sequences (the kernels' row
    # tiles of 1-4), then fewer and fewer rows: replays of the program recorded on the first
    # decode step, on a prefix of its rows.
    prompts = [
        [(i * 5 + j * 11) % 250 + 3 for i in range(n)] for j, n in enumerate((1, 9, 30, 17, 8))
    ]
    for batch in (prompts[2:3], prompts[:3], prompts):
        replays.clear()
        runner = make(True)
        recorded = decode_dropping(runner, batch, 7)
        assert runner.program.rows == len(batch)
        n = len(batch)
        assert replays == [n] + [max(1, n - k) for k in range(1, 5)]  # 6 decode steps, 1 recorded
        layered = decode_dropping(make(False), batch, 7)
        # The same kernel calls on the same inputs: the same bits.
        for a, b in zip(recorded, layered, strict=True):
            assert torch.equal(a, b)


def test_a_step_program_places_tensors_whose_lives_overlap_apart():
    # op 0 writes a, op 1 reads a and writes b, op 2 reads b: a and b overlap at op 1; c
    # (written at op 2) may reuse a's place.
    lives = {1: [0, 1, 100], 2: [1, 2, 64], 3: [2, 3, 128]}
    offsets, size = cpu_program._plan(lives)
    assert offsets[1] == 0 and offsets[2] >= 128 and offsets[3] == 0
    assert size == max(offsets[2] + 64, 128)


def test_a_step_program_gives_an_address_reused_by_a_larger_tensor_room_for_it():
    # Within a recorded step a freed tensor's address may come back for a larger one: the two
    # share a life and a place, which must hold the larger, apart from what lives beside it.
    memory = bytearray(4096)
    small = torch.frombuffer(memory, dtype=torch.float32, count=16).view(1, 16)
    large = torch.frombuffer(memory, dtype=torch.float32, count=1024).view(1, 1024)
    assert small.data_ptr() == large.data_ptr()
    g = torch.Generator().manual_seed(8)
    x, wide = torch.randn(1, 32, generator=g), torch.randn(1, 2048, generator=g)
    with cpu_program.recording() as tape:
        cpu_kernels._call("silu_mul_f32", x, cpu_kernels._Rows(1), 16, small, 1)
        cpu_kernels._call("silu_mul_f32", wide, cpu_kernels._Rows(1), 1024, large, 1)
        out = cpu_kernels.silu_mul(large)
    program = cpu_program.StepProgram(tape, [x, wide], out, set())
    at_large, at_out = program.ops[1].value[3], program.ops[2].value[3]
    assert at_out >= at_large + large.nbytes or at_out + out.nbytes <= at_large
    arena = torch.empty(program.arena_bytes, dtype=torch.uint8)
    replayed = program.run(arena, [x, wide], 1, 0)
    assert torch.equal(replayed, cpu_kernels.silu_mul(cpu_kernels.silu_mul(wide)))


def test_a_step_program_refuses_a_tensor_it_reads_but_neither_made_nor_was_given():
    # Its contents in a replay would be whatever the arena held: a weight left out of the
    # persistent set, say.
    x, weight = torch.randn(2, 64), torch.ones(64)
    with cpu_program.recording() as tape:
        out = cpu_kernels.rms_norm(x, weight, 1e-5)
    with pytest.raises(ValueError, match="rms_norm_f32 reads a tensor"):
        cpu_program.StepProgram(tape, [x], out, set())
    program = cpu_program.StepProgram(tape, [x], out, {weight.untyped_storage().data_ptr()})
    replayed = program.run(torch.empty(program.arena_bytes, dtype=torch.uint8), [x], 2, 0)
    assert torch.equal(replayed, out)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_probe_folds_every_word_of_the_buffer(threads):
    # The benchmarks' bandwidth probe (csrc/probe.c) must read all of it: its XOR fold is
    # numpy's, for sizes that split unevenly over the threads' chunks.
    for words in (1, 7, 1000, 12345):
        buffer = torch.randint(-(2**62), 2**62, (words,), dtype=torch.int64)
        expected = int(np.bitwise_xor.reduce(buffer.numpy())) & (2**64 - 1)
        assert cpu_kernels.read_probe(buffer, threads) == expected
        buffer[words // 2] ^= 1  # one changed bit anywhere changes the fold
        assert cpu_kernels.read_probe(buffer, threads) == expected ^ 1
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.read_probe(torch.zeros(8, 8, dtype=torch.int64).t(), 1)
