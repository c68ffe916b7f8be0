"""A model-free executor: the scheduler and block manager run end to end without torch.

Tokens are a deterministic function of the sequence so far, so equal prompts produce equal
answers (as greedy decoding would) and multi-turn prefix reuse behaves as with a model.

Time is virtual. Each step advances the clock by a cost model of one GPU serving a small model:

    step_time = step_overhead + per_token * scheduled_tokens + per_kv_token * attended_kv_tokens

with defaults 5 ms + 20 us per computed token (50k prefill tokens/s) + 0.1 us per KV token read
(see StepCostModel). It is not a performance prediction; it only orders arrivals against
completions, which decides how full the cache is when each request arrives.

With a second tier (``kv_tier``) the tier is a tier of hashes (``SimulatedTier``: no data);
a block holds ``kv_bytes_per_token * block_size`` bytes of it, and a step takes the time its
restores read at the tier's bandwidth on top of the cost above.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig
from ..sequence import Sequence
from ..tiers.books import SimulatedTier
from ..tiers.spec import format_size


@dataclass(frozen=True)
class StepCostModel:
    step_overhead: float = 5e-3  # seconds per step (launches, sampling, scheduling)
    per_token: float = 2e-5  # seconds per computed token (weights' FLOPs)
    per_kv_token: float = 1e-7  # seconds per KV token attended to (cache reads)
    # A second tier's bytes per cached token: the default model's K/V (SmolLM2-135M: 30
    # layers x K and V x 3 heads x 64 dims) in bfloat16, as a GPU holds it.
    kv_bytes_per_token: int = 23_040

    def cost(self, num_tokens: int, num_kv_tokens: int) -> float:
        """Seconds for a step computing ``num_tokens`` that attend to ``num_kv_tokens``."""
        return self.step_overhead + self.per_token * num_tokens + self.per_kv_token * num_kv_tokens


class VirtualClock:
    """Seconds that pass only when told to: by step costs, or by waiting for an arrival."""

    def __init__(self, start: float = 0.0) -> None:
        self.time = start

    def __call__(self) -> float:
        return self.time

    def advance(self, seconds: float) -> None:
        self.time += seconds

    def wait_until(self, t: float) -> None:
        self.time = max(self.time, t)


class DryRunExecutor:
    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int = 49152,
        clock: VirtualClock | None = None,
        cost_model: StepCostModel = StepCostModel(),
    ) -> None:
        if config.num_blocks is None:
            raise ValueError("a dry run has no memory to size its KV cache from: set num_blocks")
        self.num_blocks = config.num_blocks
        self.vocab_size = vocab_size
        self.clock = clock if clock is not None else VirtualClock()
        self.cost_model = cost_model
        self.tier = simulated_tier(config, cost_model)

    def run(self, seqs: list[Sequence]) -> list[int]:
        v = self.vocab_size
        tokens = []
        num_tokens = kv = 0
        for seq in seqs:  # one pass: this runs for every sequence of every dry-run step
            n = seq.num_scheduled_tokens
            num_tokens += n
            kv += seq.num_cached_tokens + n
            # Knuth's multiplicative hash of (last token, length): cheap, deterministic, spread.
            tokens.append(((seq.last_token * 2654435761) ^ (seq.num_tokens * 40503)) % v)
        seconds = self.cost_model.cost(num_tokens, kv)
        if self.tier is not None:
            seconds += self.tier.take_seconds()
        self.clock.advance(seconds)
        return tokens


def simulated_tier(config: EngineConfig, cost_model: StepCostModel) -> SimulatedTier | None:
    """The dry run's second tier ``config.kv_tier`` names (its SIZE over the cost model's
    block bytes; a disk tier's PATH is never touched), or None."""
    spec = config.tier_spec
    if spec is None:
        return None
    block_bytes = cost_model.kv_bytes_per_token * config.block_size
    capacity = spec.size_bytes // block_bytes
    if capacity < 1:
        raise ValueError(
            f"kv_tier {spec}: {format_size(spec.size_bytes)} holds no block of "
            f"{config.block_size} tokens ({block_bytes:,} bytes in a dry run)"
        )
    return SimulatedTier(
        spec.medium, capacity, block_bytes, config.tier_bandwidth(), cost_model.per_token
    )
