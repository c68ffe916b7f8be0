"""What loading a model gives (`LoadedModel`), and the checks both readers share: the config
validated with errors that name the key, the tokenizer built, EOS ids merged."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import ModelConfig, ModelConfigError, UnsupportedModelError, check_special_ids
from .gguf_file import QuantizedTensor
from .model_errors import ModelLoadError, UnsupportedArchitectureError
from .tokenizer import Tokenizer, TokenizerError
from .weight_names import gguf_key

# torch is imported only where weights are read, so tokenizer-only users (dry runs) stay light.
if TYPE_CHECKING:
    import torch


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


def model_config(
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
            name = f"GGUF metadata {gguf_key(gguf_arch, exc.field)} ({exc.field})"
        raise ModelLoadError(f"{where}: {exc.named(name)}") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"{where}: config.json is missing or has a bad value for {exc}"
        ) from exc


@contextmanager
def tokenizer_errors(where: Path) -> Iterator[None]:
    """A TokenizerError inside reported as a ModelLoadError naming `where`."""
    try:
        yield
    except TokenizerError as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc


def merge_eos_ids(config: ModelConfig, tokenizer: Tokenizer, generation_eos: list[int]) -> None:
    """Give config and tokenizer the same EOS ids: config's, generation_config's, tokenizer's."""
    # Any of these ends generation; transformers' generate() uses generation_config's list.
    merged = [*config.eos_token_ids, *generation_eos, *tokenizer.eos_token_ids]
    try:
        check_special_ids(merged, config.vocab_size)
    except ModelConfigError as exc:
        raise ModelLoadError(f"the model's EOS ids: {exc.named('eos_token_id')}") from None
    config.eos_token_ids = list(dict.fromkeys(merged))
    tokenizer.eos_token_ids = list(config.eos_token_ids)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
