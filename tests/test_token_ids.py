"""Token ids are checked when a request is added, before anything is allocated: one
RequestRejected (a ValueError) naming the id, never an IndexError or OverflowError mid-step."""

import pytest
from support.models import make_tiny_model

from nanokv_cli import LLM, SamplingParams
from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.dry_run import DryRunExecutor
from nanokv_cli.engine.core.llm_engine import LLMEngine, RequestRejected

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("token_ids") / "llama")  # vocab 320
    return LLM(str(path), dtype="float32", device="cpu", block_size=8, num_blocks=16)


@pytest.mark.parametrize(
    "bad, message",
    [
        (320, r"token id 320 at position 2 is outside the vocabulary \(320 ids: 0 to 319\)"),
        (-1, r"token id -1 at position 2 is outside the vocabulary \(320 ids"),
        (2**63, rf"token id {2**63} at position 2 is outside the vocabulary"),
        (2**64, rf"token id {2**64} at position 2 is outside the vocabulary"),
        (1.5, r"token id 1.5 at position 2 is not an integer"),
        ("7", r"token id '7' at position 2 is not an integer"),
    ],
)
def test_a_bad_id_is_refused_before_anything_runs(llm, bad, message):
    good = [5, 6, 7]
    expected = llm.generate([good], PARAMS)[0]["token_ids"]
    with pytest.raises(RequestRejected, match=message):
        llm.generate([good, [5, 6, bad]], PARAMS)  # the good one is admitted first
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.block_manager.used_block_ids
    engine.check_invariants()
    assert llm.generate([good], PARAMS)[0]["token_ids"] == expected


def test_the_last_row_of_a_padded_vocabulary_is_a_valid_id(llm):
    assert llm.engine.vocab_size == 320  # the embedding's rows, more than the tokenizer's ids
    assert len(llm.generate([[5, 319]], PARAMS)[0]["token_ids"]) == 3


def test_a_dry_run_takes_any_id_a_trace_records_unless_given_a_vocabulary():
    config = EngineConfig(num_blocks=32, block_size=4)
    engine = LLMEngine(DryRunExecutor(config), config)
    assert engine.vocab_size is None  # nothing to embed
    engine.add_request([10**6, 0, 2**31 - 1])
    # Past int32 a trace cannot record the prompt (and the bound's uint32 map could not
    # hold it): refused when added, not an OverflowError later (issue #49, item 18).
    for bad in (2**31, 2**32, 2**63, -5):
        with pytest.raises(RequestRejected, match="outside the token ids a trace can record"):
            engine.add_request([1, bad])
    engine.vocab_size = 100  # refuse what a model with 100 ids would
    with pytest.raises(RequestRejected, match=r"token id 100 at position 0 .*\(100 ids"):
        engine.add_request([100])
    assert engine.num_waiting == 1
