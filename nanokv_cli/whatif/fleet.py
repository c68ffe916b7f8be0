"""Fleet what-if: N dry-run engines behind a router, on one shared virtual timeline.

``replay --dry-run --instances N --router POLICY`` replays a trace through N instances of the
dry run (the same ``LLMEngine`` on the model-free executor as a plain dry run, one
``VirtualClock`` each) and asks how much prefix-cache reuse a routing policy keeps.

**Time.** The instances share one timeline: at every turn the earliest thing happens next,
either the next request's arrival (at its trace timestamp) or the step of the instance whose
clock is furthest behind. An instance's step is atomic: what it changes (the blocks it stored
or evicted, the first tokens and finished requests it produced) reaches the router only when
the step ends on that instance's clock, as a KV-event stream and response stream would.

**What the router knows** at an arrival, and nothing more: for each instance, the requests it
sent there that have not finished (count, prompt tokens, blocks, and which are still in
prefill: the first token ends it), and, for ``prefix``, the hashes the instance announced
through its ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, as a
KV-event-fed indexer keeps them (the engine's books are not read).

**Policies** (ties go to the first tied instance after the last one chosen, so idle
instances take turns):

* ``round-robin``: request k goes to instance k mod N (Dynamo's default router mode).
* ``least-loaded``: fewest unfinished requests, then fewest of their prompt tokens.
* ``prefix``: Dynamo's KV router cost, lowest wins::

      cost(i) = w * prefill_blocks(i) + decode_blocks(i)
      prefill_blocks(i) = (prompt tokens still to prefill on i
                           + prompt tokens - overlap(i) * block_size) / block_size
      decode_blocks(i)  = blocks of the requests unfinished on i + blocks of this prompt

  ``overlap(i)``: how many of the prompt's leading full blocks instance ``i`` holds (the
  longest run of its chained hashes in i's index); ``w`` = ``OVERLAP_SCORE_WEIGHT`` = 1.0,
  Dynamo's default ``overlap_score_weight``. A request's prefill is the overlap-adjusted
  count at routing time, dropped at its first token.

**elsewhere**: of the tokens a first admission missed, those that the longest cached prefix
on some other instance covered at that moment (read from the other instances' BlockManagers,
their public ``hash_to_block_id``, to within one step of theirs; the block holding the
prompt's last token never counts, as in the engine). It is split by the engine's own miss
reason for the same tokens. The run, the one-cache bound and the report: fleet_report.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..engine.block_manager import BlockManager
from ..engine.config import EngineConfig
from ..engine.core.blocks import hash_block_tokens
from ..engine.core.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheLookup
from ..engine.core.scheduler import RequestRejected
from ..run.loop import Driver, Request, dry_run_engine
from ..run.record import Run

RouterName = Literal["round-robin", "least-loaded", "prefix"]
ROUTERS: tuple[str, ...] = get_args(RouterName)
DEFAULT_ROUTER = "round-robin"
OVERLAP_SCORE_WEIGHT = 1.0  # Dynamo's default --router-kv-overlap-score-weight


@dataclass(eq=False)
class RoutedRequest(Request):
    """A request as the router sent it (its source's tokens, or their recipe), and what the
    router counts for it."""

    source: Request | None = None  # the trace's request
    hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    num_tokens: int = 0
    num_blocks: int = 0  # KV blocks its prompt takes (decode load)
    prefill_tokens: int = 0  # tokens the router expects it to compute there
    prefilling: bool = True  # until its first token reaches the router


def block_hashes(tokens, block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``, as the engine's prefix cache keys them."""
    hashes: list[int] = []
    prefix = -1
    for i in range(len(tokens) // block_size):
        prefix = hash_block_tokens(tokens[i * block_size : (i + 1) * block_size], prefix)
        hashes.append(prefix)
    return hashes


class Instance:
    """One dry-run engine of the fleet, its queue of routed requests, and the router's view of
    it (unfinished requests and load; the hashes its KV events announced)."""

    def __init__(self, index: int, config: EngineConfig, fleet: Fleet) -> None:
        self.index = index
        self.fleet = fleet
        self.engine, self.clock = dry_run_engine(config)
        self.block_size = config.block_size
        self.queue: deque[RoutedRequest] = deque()  # routed, not yet in the engine
        self.driver = Driver(
            self.engine, self.clock, on_added=self._added, on_rejected=self._rejected
        )
        self.run: Run | None = None
        self.routed = 0
        self.rejected = 0
        # The router's view: unfinished requests it sent here and their load.
        self.by_seq: dict[int, RoutedRequest] = {}
        self.requests = 0
        self.tokens = 0
        self.blocks = 0
        self.prefill_tokens = 0
        self.index_hashes: set[int] = set()  # what a KV-event indexer holds for this instance
        # What the step in flight changed, for the router once it ends (at ``_until``).
        self._events: list = []
        self._outputs: list[tuple[int, bool]] = []  # (seq_id, finished)
        self._until = float("inf")
        self.elsewhere = 0
        self.elsewhere_by_reason: dict[str, int] = {}
        self.engine.events.subscribe(self._on_event)

    # -- the request source Driver.admit polls -------------------------------------------------

    def poll(self, now: float) -> tuple[Request, float] | None:
        if self.queue and self.queue[0].arrival_time <= now:
            req = self.queue.popleft()
            return req, req.arrival_time
        return None

    def wait(self, clock) -> bool:  # Driver.admit never waits; the fleet moves time
        return False

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.engine.has_unfinished_requests()

    # -- routing and stepping ------------------------------------------------------------------

    def accept(self, req: RoutedRequest) -> None:
        """The router sends ``req`` here at its arrival time."""
        self.clock.wait_until(req.arrival_time)  # an idle instance's clock catches up
        self.queue.append(req)
        self.routed += 1
        self.requests += 1
        self.tokens += req.num_tokens
        self.blocks += req.num_blocks
        self.prefill_tokens += req.prefill_tokens

    def step(self) -> int:
        """Admit what has arrived and run one engine step; how many requests finished."""
        self.deliver(float("inf"))  # the last step ended: this one starts at its end
        self.driver.admit(self)
        if not self.engine.has_unfinished_requests():
            return 0  # every queued request was rejected
        outputs = self.engine.step()
        if self.run is not None:
            self.run.observe(outputs)  # the infinite-cache bound learns what finished
        requests = self.driver.requests
        finished = 0
        for out in outputs:
            if out.finished:
                requests.pop(out.seq_id, None)  # as Driver.run forgets them
                finished += 1
            self._outputs.append((out.seq_id, out.finished))
        self._until = self.clock()
        return finished

    def deliver(self, now: float) -> None:
        """The router learns what the last step changed, if it has ended by ``now``."""
        if self._until > now:
            return
        index = self.index_hashes
        for event in self._events:
            t = type(event)
            if t is BlockStored:
                index.add(event.block_hash)
            elif t is BlockRemoved:
                index.discard(event.block_hash)
            else:
                index.clear()
        for seq_id, finished in self._outputs:
            req = self.by_seq.get(seq_id)
            if req is None:
                continue
            if req.prefilling:  # its first token: the prefill is done
                self._end_prefill(req)
            if finished:
                del self.by_seq[seq_id]
                self._forget(req)
        self._events.clear()
        self._outputs.clear()
        self._until = float("inf")

    def _end_prefill(self, req: RoutedRequest) -> None:
        req.prefilling = False
        self.prefill_tokens -= req.prefill_tokens

    def _forget(self, req: RoutedRequest) -> None:
        self.requests -= 1
        self.tokens -= req.num_tokens
        self.blocks -= req.num_blocks

    def _added(self, seq_id: int, req: RoutedRequest) -> None:
        self.by_seq[seq_id] = req
        if self.run is not None:
            self.run.tag(seq_id, line=req.tag)

    def _rejected(self, req: RoutedRequest, error: RequestRejected) -> None:
        # The router hears of it at once (an error response), and forgets the request.
        self.rejected += 1
        self._end_prefill(req)
        self._forget(req)
        self.fleet.reject(req, error)

    def overlap(self, hashes: list[int]) -> int:
        """Leading full blocks of a prompt this instance's index holds."""
        index = self.index_hashes
        n = 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    # -- events --------------------------------------------------------------------------------

    def _on_event(self, event) -> None:
        t = type(event)
        if t is BlockStored or t is BlockRemoved or t is AllBlocksCleared:
            self._events.append(event)
        elif t is CacheLookup and event.first and event.num_hit_tokens < event.num_tokens:
            self._classify_miss(event)

    def _classify_miss(self, event: CacheLookup) -> None:
        """Count the missed tokens the longest cached prefix on another instance covers now."""
        req = self.by_seq.get(event.seq_id)
        if req is None or not req.hashes:
            return
        bs = self.block_size
        # The block holding the prompt's last token is always computed, in any engine.
        limit = min(len(req.hashes), (event.num_tokens - 1) // bs)
        if limit * bs <= event.num_hit_tokens:
            return
        best = 0
        for other in self.fleet.instances:
            if other is not self:
                best = max(best, _cached_prefix(other.engine.block_manager, req.hashes, limit))
        extra = best * bs - event.num_hit_tokens
        if extra > 0:
            self.elsewhere += extra
            by_reason = self.elsewhere_by_reason
            by_reason[event.reason] = by_reason.get(event.reason, 0) + extra


def _cached_prefix(block_manager: BlockManager, hashes: list[int], limit: int) -> int:
    """How many of the first ``limit`` blocks ``block_manager`` holds (free ones included),
    read from its public books only."""
    cached = block_manager.hash_to_block_id
    n = 0
    while n < limit and hashes[n] in cached:
        n += 1
    return n


class Fleet:
    """N dry-run instances behind one routing policy."""

    def __init__(
        self,
        config: EngineConfig,
        instances: int,
        router: str = DEFAULT_ROUTER,
        overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
        on_rejected: Callable[[Request, Exception], None] | None = None,
    ) -> None:
        if instances < 1:
            raise ValueError(f"need at least 1 instance, got {instances}")
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}: choose from {', '.join(ROUTERS)}")
        self.config = config
        self.router = router
        self.weight = overlap_score_weight
        self.on_rejected = on_rejected
        self.instances = [Instance(i, config, self) for i in range(instances)]
        self.rejected: list[Request] = []  # the trace's requests no instance admitted
        self.first_rejection: str | None = None
        self._next = 0  # where ties start: the instance after the last one chosen
        # Hashes feed the prefix router and the ``elsewhere`` count; one instance needs
        # neither, nor its requests' lengths (there is nothing to route).
        self._hashing = instances > 1

    # -- routing -------------------------------------------------------------------------------

    def route(self, source: Request) -> None:
        """Send one arrived request to the instance the policy picks.

        The request keeps its source's tokens, or the recipe that makes them: a routed request
        may wait long for admission, and a synthesized prompt made early would wait in memory.
        With several instances the router needs the prompt's hashes and length now, so its
        tokens are also made here, once, and dropped."""
        bs = self.config.block_size
        hashes: list[int] = []
        num_tokens = 0
        if self._hashing:
            try:
                tokens = source.tokens()
            except RequestRejected as e:  # refused before its tokens were made
                self.reject(source, e)
                return
            hashes, num_tokens = block_hashes(tokens, bs), len(tokens)
            del tokens
        req = RoutedRequest(
            source.prompt_token_ids,
            source.sampling_params,
            source.arrival_time,
            source.tag,
            source=source,
            hashes=hashes,
            num_tokens=num_tokens,
            num_blocks=-(-num_tokens // bs),
        )
        for inst in self.instances:
            inst.deliver(req.arrival_time)
        i, overlap = self._choose(req)
        req.prefill_tokens = max(0, req.num_tokens - overlap * bs)
        self._next = (i + 1) % len(self.instances)
        self.instances[i].accept(req)

    def _choose(self, req: RoutedRequest) -> tuple[int, int]:
        """The instance for ``req`` and the overlap the router counted there."""
        instances = self.instances
        if self.router == "round-robin":
            return self._next, 0
        if self.router == "least-loaded":
            return _first_lowest([(x.requests, x.tokens) for x in instances], self._next), 0
        bs = self.config.block_size
        overlaps = [x.overlap(req.hashes) for x in instances]
        costs = [
            self.weight * (x.prefill_tokens + max(0, req.num_tokens - o * bs)) / bs
            + x.blocks
            + req.num_blocks
            for x, o in zip(instances, overlaps)
        ]
        i = _first_lowest(costs, self._next)
        return i, overlaps[i]

    def reject(self, req: Request, error: Exception) -> None:
        source = req.source if isinstance(req, RoutedRequest) else req
        self.rejected.append(source)
        if self.first_rejection is None:
            self.first_rejection = f"line {source.tag}: {error}"
        if self.on_rejected is not None:
            self.on_rejected(source, error)

    # -- the shared timeline -------------------------------------------------------------------

    def run(
        self, requests: Iterable[Request], on_progress: Callable[[int], None] | None = None
    ) -> None:
        """Replay ``requests`` (in arrival order) to the end: arrivals and steps in time order,
        an arrival before a step that starts at the same time (as Driver admits first)."""
        pending = iter(requests)
        nxt = next(pending, None)
        last = float("-inf")
        done = 0
        instances = self.instances
        while True:
            first, start = None, float("inf")  # the busy instance whose clock is furthest behind
            for x in instances:
                if x.clock.time < start and x.busy:
                    first, start = x, x.clock.time
            if nxt is not None and nxt.arrival_time <= start:
                if nxt.arrival_time < last:
                    raise ValueError("requests must come in order of arrival time")
                last = nxt.arrival_time
                self.route(nxt)
                nxt = next(pending, None)
            elif first is not None:
                finished = first.step()
                if finished and on_progress is not None:
                    done += finished
                    on_progress(done)
            else:
                return


def _first_lowest(costs: list, start: int) -> int:
    """Index of the lowest cost; of several, the first at or after ``start`` (cyclically)."""
    best = min(costs)
    n = len(costs)
    for k in range(n):
        i = (start + k) % n
        if costs[i] == best:
            return i
    raise AssertionError("unreachable")
