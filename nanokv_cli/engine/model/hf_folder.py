"""A Hugging Face model folder: config.json, generation_config.json, the tokenizer files and
safetensors weights (one file, shards with an index, or shards to scan), memory-mapped.

Pickled PyTorch weights (`.bin`, `.pt`) are refused: unpickling can run arbitrary code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .loaded_model import LoadedModel, merge_eos_ids, model_config, tokenizer_errors
from .model_errors import ModelLoadError
from .tokenizer import Tokenizer
from .weight_names import check_weights, expected_shapes

# torch is imported only where weights are read, so tokenizer-only users (dry runs) stay light.
if TYPE_CHECKING:
    import torch

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def load_hf_folder(folder: Path) -> LoadedModel:
    """The model in `folder`: config, tokenizer and memory-mapped weights, all checked."""
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
    config = model_config(hf_config, folder)
    with tokenizer_errors(folder):
        tokenizer = Tokenizer.from_hf_folder(folder)
    merge_eos_ids(config, tokenizer, _generation_eos_ids(folder))
    weights = _read_safetensors_folder(folder, expected_shapes(config))
    return LoadedModel(config, weights, tokenizer, source=str(folder))


def folder_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer `load_hf_folder` gives, with its EOS ids, without reading weights."""
    with tokenizer_errors(folder):
        tokenizer = Tokenizer.from_hf_folder(folder)
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


def _read_json_file(path: Path, what: str | None) -> dict[str, Any]:
    """Parse a JSON object; a missing file is an error when `what` names it, else empty."""
    if not path.is_file():
        if what is None:
            return {}
        raise ModelLoadError(f"{path.parent} is not a Hugging Face model folder: it has no {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:  # a bracket nest deeper than the parser's stack
        raise ModelLoadError(f"{path} is not valid JSON (nested too deeply)") from None
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
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
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
    check_weights(weights, shapes, folder)
    return weights


def _safetensors_names(file: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{file} is corrupt or truncated ({exc})") from exc
