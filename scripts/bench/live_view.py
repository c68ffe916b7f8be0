"""What the live view costs a replay: the same run with and without it attached.

Dry run (always): `nanokv replay --dry-run` on a slice of the Mooncake trace, as the CLI
drives it (report statistics attached, so the engine emits events either way); the second
run also feeds the live view, drawing into an in-memory 120x40 colour terminal so drawing is
paid in full. The model-free engine spends ~2 us per block event, so this is the worst case:
the view's per-event bookkeeping is a visible fraction of it. A run with no listener at all
shows what emitting events costs.

Model run (with --model PATH, or --model default): the same comparison on a real model, the
case the live view is on by default for. Here a step costs milliseconds and carries a handful
of events.

    python scripts/bench/live_view.py [--limit 200] [--repeat 5] [--max-others 0.1] [--model default]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.requests import Request
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.run.encode import PromptEncoder, build_requests
from nanokv_cli.run.loop import Arrivals, Driver, dry_run_engine
from nanokv_cli.run.stats import RunStats
from nanokv_cli.views.live import LiveView
from nanokv_cli.workload.prompts import read_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import TRACE  # noqa: E402


class NoWait:
    """Clock for all-at-once replays: nothing ever waits."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __call__(self) -> float:
        return self.engine.clock

    def wait_until(self, t: float) -> None:
        pass


def _machine_busy() -> float:
    """CPU seconds all processes have run (from /proc/stat; 0 where there is none)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def timed(make_engine: Callable, requests: list, mode: str) -> tuple[float, float, LiveView | None]:
    """CPU seconds (all threads) to replay ``requests``, and the share of a core that other
    processes used meanwhile; ``mode``: silent, stats or view."""
    engine, clock = make_engine()
    view = None
    unsubscribe = []
    if mode != "silent":
        unsubscribe.append(engine.events.subscribe(RunStats()))
    if mode == "view":
        console = Console(
            file=io.StringIO(), width=120, height=40, force_terminal=True, color_system="truecolor"
        )
        view = LiveView(
            engine.num_blocks, engine.block_size, console=console, total_requests=len(requests)
        )
        unsubscribe.append(view.attach(engine.events))
        view.__enter__()
    busy0, wall0 = _machine_busy(), time.perf_counter()
    t0 = time.process_time()  # CPU time: less swayed by other processes on a shared machine
    for _ in Driver(engine, clock).run(Arrivals(requests)):
        if view is not None:
            view.tick()
    if view is not None:
        view.__exit__(None, None, None)
    elapsed = time.process_time() - t0
    others = (_machine_busy() - busy0 - elapsed) / (time.perf_counter() - wall0)
    for u in unsubscribe:  # a model engine is reused across runs
        u()
    return elapsed, max(0.0, others), view


def compare(
    label: str,
    make_engine: Callable,
    requests: list,
    repeat: int,
    modes: tuple[str, ...],
    max_others: float,
) -> None:
    """Runs ``repeat`` rounds of every mode, interleaved so that drift in machine load hits
    every mode alike. A round during which other processes kept more than ``max_others`` of a
    core busy is dropped and run again (at most ``3 * repeat`` extra rounds)."""
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    dropped = 0
    view = None
    while len(times["stats"]) < repeat and dropped <= 3 * repeat:
        results = [timed(make_engine, requests, mode) for mode in modes]
        if max(busy for _, busy, _ in results) > max_others:
            dropped += 1
            continue
        for mode, (elapsed, _, v) in zip(modes, results):
            times[mode].append(elapsed)
            view = v or view
    n = len(times["stats"])
    print(f"{label}: {n} rounds ({dropped} dropped: other processes busy)")
    if not n:
        return
    med = {mode: statistics.median(t) for mode, t in times.items()}
    best = {mode: min(t) for mode, t in times.items()}
    print("  CPU seconds                 median     best")
    if "silent" in med:
        print(f"  no listener (events off)  {med['silent']:8.3f} {best['silent']:8.3f}")
    print(f"  replay, no view           {med['stats']:8.3f} {best['stats']:8.3f}   baseline")
    print(
        f"  replay, live view         {med['view']:8.3f} {best['view']:8.3f}   last run: "
        f"{view.frames} frames, {view.draw_time:.3f} s drawing"
    )
    # Each view run against the baseline run of its round: runs close in time share the
    # machine's state, so their ratios scatter less than a ratio of medians.
    paired = statistics.median(v / s for v, s in zip(times["view"], times["stats"]))
    ratio = med["view"] / med["stats"]
    print(
        f"  ratio view / baseline     {ratio:8.4f}            ({(ratio - 1) * 100:+.2f}%, "
        f"medians)\n  ratio, median of rounds   {paired:8.4f}            "
        f"({(paired - 1) * 100:+.2f}%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--model", help="also compare on this model ('default': SmolLM2-135M)")
    parser.add_argument(
        "--max-others",
        type=float,
        default=0.1,
        help="drop rounds during which other processes kept more than this share of a core busy",
    )
    args = parser.parse_args()

    pf = read_prompts(args.trace, limit=args.limit)
    requests = build_requests(pf, PromptEncoder(None, False), SamplingParams(), rate=None)
    dry = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks)
    compare(
        f"dry run: {len(requests)} Mooncake requests, block size {args.block_size}, {args.num_blocks} blocks",
        lambda: dry_run_engine(dry),
        requests,
        args.repeat,
        ("silent", "stats", "view"),
        args.max_others,
    )
    if args.model:
        from nanokv_cli.llm import LLM

        llm = LLM(None if args.model == "default" else args.model, block_size=16)
        prefix = llm.tokenizer.encode("A long shared system prompt about paged KV caches. " * 8)
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        model_requests = [
            Request(prefix + llm.tokenizer.encode(f"Question {i}?"), params) for i in range(8)
        ]
        compare(
            f"model {llm.model_path}: 8 requests x 32 tokens, block size 16",
            lambda: (llm.engine, NoWait(llm.engine)),
            model_requests,
            args.repeat,
            ("stats", "view"),
            args.max_others,
        )


if __name__ == "__main__":
    main()
