"""EngineConfig: one default per setting, checked once, and the same object in every part."""

import pickle
from dataclasses import fields, replace

import pytest
from support.models import make_tiny_model

from nanokv_cli import LLM
from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.run.loop import dry_run_engine


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(block_size=0), "block_size must be >= 1, got 0"),
        (dict(num_blocks=0), "num_blocks must be >= 1, got 0"),
        (dict(kv_cache_memory=-1), "kv_cache_memory must be >= 1, got -1"),
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
        (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens must be an integer, got 2.5"),
        (dict(max_model_len=0), "max_model_len must be >= 1, got 0"),
        (dict(tensor_parallel_size=True), "tensor_parallel_size must be an integer, got True"),
        (dict(gpu_memory_utilization=0.0), r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    ],
)
def test_bad_values_are_refused_by_name(settings, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(**settings)
    with pytest.raises(ValueError, match=named):  # a variant is checked as well
        replace(EngineConfig(), **settings)


def test_edge_values_are_accepted_and_the_config_pickles():
    config = EngineConfig(block_size=1, num_blocks=1, gpu_memory_utilization=1.0, dtype="float32")
    # Spawned tensor-parallel ranks receive it pickled.
    assert pickle.loads(pickle.dumps(config)) == config
    assert config.model_len(512) == 512
    assert replace(config, max_model_len=100).model_len(512) == 100
    assert replace(config, max_model_len=1000).model_len(512) == 512


def test_a_dry_run_and_a_model_run_share_the_defaults(tmp_path):
    defaults = EngineConfig()
    dry, _ = dry_run_engine(EngineConfig(num_blocks=8))
    llm = LLM(str(make_tiny_model("llama", tmp_path / "m")), device="cpu", num_blocks=8)
    for engine in (dry, llm.engine):
        assert engine.block_size == defaults.block_size
        assert engine.scheduler.max_num_seqs == defaults.max_num_seqs
        assert engine.scheduler.max_num_batched_tokens == defaults.max_num_batched_tokens
        assert engine.block_manager.enable_prefix_caching == defaults.enable_prefix_caching
    # The model run resolves what depends on the model, and keeps every other setting.
    resolved = llm.engine_config
    assert resolved.max_model_len == llm.max_model_len == llm.config.max_position_embeddings
    assert (
        llm.engine.config is resolved and llm.model_runner.plan.max_model_len == llm.max_model_len
    )
    same = {"max_model_len", "quantization", "num_blocks", "device"}
    for f in fields(EngineConfig):
        if f.name not in same:
            assert getattr(resolved, f.name) == getattr(defaults, f.name), f.name


def test_keywords_override_a_given_config(tmp_path):
    path = str(make_tiny_model("llama", tmp_path / "m"))
    base = EngineConfig(device="cpu", block_size=8, num_blocks=16, max_model_len=64)
    llm = LLM(path, config=base, block_size=4)
    assert llm.engine.block_size == llm.model_runner.block_size == 4
    assert llm.model_runner.num_blocks == llm.engine.num_blocks == 16
    assert llm.max_model_len == llm.engine.scheduler.max_model_len == 64
    with pytest.raises(TypeError, match="no_such_setting"):
        LLM(path, config=base, no_such_setting=1)


def test_a_dry_run_needs_a_cache_size():
    with pytest.raises(ValueError, match="num_blocks"):
        dry_run_engine(EngineConfig())
