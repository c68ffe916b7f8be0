"""The whole engine (scheduler + block manager + model runner) through the public ``LLM`` API,
against Hugging Face transformers' greedy output on the same weights.

The engine's contract: in float32 with greedy sampling, generated tokens are identical whatever
the block size, prefix caching, chunk size, batch composition and preemption.
"""

from functools import cache

import pytest
import torch
import transformers
from support.models import make_tiny_model

from nanokv_cli import LLM, SamplingParams
from nanokv_cli.engine.config import UnsupportedModelError
from nanokv_cli.engine.core.events import BlockHit, SequencePreempted
from nanokv_cli.engine.core.scheduler import RequestRejected
from nanokv_cli.engine.model.loader import ModelLoadError
from nanokv_cli.run.stats import InfiniteCache, RunStats

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("llm_models")


@cache
def model_dir(arch: str, root) -> str:
    return str(make_tiny_model(arch, root / arch))


@cache
def hf_greedy(path: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def prompts_with_shared_prefix(n: int = 4, prefix_len: int = 37) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 300, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 300, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


CONFIGS = {
    "block16": dict(block_size=16, num_blocks=64),
    "block1": dict(block_size=1, num_blocks=400),
    "block256": dict(block_size=256, num_blocks=4),
    "chunked": dict(block_size=16, num_blocks=64, max_num_batched_tokens=7),
    "preempting": dict(block_size=4, num_blocks=20, max_num_batched_tokens=16),
    "no-prefix-cache": dict(block_size=16, num_blocks=64, enable_prefix_caching=False),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_tokens_equal_transformers(root, arch, config):
    path = model_dir(arch, root)
    prompts = prompts_with_shared_prefix()
    llm = LLM(path, dtype="float32", device="cpu", **CONFIGS[config])
    events = []
    llm.engine.events.subscribe(events.append)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(path, tuple(prompt), GREEDY.max_tokens)
    if config == "preempting":
        assert any(isinstance(e, SequencePreempted) for e in events)
    if config in ("block16", "block1", "chunked"):
        # Sent together, the later prompts wait for the first one's shared prefix blocks to be
        # computed (in-batch prefix sharing) and then hit them.
        assert any(isinstance(e, BlockHit) for e in events)


def test_a_shared_system_prompt_sent_at_once_is_computed_once(root):
    """The batch reaches the infinite-cache bound, computes only its misses, and generates
    what each prompt generates alone (and what transformers generates)."""
    path = model_dir("llama", root)
    prompts = prompts_with_shared_prefix(n=6, prefix_len=40)
    bound = InfiniteCache(8)
    for p in prompts:
        bound.add(p)
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, num_blocks=128)
    stats = RunStats()
    llm.engine.events.subscribe(stats)
    together = llm.generate(prompts, GREEDY)
    report = stats.report(duration=1.0, wall_time=1.0)
    assert report["hit_rate"] >= 0.95 * bound.hit_rate > 0
    assert report["computed_prompt_tokens"] == report["cache_queries"] - report["cache_hits"]
    alone = LLM(path, dtype="float32", device="cpu", block_size=8, num_blocks=128)
    for prompt, out in zip(prompts, together):
        assert out["token_ids"] == alone.generate([prompt], GREEDY)[0]["token_ids"]
        assert out["token_ids"] == hf_greedy(path, tuple(prompt), GREEDY.max_tokens)


def test_second_round_hits_the_prefix_cache_and_stays_exact(root):
    path = model_dir("llama", root)
    prompts = prompts_with_shared_prefix()
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, num_blocks=64)
    first = llm.generate(prompts[:1], GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert second[0]["token_ids"] == first[0]["token_ids"]
    assert all(o["num_cached_tokens"] >= 32 for o in second)  # 37-token prefix, 8-token blocks
    for prompt, out in zip(prompts, second):
        assert out["token_ids"] == hf_greedy(path, tuple(prompt), GREEDY.max_tokens)


def test_text_prompts_and_per_request_params(root):
    llm = LLM(model_dir("llama", root), dtype="float32", device="cpu", block_size=16, num_blocks=32)
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=5, seed=7, ignore_eos=True),
    ]
    outs = llm.generate(["hello world", "the cache"], params)
    assert [len(o["token_ids"]) for o in outs] == [3, 5]
    again = llm.generate(["the cache"], params[1])
    assert again[0]["token_ids"] == outs[1]["token_ids"]  # the seed reproduces
    assert not llm.model_runner.sampler._generators  # finished requests' generators are dropped
    assert isinstance(outs[0]["text"], str)


def test_bad_requests_raise_one_clear_error_each(root, tmp_path):
    path = model_dir("llama", root)
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    weird = tmp_path / "weird"
    make_tiny_model("llama", weird)
    cfg = (weird / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel")
    (weird / "config.json").write_text(cfg)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(weird))
    llm = LLM(path, dtype="float32", device="cpu", block_size=16, num_blocks=4, max_model_len=100)
    with pytest.raises(RequestRejected, match="max_model_len"):
        llm.generate([list(range(3, 98))], SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="KV blocks"):  # 69 tokens > 4 blocks of 16
        llm.generate([[5, 6], list(range(3, 63))], SamplingParams(max_tokens=10, ignore_eos=True))
    # A rejected batch leaves nothing behind: the engine still serves.
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0]["token_ids"]) == 12


def test_default_model_knows_the_capital_of_france():
    llm = LLM(dtype="float32", num_blocks=16, block_size=64)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=4))
    assert "Paris" in out[0]["text"]
    chat = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    reply = llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in reply[0]["text"]


def test_threads_take_turns_and_nested_calls_are_refused(root):
    import threading

    path = model_dir("llama", root)
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, num_blocks=64)
    prompts = prompts_with_shared_prefix(n=3)
    expected = [hf_greedy(path, tuple(p), GREEDY.max_tokens) for p in prompts]
    results: dict[int, list] = {}
    errors = []

    def worker(k: int) -> None:
        try:
            results[k] = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(results[k] == expected for k in range(4))
    stream = llm.stream(prompts, GREEDY)
    next(stream)
    with pytest.raises(RuntimeError, match="still iterating another stream"):
        llm.generate(prompts, GREEDY)
    stream.close()
    assert [o["token_ids"] for o in llm.generate(prompts, GREEDY)] == expected
    llm.engine.block_manager.check_invariants([])
