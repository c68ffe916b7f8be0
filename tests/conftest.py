"""Fixtures shared by test modules."""

import pytest


@pytest.fixture(scope="session")
def default_model_folder(tmp_path_factory):
    """The default GGUF model written out as a float32 Hugging Face folder (~540 MB, once per
    session), for transformers and for loading the same weights from safetensors."""
    from nanokv_cli.engine.loader import export_hf_folder

    return export_hf_folder(None, tmp_path_factory.mktemp("default-model-hf"))
