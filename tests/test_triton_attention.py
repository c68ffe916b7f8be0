"""Our Triton paged attention (engine/runner/triton_attention.py, triton_kernels.py) on CPU, under
Triton's interpreter: the same kernels a CUDA run compiles, checked against SDPA over gathered
K/V (the reference), then a tiny model end to end through the ``triton`` back end, and the
back-end choice of a CUDA machine posed without one (issue 44).

TRITON_INTERPRET=1 must be set when triton is imported (its own library functions, tl.zeros,
tl.cdiv, are decorated then) and when our kernels are (the engine imports them when one first
runs). It is set for the import below and for this module's tests, and put back in between,
so other test files (and the processes they start) never see it. Needs triton, no GPU.
"""

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F


def _interpret(previous: str | None) -> None:
    if previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous


_PREVIOUS = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip(
    "triton.language",
    reason="triton is not installed (pip install 'nanokv[test]' brings it on Linux)",
)
_interpret(_PREVIOUS)

from support.engines import Driver  # noqa: E402

from nanokv_cli import doctor  # noqa: E402
from nanokv_cli.engine.config import EngineConfig  # noqa: E402
from nanokv_cli.engine.runner import triton_attention  # noqa: E402
from nanokv_cli.engine.runner.model_runner import ModelRunner  # noqa: E402
from nanokv_cli.engine.runner.run_plan import (  # noqa: E402
    AttentionKernels,
    captures_graphs,
    choose_attention,
    resolve_plan,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    _interpret(_PREVIOUS)


# -- the kernel against SDPA --------------------------------------------------------------------


def paged_case(block_size, heads, kv_heads, head_dim, q_lens, contexts, dtype=torch.float32):
    """q for ``q_lens`` rows per sequence, a cache holding each sequence's ``contexts`` tokens
    in scattered blocks (the rest NaN: a kernel reading a slot it must not read fails), and
    the block tables."""
    gen = torch.Generator().manual_seed(sum(contexts) + block_size)
    blocks = [-(-c // block_size) for c in contexts]
    num_blocks = sum(blocks) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    for i, (c, n) in enumerate(zip(contexts, blocks)):
        table, order = order[:n], order[n:]
        tables[i, :n] = torch.tensor(table)
        for pos in range(c):
            b, off = table[pos // block_size], pos % block_size
            k_cache[b, off] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[b, off] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables


def sdpa_reference(q, k_cache, v_cache, tables, q_lens, contexts, scale):
    """Each sequence's rows over its gathered K/V, causal with the diagonal offset by its
    cached prefix, in float64."""
    block_size, out, row = k_cache.shape[1], [], 0
    for i, (n, c) in enumerate(zip(q_lens, contexts)):
        pos = torch.arange(c)
        blocks = tables[i, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].double().transpose(0, 1)  # [kv_heads, c, hd]
        v = v_cache[blocks, pos % block_size].double().transpose(0, 1)
        query = q[row : row + n].double().transpose(0, 1)  # [heads, n, hd]
        mask = pos.unsqueeze(0) <= torch.arange(c - n, c).unsqueeze(1)
        o = F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out.append(o.transpose(0, 1))
        row += n
    return torch.cat(out)


def check(
    block_size, heads, kv_heads, head_dim, q_lens, contexts, dtype=torch.float32, splits=None
):
    q, k_cache, v_cache, tables = paged_case(
        block_size, heads, kv_heads, head_dim, q_lens, contexts, dtype
    )
    scale = head_dim**-0.5
    meta = triton_attention.describe(q_lens, contexts, tables, heads // kv_heads, kv_heads, splits)
    out = triton_attention.paged_attention(q, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = sdpa_reference(q, k_cache, v_cache, tables, q_lens, contexts, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("block_size", [16, 32, 64, 256, 5])
def test_decode_rows_at_every_block_size(block_size):
    """Contexts of one token, ending on a block boundary, one past it, and spanning several
    blocks; block size 5 stands for any size (a key's block is looked up per position)."""
    contexts = [1, block_size, block_size + 1, 3 * block_size - 2]
    check(block_size, 4, 2, 16, [1] * 4, contexts)


@pytest.mark.parametrize(
    ("heads", "kv_heads"),
    [(4, 4), (4, 2), (8, 1), (6, 2), (32, 2)],
    ids=["mha", "gqa-2", "mqa-8", "gqa-3", "gqa-16"],
)
def test_gqa_and_mqa_ratios(heads, kv_heads):
    # A decode, a whole prompt and a chunk over a cached prefix, at each ratio (the query
    # heads of a KV head share a program's score rows, as far as they fit).
    check(16, heads, kv_heads, 16, [1, 9, 20], [40, 9, 37])


def test_chunked_prefill_over_a_cached_prefix_in_one_launch_with_decodes():
    """A step as the runner lays it out: decodes first, then prompt chunks of several query
    tiles, one over a prefix ending inside a block and one on a boundary; the causal diagonal
    is offset by each prefix."""
    q_lens = [1, 1, 1, 23, 16, 7]
    contexts = [3, 33, 64, 23 + 21, 16 + 32, 7]
    check(16, 4, 2, 32, q_lens, contexts)


@pytest.mark.parametrize("splits", [2, 4, 16])
def test_split_kv_launch_matches_one_program_per_tile(splits):
    """The 3D launch (key ranges merged after) gives the 2D one's answer, also where some
    splits get no keys at all (short contexts, more splits than key tiles)."""
    q_lens, contexts = [1, 1, 5], [300, 2, 90]
    one = check(16, 4, 2, 16, q_lens, contexts, splits=1)
    split = check(16, 4, 2, 16, q_lens, contexts, splits=splits)
    torch.testing.assert_close(split, one, atol=1e-6, rtol=1e-6)


def test_split_kv_is_chosen_for_few_long_sequences():
    tables = torch.zeros(4, 128, dtype=torch.int32)
    long, short = [4096] * 4, [100] * 4
    assert triton_attention.describe([1] * 4, long, tables, 4, 2).num_splits > 1  # few programs
    assert triton_attention.describe([1] * 4, short, tables, 4, 2).num_splits == 1  # short
    many = triton_attention.describe([1] * 256, [4096] * 256, tables.repeat(64, 1), 4, 2)
    assert many.num_splits == 1  # enough programs to fill a GPU


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dtypes_and_head_dims(dtype, head_dim):
    check(16, 4, 2, head_dim, [1, 1, 6], [17, 32, 40], dtype=dtype)


def test_query_tiles_cover_each_sequence():
    meta = triton_attention.describe([1, 20, 3], [5, 20, 9], torch.zeros(3, 2), 2, 2)
    rows = triton_attention.query_tile(2)[1]  # 8 queries of 2 heads: 16 score rows
    assert rows == 8
    assert meta.tile_seq.tolist() == [0, 1, 1, 1, 2]
    assert meta.tile_first.tolist() == [0, 0, 8, 16, 0]
    assert meta.query_start.tolist() == [0, 1, 21, 24]


# -- a tiny model through the triton back end ---------------------------------------------------


def runner_for(config, weights, backend="auto", **kw) -> ModelRunner:
    base = {"block_size": 16, "num_blocks": 64, "device": "cpu", "max_model_len": 256}
    settings = EngineConfig(**{**base, "threads": 1, "attention_backend": backend, **kw})
    return ModelRunner(config, weights, resolve_plan(config, settings))


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11) % 290 + 3 for i in range(length)]


PROMPTS = [prompt_of(n, salt) for salt, n in enumerate([9, 23, 40])]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_gives_the_torch_paths_greedy_tokens(tiny_weights, arch):
    """Whole prompts, then prompts in 8-token chunks joining a running batch (mixed steps of
    decodes and chunks over cached prefixes), against the CPU's own path."""
    config, weights = tiny_weights(arch)[:2]
    reference = runner_for(config, weights)
    triton_run = runner_for(config, weights, "triton")
    assert triton_run.plan.attention == "triton" and reference.plan.attention != "triton"
    for chunk, arrivals in [(None, None), (8, [0, 1, 3])]:
        expected = Driver(reference).generate(PROMPTS, 5, chunk, arrivals)
        assert Driver(triton_run).generate(PROMPTS, 5, chunk, arrivals) == expected


def test_bfloat16_logits_agree_with_sdpa(tiny_weights):
    config, weights = tiny_weights("llama")[:2]
    logits = {}
    for backend in ("sdpa", "triton"):
        runner = runner_for(config, weights, backend, dtype="bfloat16")
        seq = Driver(runner).new(PROMPTS[2])
        seq.block_table, seq.num_scheduled_tokens = [0, 1, 2], 30
        runner.run_logits([seq])
        seq.num_cached_tokens, seq.num_scheduled_tokens = 30, 10  # a chunk over a prefix
        logits[backend] = runner.run_logits([seq])[0]
    torch.testing.assert_close(logits["triton"], logits["sdpa"], atol=3e-2, rtol=0)


def test_recompute_after_preemption(tiny_weights):
    """A preempted sequence's blocks are overwritten by another; recomputed in two chunks
    it decodes as if never preempted."""
    config, weights = tiny_weights("llama")[:2]
    expected = Driver(runner_for(config, weights)).generate([PROMPTS[1]], 12)[0]
    runner = runner_for(config, weights, "triton", block_size=4)
    driver = Driver(runner)
    seq = driver.new(PROMPTS[1])
    driver.step([(seq, seq.num_tokens)])
    for _ in range(4):
        driver.step([(seq, 1)])
    driver.release(seq)
    other = driver.new(prompt_of(30, salt=9))
    driver.step([(other, other.num_tokens)])
    driver.step([(seq, 10)])
    driver.step([(seq, seq.num_tokens - 10), (other, 1)])
    while seq.num_completion_tokens < 12:
        driver.step([(seq, 1)])
    assert seq.completion_token_ids == expected


def test_copied_prefix_hit(tiny_weights):
    """A token-granular hit: the shared leading tokens' K/V are copied into a fresh block
    (``Sequence.kv_copy``) before the step, and the kernel reads them where they landed."""
    config, weights = tiny_weights("qwen3")[:2]
    shared = prompt_of(16 + 11, salt=8)  # a full block, then 11 tokens of the next
    prompt = shared + prompt_of(6, salt=10)
    expected = Driver(runner_for(config, weights)).generate([prompt], 4)[0]
    runner = runner_for(config, weights, "triton")
    driver = Driver(runner)
    first = driver.new(shared + prompt_of(3, salt=9))
    driver.step([(first, first.num_tokens)])
    second = driver.new(prompt)
    target = driver.free.pop(0)
    second.block_table = [first.block_table[0], target]
    second.num_cached_tokens = 27
    second.kv_copy = (first.block_table[1], target, 11)
    driver.step([(second, second.num_tokens - 27)])
    while second.num_completion_tokens < 4:
        driver.step([(second, 1)])
    assert second.completion_token_ids == expected


def test_sizing_warmup_runs_the_kernel_on_a_scratch_block(tiny_weights, monkeypatch):
    """The CUDA memory-sizing warm-up runs before the cache exists; the triton back end
    reads K/V from the cache, so the warm-up gives it one scratch block."""
    config, weights = tiny_weights("llama")[:2]
    runner = runner_for(config, weights, "triton", max_num_batched_tokens=64)
    calls = []
    real = triton_attention.paged_attention
    monkeypatch.setattr(
        triton_attention, "paged_attention", lambda *a: calls.append(a[1].shape) or real(*a)
    )
    runner._warmup()
    assert calls and all(shape[0] == 1 for shape in calls)  # one block


@pytest.mark.parametrize("max_context", [256, 4096], ids=["2d", "split-kv"])
def test_a_decode_staged_into_the_graph_inputs_computes_the_eager_step(tiny_weights, max_context):
    """What a replayed CUDA graph computes, checked on CPU: a decode step of 3 rows copied
    into the graphs' static buffers and padded to the ladder's 4 (the padding row stores into
    the scratch block and attends to nothing) gives the eager step's hidden states, in the
    launch fixed at capture for that batch size (split-KV when contexts may grow long)."""
    config, weights = tiny_weights("llama")[:2]
    runner = runner_for(config, weights, "triton")
    driver = Driver(runner)
    seqs = [driver.new(p) for p in PROMPTS]
    driver.step([(s, s.num_tokens) for s in seqs])
    driver.step([(s, 1) for s in seqs])  # blocks for the next token are in place after this
    for s in seqs:
        s.num_scheduled_tokens = 1
    graphs = runner._decode_graphs()
    graphs.max_context = max_context
    scratch = runner.num_blocks - 1  # never handed out here (the runner has no extra block)
    graphs.scratch_slot = scratch * runner.block_size
    with torch.inference_mode():
        batch = runner._prepare(seqs)
        assert batch.plan.decode_only
        eager = runner.model(batch.input_ids, batch.positions, batch.meta)
        runner.kv_cache[:, :, scratch] = float("nan")
        b = graphs.stage(batch.input_ids, batch.positions, batch.meta)
        meta = graphs.meta(b)
        assert b == 4 and (meta.triton.num_splits > 1) == (max_context > 1024)
        g = graphs.inputs
        staged = runner.model(g["input_ids"][:b], g["positions"][:b], meta)
    torch.testing.assert_close(staged[:3], eager, atol=1e-5, rtol=1e-5)
    assert staged[3].isfinite().all()  # the padding row saw no key, and no NaN
    assert runner.kv_cache[:, :, scratch, 0].isfinite().all()  # its K/V went to the scratch


# -- the choice of back end ---------------------------------------------------------------------


def kernels(**kw) -> AttentionKernels:
    have = {"cpu_kernels": True, "flash_attn": False, "triton": True, "triton_interpreter": False}
    return AttentionKernels(**{**have, **kw})


def test_cuda_without_flash_attn_picks_triton():
    choice = choose_attention("auto", CUDA, torch.bfloat16, 256, kernels())
    assert choice.kind == "triton" and "flash-attn is not installed" in choice.reason
    assert choose_attention("auto", CUDA, torch.float32, 16, kernels()).kind == "triton"


def test_graphs_on_cuda_for_triton_unless_eager():
    assert captures_graphs("triton", CUDA, enforce_eager=False)
    assert not captures_graphs("triton", CUDA, enforce_eager=True)
    assert not captures_graphs("triton", CPU, enforce_eager=False)  # the interpreter: eager
    assert not captures_graphs("sdpa", CUDA, enforce_eager=False)


def test_cuda_auto_takes_flash_attn_only_where_it_serves():
    flash = kernels(flash_attn=True)
    assert choose_attention("auto", CUDA, torch.bfloat16, 256, flash).kind == "flash"
    small = choose_attention("auto", CUDA, torch.bfloat16, 16, flash)
    assert small.kind == "triton" and "multiple of 256" in small.reason
    assert choose_attention("auto", CUDA, torch.float32, 256, flash).kind == "triton"
    bare = choose_attention("auto", CUDA, torch.float16, 16, kernels(triton=False))
    assert bare.kind == "sdpa" and "triton is not installed" in bare.reason


def test_cpu_auto_is_unchanged():
    assert choose_attention("auto", CPU, torch.float32, 256, kernels()).kind == "paged-c"
    assert choose_attention("auto", CPU, torch.bfloat16, 256, kernels()).kind == "sdpa"
    assert choose_attention("auto", CPU, torch.float32, 16, kernels(cpu_kernels=False)).kind == (
        "sdpa"
    )
    # Triton never runs on CPU unless asked for, interpreter or not.
    on = kernels(triton_interpreter=True)
    assert choose_attention("auto", CPU, torch.float32, 16, on).kind == "paged-c"


@pytest.mark.parametrize(
    ("setting", "device", "dtype", "block", "have", "message"),
    [
        ("triton", CPU, torch.float32, 16, {}, "start the process with TRITON_INTERPRET=1"),
        ("triton", CUDA, torch.float16, 16, {"triton": False}, "pip install triton"),
        ("flash", CPU, torch.float16, 256, {"flash_attn": True}, "CUDA only"),
        ("flash", CUDA, torch.float16, 16, {"flash_attn": True}, "multiple of 256"),
        ("flash", CUDA, torch.float16, 256, {}, "not installed"),
        ("paged-c", CUDA, torch.float32, 16, {}, "on CPU"),
        ("paged-c", CPU, torch.bfloat16, 16, {}, "float32"),
    ],
)
def test_a_back_end_that_cannot_run_is_refused_saying_why(
    setting, device, dtype, block, have, message
):
    with pytest.raises(ValueError, match=f"--attention-backend {setting}: .*{message}"):
        choose_attention(setting, device, dtype, block, kernels(**have))


def test_explicit_choices_that_run():
    on = kernels(triton_interpreter=True)
    assert choose_attention("triton", CPU, torch.float32, 16, on).kind == "triton"
    assert choose_attention("sdpa", CUDA, torch.float16, 16, kernels()).kind == "sdpa"


def test_the_setting_is_checked_and_is_a_flag():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="xformers")
    field = {f.name: f for f in EngineConfig.__dataclass_fields__.values()}["attention_backend"]
    assert field.metadata["flag"] == "--attention-backend"
    assert set(field.metadata["choices"]) == {"auto", "triton", "flash", "sdpa", "paged-c"}
    assert replace(EngineConfig(), enforce_eager=True).enforce_eager


def test_doctor_says_what_a_cuda_run_would_use():
    check = doctor._cuda_attention()
    assert check.detail["backend"] in ("triton", "flash")  # triton is installed here
    assert check.detail["reason"] and check.detail["backend"] in check.value
