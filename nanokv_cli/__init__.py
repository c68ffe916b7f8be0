"""nanokv: run LLMs on a paged KV cache with prefix caching, and watch the cache work."""

import os

# torch's OpenMP threads (libgomp) spin while they wait for work, by default for ~300k
# iterations: beside another busy process a spinning thread holds the core the descheduled one
# it waits for needs. A short spin (20k iterations, tens of microseconds) keeps torch's quiet
# speed and costs less beside a competitor (scripts/BENCHMARKS.md). libgomp reads it only when
# it loads, so it is set here, before anything imports torch; a user's own setting wins. (The C
# kernels run on their own pool, engine/cpu/csrc/pool.c, which needs no setting.)
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from .engine.sampling_params import SamplingParams
from .version import __version__

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
