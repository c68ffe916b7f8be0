"""Fixtures shared by test modules. The helpers they build on are in ``tests/support/``."""

import pytest


@pytest.fixture(scope="session")
def default_model_folder(tmp_path_factory):
    """The default GGUF model written out as a float32 Hugging Face folder (~540 MB, once per
    session), for transformers and for loading the same weights from safetensors."""
    from nanokv_cli.engine.model.loader import export_hf_folder

    return export_hf_folder(None, tmp_path_factory.mktemp("default-model-hf"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama folder (support/models.py), built once per test module."""
    from support.models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A model folder holding only a tokenizer: enough for dry runs and inspect."""
    from support.models import make_tokenizer_files

    return make_tokenizer_files(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    """``tiny_weights(name, arch=name, **config)``: a tiny model's ModelConfig, weights and
    folder, as a runner takes them (support/models.py); each name built once per module."""
    from support.models import make_tiny_model, read_model

    root = tmp_path_factory.mktemp("tiny")
    built = {}

    def get(name: str, arch: str | None = None, **config):
        if name not in built:
            built[name] = read_model(make_tiny_model(arch or name, root / name, **config))
        return built[name]

    return get


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module's tests (``pytestmark =
    pytest.mark.usefixtures("one_thread")``): tiny models gain nothing from threads, and on a
    busy shared machine every parallel op waits for a descheduled worker thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
