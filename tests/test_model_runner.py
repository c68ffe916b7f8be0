"""ModelRunner against Hugging Face transformers on tiny random Llama, Qwen2 and Qwen3 models.

A small driver below plays the scheduler's part (hands out blocks, advances sequences), so these
tests exercise the runner alone: paged K/V writes and reads, prefix-cache hits, chunked prefill,
mixed prefill/decode batches, preemption by recompute, and block sizes 1, 16 and 256.
"""

import socket
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from support.engines import Driver
from support.models import read_model

from nanokv_cli.engine.config import EngineConfig, ModelConfig
from nanokv_cli.engine.cpu import kernels as cpu_kernels
from nanokv_cli.engine.runner.attention_backends import MIN_DECODE_GROUP
from nanokv_cli.engine.runner.model_runner import ModelRunner
from nanokv_cli.engine.runner.run_plan import resolve_dtype, resolve_plan
from nanokv_cli.engine.sequence import Sequence

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so the 20..100-token prompts below cross every band of the scaling.
    "original_max_position_embeddings": 64,
}
# name -> (architecture, config overrides)
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
}
ATOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread")


@cache
def hf_model(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tiny_weights):
    """name -> (config, weights, folder) of the tiny model ``VARIANTS[name]``."""
    return lambda name: tiny_weights(name, VARIANTS[name][0], **VARIANTS[name][1])


def hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits at every position of ``ids``."""
    with torch.no_grad():
        return hf_model(folder)(torch.tensor([ids])).logits[0]


def hf_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(folder, ids)[-1].argmax()))
    return ids[len(prompt) :]


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11) % 290 + 3 for i in range(length)]


def make_runner(config, weights, *, block_size=16, num_blocks=256, dtype="float32", **kw):
    settings = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        dtype=dtype,
        device="cpu",
        max_model_len=512,
        **kw,
    )
    return ModelRunner(config, weights, resolve_plan(config, settings))


# -- parity with transformers -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_logits_match_transformers(models, name):
    config, weights, folder = models(name)
    runner = make_runner(config, weights)
    prompt = prompt_of(100)
    seq = Driver(runner).new(prompt)
    seq.block_table = list(range(7))
    seq.num_scheduled_tokens = len(prompt)
    logits = runner.run_logits([seq])
    assert logits.dtype == torch.float32 and logits.shape == (1, config.vocab_size)
    torch.testing.assert_close(logits[0], hf_logits(folder, prompt)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_greedy_decode_matches_transformers(models, name, block_size):
    config, weights, folder = models(name)
    runner = make_runner(config, weights, block_size=block_size, num_blocks=4096 // block_size)
    prompt = prompt_of(23, salt=block_size)
    assert Driver(runner).generate([prompt], 20) == [hf_greedy(folder, prompt, 20)]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_chunked_prefill_logits_at_every_chunk_end(models, name):
    config, weights, folder = models(name)
    runner = make_runner(config, weights, block_size=16)
    prompt = prompt_of(50, salt=3)
    reference = hf_logits(folder, prompt)
    driver = Driver(runner)
    seq = driver.new(prompt)
    for end in (7, 14, 33, 50):  # chunk ends inside and across block boundaries
        seq.num_scheduled_tokens = end - seq.num_cached_tokens
        while len(seq.block_table) * 16 < end:
            seq.block_table.append(driver.free.pop(0))
        logits = runner.run_logits([seq])
        torch.testing.assert_close(logits[0], reference[end - 1], atol=ATOL, rtol=0)
        seq.num_cached_tokens = end


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_mixed_batches_with_chunked_prefill_match_transformers(models, name):
    config, weights, folder = models(name)
    runner = make_runner(config, weights, block_size=16)
    prompts = [prompt_of(41, 1), prompt_of(9, 2), prompt_of(30, 3), prompt_of(1, 4)]
    runner.kv_cache.fill_(float("nan"))  # unwritten cache memory must never be read
    driver = Driver(runner)
    outputs = driver.generate(prompts, 12, chunk=8, arrivals=[0, 2, 3, 5])
    assert outputs == [hf_greedy(folder, p, 12) for p in prompts]
    assert any(kinds == {"prefill", "decode"} for kinds in driver.step_kinds)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_prefix_cache_hit_reads_blocks_written_by_another_sequence(models, name):
    config, weights, folder = models(name)
    runner = make_runner(config, weights, block_size=16)
    driver = Driver(runner)
    shared = prompt_of(32, salt=5)  # two full blocks
    first = driver.new(shared + prompt_of(9, salt=6))
    driver.step([(first, first.num_tokens)])

    prompt = shared + prompt_of(7, salt=7)
    second = driver.new(prompt)
    second.block_table = first.block_table[:2]  # the hit: same physical blocks
    second.num_cached_tokens = 32
    tokens = [driver.step([(second, 7)])[0]]
    for _ in range(9):
        tokens.append(driver.step([(second, 1)])[0])
    assert tokens == hf_greedy(folder, prompt, 10)

    # The blocks really are read: with their contents gone the answer changes.
    third = driver.new(prompt)
    third.block_table = first.block_table[:2]
    third.num_cached_tokens = 32
    third.num_scheduled_tokens = 7
    third.block_table.append(driver.free.pop(0))
    runner.kv_cache[:, :, first.block_table[:2]] = 0
    stale = runner.run_logits([third])[0]
    assert not torch.allclose(stale, hf_logits(folder, prompt)[-1], atol=ATOL)


def test_recompute_after_preemption_matches_transformers(models):
    config, weights, folder = models("llama")
    runner = make_runner(config, weights, block_size=4, num_blocks=64)
    driver = Driver(runner)
    prompt = prompt_of(13, salt=8)
    seq = driver.new(prompt)
    driver.step([(seq, seq.num_tokens)])
    for _ in range(7):
        driver.step([(seq, 1)])
    driver.release(seq)  # preempted: its blocks go to another request, which overwrites them
    other = driver.new(prompt_of(40, salt=9))
    driver.step([(other, other.num_tokens)])
    # Re-admitted: prompt and generated tokens recomputed (in two chunks), then decoding resumes.
    driver.step([(seq, 10)])
    driver.step([(seq, seq.num_tokens - 10), (other, 1)])
    while seq.num_completion_tokens < 20:
        driver.step([(seq, 1)])
    assert seq.completion_token_ids == hf_greedy(folder, prompt, 20)


def test_large_decode_batch_in_length_buckets_matches_transformers(models):
    config, weights, folder = models("qwen2")
    runner = make_runner(config, weights, block_size=16, num_blocks=512)
    # Enough sequences for several decode buckets, with very different context lengths.
    prompts = [prompt_of(3 + (i * 17) % 70, salt=i) for i in range(3 * MIN_DECODE_GROUP)]
    runner.kv_cache.fill_(float("nan"))  # padding must not read unwritten slots either
    outputs = Driver(runner).generate(prompts, 3)
    assert outputs == [hf_greedy(folder, p, 3) for p in prompts]


# -- precision ----------------------------------------------------------------------------------


def test_bfloat16_runs_and_agrees_with_float32(models):
    config, weights, _ = models("llama")
    prompt = prompt_of(30, salt=10)
    results = {}
    for dtype in ("float32", "bfloat16"):
        runner = make_runner(config, weights, dtype=dtype)
        assert runner.kv_cache.dtype == runner.dtype == resolve_dtype(dtype, runner.device)
        driver = Driver(runner)
        seq = driver.new(prompt)
        seq.block_table, seq.num_scheduled_tokens = [0, 1], len(prompt)
        logits = runner.run_logits([seq])[0]
        results[dtype] = (logits, Driver(runner).generate([prompt], 4)[0])
    torch.testing.assert_close(results["bfloat16"][0], results["float32"][0], atol=2e-2, rtol=0)
    assert results["bfloat16"][1] == results["float32"][1]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_sdpa_prefill_path_matches_transformers(models, name):
    """Reduced precision prefills through SDPA with an offset causal mask; float64 takes the same
    path, so it can be checked exactly: chunks, a cached prefix and mixed batches."""
    config, weights, folder = models(name)
    runner = make_runner(config, weights, dtype="float64")
    prompts = [prompt_of(45, 13), prompt_of(20, 14)]
    outputs = Driver(runner).generate(prompts, 8, chunk=16, arrivals=[0, 1])
    assert outputs == [hf_greedy(folder, p, 8) for p in prompts]
    seq = Driver(runner).new(prompts[0])
    seq.block_table, seq.num_scheduled_tokens = [0, 1, 2], 30
    runner.run_logits([seq])
    seq.num_cached_tokens, seq.num_scheduled_tokens = 30, 15
    logits = runner.run_logits([seq])[0].float()
    torch.testing.assert_close(logits, hf_logits(folder, prompts[0])[-1], atol=ATOL, rtol=0)


def test_dtype_resolution():
    cpu = torch.device("cpu")
    assert resolve_dtype(None, cpu) == torch.float32  # the CPU kernels' dtype on every CPU
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("fp32", cpu) == torch.float32
    assert resolve_dtype(torch.bfloat16, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int7", cpu)


def test_kv_cache_dtype_is_its_own_setting(models):
    """The K/V dtype is decided by the plan from kv_cache_dtype, apart from the weights' dtype:
    float16 K/V under float32 weights runs on the CPU kernels (which convert in hardware) and
    still decodes transformers' tokens here; a K/V dtype no attention path can read is refused
    before anything is built."""
    if not cpu_kernels.half_cache_supported():
        pytest.skip("this CPU has no F16C: the kernels keep float32 K/V")  # pragma: no cover
    config, weights, folder = models("llama")
    settings = EngineConfig(device="cpu", dtype="float32", quantization="none")
    assert resolve_plan(config, settings).kv_cache_dtype == torch.float32  # none: float32
    half = make_runner(config, weights, quantization="none", kv_cache_dtype="float16")
    assert half.plan.kv_cache_dtype == half.kv_cache.dtype == torch.float16
    assert half.plan.dtype == torch.float32
    prompt = prompt_of(23, salt=5)
    assert Driver(half).generate([prompt], 12) == [hf_greedy(folder, prompt, 12)]
    with pytest.raises(ValueError, match="kv_cache_dtype 'bfloat16' with float32 weights"):
        resolve_plan(config, replace(settings, kv_cache_dtype="bfloat16"))
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_plan(config, replace(settings, kv_cache_dtype="int3"))


# -- cache layout and sizing --------------------------------------------------------------------


def test_kv_cache_layout_and_writes_go_through_the_block_table(models):
    config, weights, _ = models("qwen3")
    runner = make_runner(config, weights, block_size=8, num_blocks=10)
    assert runner.kv_cache.shape == (
        config.num_hidden_layers,
        2,
        10,
        8,
        config.num_key_value_heads,
        config.head_dim,
    )
    runner.kv_cache.fill_(float("nan"))
    seq = Driver(runner).new(prompt_of(12))
    seq.block_table = [7, 3]
    seq.num_scheduled_tokens = 12
    runner.run([seq])
    written = runner.kv_cache.isfinite().all(dim=5).all(dim=4).all(dim=1).all(dim=0)
    expected = torch.zeros(10, 8, dtype=torch.bool)
    expected[7, :] = True
    expected[3, :4] = True  # 12 tokens: one full block and half of the next
    assert torch.equal(written, expected)


def test_cpu_cache_size_from_memory_budget(models):
    config, weights, _ = models("llama")
    runner = make_runner(config, weights, num_blocks=None, kv_cache_memory=1 << 20)
    layers, kv_heads, head_dim = (
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
    )
    block_bytes = 2 * layers * 16 * kv_heads * head_dim * 4
    assert runner.block_bytes == block_bytes
    assert runner.num_blocks == (1 << 20) // block_bytes
    assert runner.kv_cache.numel() * 4 <= 1 << 20
    # Never more than max_num_seqs sequences of max_model_len tokens could use.
    capped = make_runner(config, weights, num_blocks=None, max_num_seqs=2)
    assert capped.num_blocks == 2 * 512 // 16
    with pytest.raises(ValueError, match="cannot hold a single block"):
        make_runner(config, weights, num_blocks=None, kv_cache_memory=block_bytes - 1)


# -- clear errors -------------------------------------------------------------------------------


def test_missing_weight_is_named(models):
    config, weights, _ = models("qwen2")
    incomplete = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(
        ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"
    ):
        make_runner(config, incomplete)


def test_wrong_shape_is_named(models):
    config, weights, _ = models("llama")
    bad = dict(weights)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"][:-1]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*shape"):
        make_runner(config, bad)


def test_untied_model_needs_its_lm_head(models):
    config, weights, _ = models("llama")
    with pytest.raises(ValueError, match="lm_head.weight"):
        make_runner(config, {k: v for k, v in weights.items() if k != "lm_head.weight"})


def test_tied_model_ignores_a_stored_lm_head(models):
    config, weights, folder = models("llama-tied")
    extra = dict(
        weights, **{"lm_head.weight": torch.zeros_like(weights["model.embed_tokens.weight"])}
    )
    runner = make_runner(config, extra)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    prompt = prompt_of(5)
    assert Driver(runner).generate([prompt], 3) == [hf_greedy(folder, prompt, 3)]


def test_position_beyond_max_model_len_is_rejected(models):
    config, weights, _ = models("llama")
    runner = make_runner(config, weights)
    seq = Driver(runner).new(prompt_of(513))
    seq.block_table = list(range(33))
    seq.num_scheduled_tokens = 513
    with pytest.raises(ValueError, match="max_model_len"):
        runner.run([seq])


def test_unknown_rope_scaling_is_rejected(models):
    config, weights, _ = models("llama")
    config = ModelConfig(
        **{**config.__dict__, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    )
    with pytest.raises(ValueError, match="yarn"):
        make_runner(config, weights)


# -- tensor parallelism (gloo, two processes) ---------------------------------------------------


class RankDriver(Driver):
    """Every rank runs the model; rank 0 samples and shares the tokens (as the engine will)."""

    def run(self, seqs: list[Sequence]) -> list[int]:
        import torch.distributed as dist

        box = [self.runner.run(seqs)]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _tp_worker(rank: int, world: int, port: int, folders: list[Path], out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results = []
        for folder in folders:
            config, weights, _ = read_model(folder)
            runner = make_runner(config, weights, block_size=16)
            assert runner.kv_cache.shape[4] == config.num_key_value_heads // world
            results.append(tp_probe(runner, RankDriver))
        if rank == 0:
            torch.save(results, out)
        else:
            assert all(logits is None for logits, _ in results)
    finally:
        dist.destroy_process_group()


def tp_probe(runner: ModelRunner, driver: type[Driver]) -> tuple[torch.Tensor | None, list]:
    """Prefill logits of one prompt, and greedy outputs of a two-sequence batch."""
    seq = driver(runner).new(prompt_of(20, salt=11))
    seq.block_table, seq.num_scheduled_tokens = [0, 1], 20
    logits = runner.run_logits([seq])
    outputs = driver(runner).generate([prompt_of(20, salt=11), prompt_of(7, salt=12)], 6)
    return logits, outputs


def test_tensor_parallel_two_ranks_match_one(models, tmp_path):
    """Sharded heads (with Qwen2's q/k/v bias, Qwen3's q/k norm), MLP and tied vocabulary."""
    import torch.multiprocessing as mp

    names = ["qwen2", "qwen3", "llama-tied"]
    folders = [models(name)[2] for name in names]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_tp_worker, args=(2, port, folders, out), nprocs=2, join=True)
    sharded = torch.load(out)
    for name, (logits, outputs) in zip(names, sharded):
        config, weights, _ = models(name)
        expected_logits, expected_outputs = tp_probe(
            make_runner(config, weights, block_size=16), Driver
        )
        torch.testing.assert_close(logits, expected_logits, atol=ATOL, rtol=0)
        assert outputs == expected_outputs, name


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_copied_kv_of_a_shared_block_prefix_gives_transformers_tokens(models, name):
    """Token-granular prefix hits: the K/V of a block's shared leading tokens are copied
    (``Sequence.kv_copy``) before the forward pass, in order, so a later copy may overwrite a
    block an earlier one read from, and a source may be its own destination."""
    config, weights, folder = models(name)
    runner = make_runner(config, weights, block_size=16)
    driver = Driver(runner)
    shared = prompt_of(16 + 11, salt=8)  # one full block, then 11 tokens of the next
    first = driver.new(shared + prompt_of(3, salt=9))
    driver.step([(first, first.num_tokens)])
    src = first.block_table[1]

    second = driver.new(shared + prompt_of(6, salt=10))
    third = driver.new(shared + prompt_of(4, salt=11))
    target = driver.free.pop(0)
    second.block_table = [first.block_table[0], target]
    third.block_table = [first.block_table[0], src]  # its destination is the source itself
    for seq in (second, third):
        seq.num_cached_tokens = 27
        seq.block_table.append(driver.free.pop(0))
    second.kv_copy = (src, target, 11)  # reads src before anything writes it
    third.kv_copy = (src, src, 11)
    tokens = driver.step([(second, second.num_tokens - 27), (third, third.num_tokens - 27)])
    assert second.kv_copy is None and third.kv_copy is None  # consumed
    assert tokens == [
        hf_greedy(folder, second.token_ids[: second.num_prompt_tokens], 1)[0],
        hf_greedy(folder, third.token_ids[: third.num_prompt_tokens], 1)[0],
    ]
    for seq in (second, third):
        for _ in range(5):
            driver.step([(seq, 1)])
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        assert seq.completion_token_ids == hf_greedy(folder, prompt, 6)

    # The copy really happens: without it the answer changes.
    fourth = driver.new(shared + prompt_of(6, salt=10))
    fourth.block_table = [first.block_table[0], driver.free.pop(0), driver.free.pop(0)]
    fourth.num_cached_tokens = 27
    fourth.num_scheduled_tokens = fourth.num_tokens - 27
    runner.kv_cache[:, :, fourth.block_table[1]] = 0
    stale = runner.run_logits([fourth])[0]
    prompt = fourth.token_ids[: fourth.num_prompt_tokens]
    assert not torch.allclose(stale, hf_logits(folder, prompt)[-1], atol=ATOL)
