"""Feed requests to an engine as they arrive: by timestamp, at a rate, or all at once."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from .llm_engine import LLMEngine, RequestOutput
from .mooncake import SynthesizedPrompt
from .sampling_params import SamplingParams
from .scheduler import RequestRejected


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


class WallClock:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start

    def wait_until(self, t: float) -> None:
        delay = t - self()
        if delay > 0:
            time.sleep(delay)


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


def replay(
    engine: LLMEngine,
    requests: Iterable[Request],
    clock,
    *,
    max_waiting: int | None = None,
    on_added: Callable[[int, Request], None] | None = None,
    on_rejected: Callable[[Request, RequestRejected], None] | None = None,
) -> Iterator[list[RequestOutput]]:
    """Drive ``engine`` until every request has finished, yielding each step's outputs.

    ``clock`` must be the engine's clock and offer ``wait_until(t)`` (WallClock sleeps, the dry
    run's VirtualClock jumps). Arrived requests beyond ``max_waiting`` (default: twice the
    engine's batch limit) wait here, not in the engine: under first-come-first-served the
    scheduler never looks past that many, and it keeps a long trace's tokens out of memory.
    Their arrival time is kept, so their queueing still shows in time to first token.
    """
    if max_waiting is None:
        max_waiting = 2 * engine.scheduler.max_num_seqs
    pending = iter(requests)
    nxt = next(pending, None)
    last_arrival = float("-inf")
    while True:
        now = clock()
        while nxt is not None and nxt.arrival_time <= now and engine.num_waiting < max_waiting:
            if nxt.arrival_time < last_arrival:
                raise ValueError("requests must come in order of arrival time")
            last_arrival = nxt.arrival_time
            source = nxt.prompt_token_ids
            recipe = source.recipe() if isinstance(source, SynthesizedPrompt) else None
            try:
                seq_id = engine.add_request(
                    nxt.tokens(), nxt.sampling_params, nxt.arrival_time, prompt_recipe=recipe
                )
            except RequestRejected as e:
                if on_rejected is None:
                    raise
                on_rejected(nxt, e)
            else:
                if on_added is not None:
                    on_added(seq_id, nxt)
            nxt = next(pending, None)
        if engine.has_unfinished_requests():
            yield engine.step()
        elif nxt is not None:
            clock.wait_until(nxt.arrival_time)
        else:
            return
