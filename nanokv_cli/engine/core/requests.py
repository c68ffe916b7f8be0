"""The requests a run is fed: prompt, sampling and arrival time, and ways to re-time them.

``driver.Driver`` is the one loop that admits them into an engine, for every command, the
benchmarks and the tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..sampling_params import SamplingParams


@dataclass
class Request:
    # A list, or a callable that makes it: big traces synthesize tokens only when admitted.
    prompt_token_ids: list[int] | Callable[[], list[int]]
    sampling_params: SamplingParams
    arrival_time: float = 0.0  # seconds after the replay starts
    tag: object = None  # the caller's handle (line number, original prompt...)

    def tokens(self) -> list[int]:
        p = self.prompt_token_ids
        return p() if callable(p) else p


def at_rate(requests: Iterable[Request], rate: float, seed: int = 0) -> Iterator[Request]:
    """Re-time requests as a Poisson process of ``rate`` requests per second."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    t = 0.0
    for req in requests:
        yield Request(req.prompt_token_ids, req.sampling_params, t, req.tag)
        t += rng.expovariate(rate)


def all_at_once(requests: Iterable[Request]) -> Iterator[Request]:
    for req in requests:
        yield Request(req.prompt_token_ids, req.sampling_params, 0.0, req.tag)
