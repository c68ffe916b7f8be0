"""Model definitions and Hugging Face weight loading."""

import torch
from torch import nn

from ..config import ModelConfig
from .llama import DecoderForCausalLM

# ModelConfig.architecture -> model class. All current families share one implementation.
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": DecoderForCausalLM,
    "qwen2": DecoderForCausalLM,
    "qwen3": DecoderForCausalLM,
}


def build_model(config: ModelConfig, max_position: int) -> nn.Module:
    """Instantiate (uninitialised) the model for ``config``; RoPE tables cover ``max_position``."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(f"no model implementation for architecture {config.architecture!r}")
    return cls(config, max_position)


def hf_weight_names(model: nn.Module) -> list[str]:
    """The Hugging Face tensor names ``model`` needs, in parameter order."""
    unpacked: dict[str, list[str]] = {}
    for hf_name, (ours, _) in model.packed_modules_mapping.items():
        unpacked.setdefault(ours, []).append(hf_name)
    names = []
    for name, _ in model.named_parameters():  # tied parameters are listed once
        module = name.split(".")[-2]
        if module in unpacked:
            names += [name.replace(f".{module}.", f".{hf}.") for hf in unpacked[module]]
        else:
            names.append(name)
    return names


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy Hugging Face-named ``weights`` into ``model`` (each rank takes its shard).

    Raises ValueError naming the first missing tensor, or a tensor of the wrong shape.
    Tensors the model does not use (e.g. a tied ``lm_head.weight``) are ignored.
    """
    expected = hf_weight_names(model)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"model weights are missing tensor {missing[0]!r}{more}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for hf_name in expected:
            name, shard_id = _our_name(model, hf_name)
            param = params[name]
            try:
                if shard_id is None:
                    param.weight_loader(param, weights[hf_name])
                else:
                    param.weight_loader(param, weights[hf_name], shard_id)
            except ValueError as e:
                raise ValueError(f"model weight {hf_name!r}: {e}") from None


def _our_name(model: nn.Module, hf_name: str) -> tuple[str, str | int | None]:
    module = hf_name.split(".")[-2]
    packed = model.packed_modules_mapping.get(module)
    if packed is None:
        return hf_name, None
    ours, shard_id = packed
    return hf_name.replace(f".{module}.", f".{ours}."), shard_id
