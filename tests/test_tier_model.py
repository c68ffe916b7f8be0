"""The second KV tier with a model (issue 46): evicted blocks written to a disk tier and read
back into the cache give the tokens recomputing gives; the tier survives a restart; a damaged
file, another model or block size is a miss, never wrong K/V; an unusable path is one note
and a run without the tier."""

import random
import warnings

import pytest
from support.models import make_tiny_model

from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.engine.tiers.model_tier import KVTierWarning
from nanokv_cli.llm import LLM

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PREFIX = 1000


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """A tiny random Llama with room for 2,048 positions, and a second of the same shape."""
    root = tmp_path_factory.mktemp("tier-models")
    first = make_tiny_model("llama", root / "a", max_position_embeddings=2048)
    other = make_tiny_model("llama", root / "b", seed=7, max_position_embeddings=2048)
    return first, other


def prompts(seed: int, n: int = 3, length: int = PREFIX + 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length)] for _ in range(n)]


def llm(model, tier, **settings) -> LLM:
    settings = {"block_size": 64, "num_blocks": 24, **settings}
    return LLM(str(model), kv_tier=f"disk:{tier}:64MiB", **settings)


def answer(engine: LLM, prompt: list[int]) -> dict:
    return engine.generate([prompt], GREEDY)[0]


def fill(engine: LLM, prompt: list[int]) -> list[int]:
    """Run ``prompt``, then two other prompts that evict all of it from the 24-block cache;
    its tokens."""
    tokens = answer(engine, prompt)["token_ids"]
    for other in prompts(99, 2):
        answer(engine, other)
    return tokens


def test_a_restart_finds_the_blocks_stored_before(tiny_long, tmp_path):
    """Done-when (c): a second engine on the same tier path."""
    model, _ = tiny_long
    (prompt,) = prompts(1, 1)
    first = llm(model, tmp_path)
    want = fill(first, prompt)
    assert first.engine.tier.num_blocks >= PREFIX // 64
    first.shutdown()
    second = llm(model, tmp_path)
    assert "kept from before" in second.kv_tier_note
    got = answer(second, prompt)
    assert got["num_cached_tokens"] >= 960 and got["token_ids"] == want
    assert second.engine.block_manager.stats.restored_hits >= 960
    second.shutdown()


def test_a_second_engine_on_a_tier_in_use_runs_without_it(tiny_long, tmp_path):
    model, _ = tiny_long
    first = llm(model, tmp_path)
    with pytest.warns(KVTierWarning, match="in use by process"):
        second = llm(model, tmp_path)
    assert second.engine.tier is None and "running without it" in second.kv_tier_note
    (prompt,) = prompts(2, 1, 100)
    assert answer(second, prompt)["token_ids"] == answer(first, prompt)["token_ids"]
    first.shutdown()


def test_an_unusable_path_is_one_note_and_the_run_goes_on(tiny_long, tmp_path):
    model, _ = tiny_long
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = llm(model, blocker / "tier")
    notes = [w for w in caught if w.category is KVTierWarning]
    assert len(notes) == 1 and "Not a directory" in str(notes[0].message)
    assert engine.engine.tier is None
    (prompt,) = prompts(3, 1, 100)
    assert len(answer(engine, prompt)["token_ids"]) == GREEDY.max_tokens


def test_a_host_tier_on_cpu_is_refused_before_loading(tiny_long):
    with pytest.raises(ValueError, match="on CPU the KV cache is in that memory already"):
        LLM(str(tiny_long[0]), kv_tier="host:1GiB", device="cpu")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_tier_file_is_a_miss_never_wrong_kv(tiny_long, tmp_path, damage):
    model, _ = tiny_long
    (prompt,) = prompts(4, 1)
    first = llm(model, tmp_path)
    want = fill(first, prompt)
    first.shutdown()
    (data,) = tmp_path.glob("*.kvtier")
    size = data.stat().st_size
    with open(data, "r+b") as f:
        if damage == "truncate":
            f.truncate(size // 3)
        else:  # a byte in every 64 KiB: payloads and entry headers alike
            for at in range(4096, size, 65536):
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0xFF]))
    second = llm(model, tmp_path)
    got = answer(second, prompt)
    assert got["token_ids"] == want
    assert got["num_cached_tokens"] < 960  # what was damaged was recomputed
    second.shutdown()


def test_another_model_or_block_size_finds_nothing(tiny_long, tmp_path):
    model, other = tiny_long
    (prompt,) = prompts(5, 1)
    first = llm(model, tmp_path)
    fill(first, prompt)
    first.shutdown()
    for engine in (llm(other, tmp_path), llm(model, tmp_path, block_size=32, num_blocks=48)):
        assert engine.engine.tier.num_blocks == 0
        assert answer(engine, prompt)["num_cached_tokens"] == 0
        engine.shutdown()
    assert len(list(tmp_path.glob("*.kvtier"))) == 3  # one file per fingerprint


def test_the_default_model_restores_an_evicted_conversation_prefix(tmp_path):
    """Done-when (b), the functional part (scripts/bench/tier_ttft.py times it): a conversation's
    ~2,000-token prefix, evicted to a disk tier by two others, comes back restored, and turn
    two's greedy tokens are those of an engine whose cache never evicted."""
    small = LLM(block_size=64, num_blocks=40, kv_tier=f"disk:{tmp_path}:256MiB", threads=2)
    system = "You are a patient tutor. " + " ".join(
        f"Fact {i}: block {i} of a paged cache holds 64 tokens of keys and values."
        for i in range(80)
    )
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Summarize."}]
    first = small.generate([small.chat_prompt(turn1)], GREEDY)[0]
    prefix = len(small.chat_prompt(turn1))
    assert 1800 <= prefix <= 2600
    for topic in ("gardening", "sailing"):
        other = [{"role": "user", "content": f"Tell me about {topic}. " * 250}]
        small.generate([small.chat_prompt(other)], GREEDY)
    turn2 = [*turn1, {"role": "assistant", "content": first["text"]},
             {"role": "user", "content": "And in one word?"}]  # fmt: skip
    again = small.generate([small.chat_prompt(turn2)], GREEDY)[0]
    assert again["num_cached_tokens"] >= prefix - 64
    assert small.engine.block_manager.stats.restored_hits >= prefix - 64
    big = LLM(block_size=64, num_blocks=200, threads=2)
    assert again["token_ids"] == big.generate([big.chat_prompt(turn2)], GREEDY)[0]["token_ids"]
    small.shutdown()
