"""nanokv: run LLMs on a paged KV cache with prefix caching, and watch the cache work."""

from .engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; keep `import nanokv_cli` (and --dry-run) free of it until needed.
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "EngineConfig":
        from .engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
