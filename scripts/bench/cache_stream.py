"""What serve's cache stream (``GET /v1/nanokv/events``, cache_stream.py) costs the engine thread.

A dry run of Mooncake requests (the model-free engine: ~2 us per block event, so the stream's
per-event work is as visible as it gets), replayed twice per round in one process: with the
run statistics serve always keeps (the baseline), and with the stream's ``CacheRecorder``
subscribed as well. The loop side (``CacheStream.tick``, on serve's event-loop thread: it
applies the steps) runs every 0.1 s of the engine's clock, as serve's does (the dry run's clock
is virtual: a step takes what its cost model says, 5 ms and up), timed on its own and left out
of the engine thread's figure. ``--tick-every N`` ticks every N steps instead (the steps wait
that long, alive, for the loop: the garbage collector then costs the engine thread more).

Prints CPU seconds per mode (median of the rounds), the added microseconds per engine step and
per event, the paired ratio, and the drain's own cost per step.

    python scripts/bench/cache_stream.py [--limit 200] [--repeat 5] [--block-size 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import TRACE  # noqa: E402

from nanokv_cli.engine.config import EngineConfig  # noqa: E402
from nanokv_cli.engine.sampling_params import SamplingParams  # noqa: E402
from nanokv_cli.run.encode import PromptEncoder, build_requests  # noqa: E402
from nanokv_cli.run.loop import Arrivals, Driver, dry_run_engine  # noqa: E402
from nanokv_cli.run.stats import RunStats  # noqa: E402
from nanokv_cli.serve.cache_stream import CacheRecorder, CacheStream  # noqa: E402
from nanokv_cli.workload.prompts import read_prompts  # noqa: E402

TICK_S = 0.1  # serve's CacheStream.interval, on the engine's (here virtual) clock


class NoWait:
    def __init__(self, engine) -> None:
        self.engine = engine

    def __call__(self) -> float:
        return self.engine.clock

    def wait_until(self, t: float) -> None:
        pass


def run(
    config: EngineConfig, requests: list, stream_on: bool, every: int | None
) -> dict[str, float]:
    """One replay: CPU seconds of the engine's thread, steps, events, drain seconds."""
    engine, _ = dry_run_engine(config)
    engine.events.subscribe(RunStats())
    stream = None
    if stream_on:
        recorder = CacheRecorder(engine.num_blocks)
        engine.events.subscribe(recorder.listener)
        stream = CacheStream(recorder, {"block_size": config.block_size}, lambda: engine.clock)
    drain = 0.0
    steps = 0
    last = 0.0
    t0 = time.process_time()
    for _ in Driver(engine, NoWait(engine)).run(Arrivals(requests)):
        steps += 1
        if stream is not None:
            recorder.step_ended()  # as serve's engine loop calls it, after each step
        due = steps % every == 0 if every else engine.clock - last >= TICK_S
        if stream is not None and due:
            last = engine.clock
            d0 = time.process_time()
            stream.tick()
            drain += time.process_time() - d0
    elapsed = time.process_time() - t0 - drain
    if stream is not None:
        d0 = time.process_time()
        stream.tick()
        drain += time.process_time() - d0
    return {"cpu": elapsed, "steps": steps, "drain": drain}


def count_events(config: EngineConfig, requests: list) -> int:
    engine, _ = dry_run_engine(config)
    n = [0]

    def listener(_event) -> None:
        n[0] += 1

    engine.events.subscribe(listener)
    for _ in Driver(engine, NoWait(engine)).run(Arrivals(requests)):
        pass
    return n[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--tick-every", type=int, help="steps between ticks [default: 0.1 s]")
    args = parser.parse_args()

    pf = read_prompts(args.trace, limit=args.limit)
    requests = build_requests(pf, PromptEncoder(None, False), SamplingParams(), rate=None)
    config = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks)
    events = count_events(config, requests)
    base, with_stream = [], []
    for _ in range(args.repeat):  # interleaved: drift in the machine's load hits both alike
        base.append(run(config, requests, False, args.tick_every))
        with_stream.append(run(config, requests, True, args.tick_every))
    steps = base[0]["steps"]
    b = statistics.median(r["cpu"] for r in base)
    s = statistics.median(r["cpu"] for r in with_stream)
    paired = statistics.median(w["cpu"] / r["cpu"] for r, w in zip(base, with_stream))
    drain = statistics.median(r["drain"] for r in with_stream)
    print(
        f"dry run: {len(requests)} Mooncake requests, block size {args.block_size}, "
        f"{args.num_blocks} blocks: {steps:,} steps, {events:,} events ({events / steps:.0f}/step)"
    )
    print(f"  engine thread CPU s, median of {args.repeat}: baseline {b:.3f}, with stream {s:.3f}")
    print(
        f"  added: {(s - b) / steps * 1e6:.1f} us per step, {(s - b) / events * 1e6:.2f} us per "
        f"event; ratio {s / b:.4f} (medians), {paired:.4f} (median of paired rounds)"
    )
    cadence = f"every {args.tick_every} steps" if args.tick_every else f"every {TICK_S} s"
    print(
        f"  loop side (tick {cadence}, not the engine thread): {drain / steps * 1e6:.1f} us per step"
    )


if __name__ == "__main__":
    main()
