"""The errors of loading a model, shared by the Hugging Face and GGUF readers."""

from __future__ import annotations

from ..config import UnsupportedModelError


class ModelLoadError(Exception):
    """A model path the user gave cannot be loaded; the message says which path and why."""


class UnsupportedArchitectureError(ModelLoadError, UnsupportedModelError):
    """The model is well formed but of an architecture nanokv cannot run."""
