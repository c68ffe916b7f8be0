"""Cost of nanokv's block accounting, with no model: the dry-run engine.

1. One decode step of the scheduler + block manager with N running sequences (default 256),
   events off and on, against a bare loop that only moves the same sequences through a deque
   (the floor any Python scheduler pays), measured in the same run.
2. The whole Mooncake conversation trace (examples/traces) at block size 512: all requests at
   once, and with their timestamps, for a few cache sizes. Each configuration runs in its own
   process so peak RSS is its own.

    python scripts/bench/accounting.py                 # everything
    python scripts/bench/accounting.py --limit 2000    # a slice of the trace
    python scripts/bench/accounting.py --skip-trace    # decode step only
    python scripts/bench/accounting.py --against HEAD~1 --limit 4000   # vs another commit

With ``--against REV`` every measurement also runs on that revision's engine (checked out into a
temporary git worktree, same script, same process layout), alternating the two, and the ratio
is printed per row: a change to the accounting is judged against its parent in one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

# This checkout: the nearest folder above holding pyproject.toml.
HERE = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
# The engine measured: this checkout, or (--against) another revision's tree.
ROOT = Path(os.environ.get("NANOKV_BENCH_ROOT", HERE))
sys.path.insert(0, str(ROOT))

from nanokv_cli.engine.block_manager import BlockManager  # noqa: E402
from nanokv_cli.engine.core.blocks import hash_block_tokens  # noqa: E402
from nanokv_cli.engine.core.dry_run import DryRunExecutor, VirtualClock  # noqa: E402
from nanokv_cli.engine.core.llm_engine import LLMEngine  # noqa: E402
from nanokv_cli.workload.mooncake import read_mooncake  # noqa: E402

try:  # the one request loop, driver.Driver
    from nanokv_cli.engine.core.requests import Request, all_at_once
    from nanokv_cli.run.loop import Arrivals, Driver

    def drive(engine, requests, clock):
        return Driver(engine, clock).run(Arrivals(requests))

except ImportError:  # --against a revision from before engine/core/requests.py: its replay loop
    from nanokv_cli.engine.replay import Request, all_at_once  # noqa: E402
    from nanokv_cli.engine.replay import replay as drive  # noqa: E402
from nanokv_cli.engine.core.scheduler import Scheduler  # noqa: E402
from nanokv_cli.engine.sampling_params import SamplingParams  # noqa: E402
from nanokv_cli.engine.sequence import Sequence  # noqa: E402

try:
    from nanokv_cli.engine.config import EngineConfig  # noqa: E402
except ImportError:  # --against a revision from before EngineConfig: keyword settings
    EngineConfig = None

TRACE = HERE / "examples" / "traces" / "mooncake_conversation_trace.jsonl"


def decode_step_us(num_seqs: int, steps: int, events: bool) -> float:
    bm = BlockManager(num_blocks=num_seqs * 64, block_size=256)
    sched = Scheduler(bm, max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20)
    if events:
        sink: list = []
        bm.on_event = sched.on_event = sink.append
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    for _ in range(num_seqs):
        sched.add(
            Sequence([rng.randrange(32000) for _ in range(rng.randint(64, 512))], params, 256)
        )
    seqs = sched.schedule()
    sched.postprocess(seqs, [1] * len(seqs))  # prefill; from here on every step decodes
    tokens = [7] * num_seqs
    t0 = time.perf_counter()
    for _ in range(steps):
        seqs = sched.schedule()
        sched.postprocess(seqs, tokens)
    return (time.perf_counter() - t0) / steps * 1e6


class SeedStyleBaseline:
    """The decode path as the seed chapter / nano-vllm write it, restated minimally as the
    baseline: deque free list, per-step ``len(seq) % block_size`` checks through ``__len__``,
    a hash computed in ``may_append`` when a block fills, ``running.remove`` on finish."""

    def __init__(self, num_blocks: int, block_size: int, num_seqs: int) -> None:
        self.bs = block_size
        self.free = deque(range(num_blocks))
        self.ref = [0] * num_blocks
        self.hashes: dict[int, int] = {}
        self.running: deque = deque()
        rng = random.Random(0)
        for _ in range(num_seqs):
            seq = Sequence(
                [rng.randrange(32000) for _ in range(rng.randint(64, 512))],
                SamplingParams(max_tokens=1 << 20, ignore_eos=True),
                block_size,
            )
            for _ in range(seq.num_blocks):
                b = self.free.popleft()
                self.ref[b] = 1
                seq.block_table.append(b)
            self.running.append(seq)

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free) >= (len(seq) % self.bs == 1)

    def may_append(self, seq: Sequence) -> None:
        n = len(seq) % self.bs
        if n == 1:
            b = self.free.popleft()
            self.ref[b] = 1
            seq.block_table.append(b)
        elif n == 0:
            tokens = seq.block(seq.num_blocks - 1)
            self.hashes[hash_block_tokens(tokens)] = seq.block_table[-1]

    def step(self, token: int) -> None:
        scheduled = []
        while self.running and len(scheduled) < 1 << 20:
            seq = self.running.popleft()
            if not self.can_append(seq):
                raise RuntimeError("baseline cache too small")
            self.may_append(seq)
            scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        for seq in scheduled:
            seq.append_token(token)
            if seq.num_completion_tokens == seq.max_tokens:
                self.running.remove(seq)


def seed_style_us(num_seqs: int, steps: int) -> float:
    base = SeedStyleBaseline(num_seqs * 64, 256, num_seqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        base.step(7)
    return (time.perf_counter() - t0) / steps * 1e6


def bare_loop_us(num_seqs: int, steps: int) -> float:
    class S:
        __slots__ = ("n", "k")

        def __init__(self):
            self.n = self.k = 0

    q = deque(S() for _ in range(num_seqs))
    t0 = time.perf_counter()
    for _ in range(steps):
        out = []
        for _ in range(num_seqs):
            s = q.popleft()
            s.k = 1
            out.append(s)
        for s in out:
            s.n += s.k
        q.extendleft(reversed(out))
    return (time.perf_counter() - t0) / steps * 1e6


def run_trace(num_blocks: int, at_once: bool, limit: int | None) -> dict:
    clock = VirtualClock()
    settings = dict(
        num_blocks=num_blocks, block_size=512, max_num_seqs=256, max_num_batched_tokens=16384
    )
    if EngineConfig is None:
        engine = LLMEngine(DryRunExecutor(clock=clock), clock=clock, **settings)
    else:
        config = EngineConfig(**settings)
        engine = LLMEngine(DryRunExecutor(config, clock=clock), config, clock=clock)
    reqs = (
        Request(
            r.prompt_token_ids,
            SamplingParams(max_tokens=r.output_length, ignore_eos=True),
            r.timestamp,
        )
        for r in read_mooncake(TRACE, limit=limit)
    )
    if at_once:
        reqs = all_at_once(reqs)
    t0 = time.perf_counter()
    finished = steps = 0
    for outs in drive(engine, reqs, clock):
        steps += 1
        finished += sum(o.finished for o in outs)
    wall = time.perf_counter() - t0
    s = engine.block_manager.stats
    return {
        "num_blocks": num_blocks,
        "arrivals": "all at once" if at_once else "timestamps",
        "requests": finished,
        "wall_s": round(wall, 2),
        "steps": steps,
        "hit_rate": round(s.hit_rate, 4),
        "evictions": s.evictions,
        "preemptions": s.preemptions,
        "virtual_s": round(clock(), 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def infinite_cache_hit_rate(limit: int | None) -> float:
    seen: set[int] = set()
    hits = total = 0
    for r in read_mooncake(TRACE, limit=limit):
        total += r.input_length
        for h in r.hash_ids[: (r.input_length - 1) // 512]:
            if h not in seen:
                break
            hits += 512
        seen.update(r.hash_ids)
    return hits / total


def measure(job: str, limit: int | None, root: Path | None) -> dict:
    """One measurement in a fresh process (its own peak RSS), on ``root``'s engine if given."""
    cmd = [sys.executable, __file__, "--one", job]
    if limit:
        cmd += ["--limit", str(limit)]
    env = dict(os.environ)
    if root is not None:
        env["NANOKV_BENCH_ROOT"] = str(root)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out)


def run_one(job: str, args) -> dict:
    kind, _, spec = job.partition(":")
    if kind == "decode":
        n = args.num_seqs
        return {
            "floor_us": bare_loop_us(n, args.steps),
            "seed_us": seed_style_us(n, args.steps),
            "off_us": decode_step_us(n, args.steps, events=False),
            "on_us": decode_step_us(n, args.steps, events=True),
        }
    blocks, at_once = spec.split("/")
    return run_trace(int(blocks), at_once == "1", args.limit)


def worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="nanokv-bench-")) / "tree"
    subprocess.run(
        ["git", "-C", str(HERE), "worktree", "add", "--detach", "-q", str(path), rev], check=True
    )
    return path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--limit", type=int, default=None, help="first N trace requests")
    ap.add_argument("--num-blocks", default="2000,8000,32000")
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--against", metavar="REV", help="also measure this git revision, alternating")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each measurement (alternating); the fastest counts",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one measurement, print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return

    base = worktree(args.against) if args.against else None
    try:
        report(args, base)
    finally:
        if base is not None:
            subprocess.run(
                ["git", "-C", str(HERE), "worktree", "remove", "--force", str(base)], check=False
            )


def report(args, base: Path | None) -> None:
    def fastest(runs: list[dict]) -> dict:
        key = "wall_s" if "wall_s" in runs[0] else "on_us"
        best = min(runs, key=lambda r: r[key])
        if key == "on_us":  # decode rows: each figure's own fastest
            best = {k: min(r[k] for r in runs) for k in runs[0]}
        return best

    def both(job: str) -> tuple[dict, dict | None]:
        news, olds = [], []
        for _ in range(args.repeat):
            if base is not None:
                olds.append(measure(job, args.limit, base))
            news.append(measure(job, args.limit, None))
        return fastest(news), fastest(olds) if olds else None

    new, old = both("decode:")
    print(f"decode step, {args.num_seqs} running sequences (scheduler + block manager):")
    rows = [
        ("bare deque loop (floor)", "floor_us"),
        ("seed/nano-vllm-style baseline", "seed_us"),
        ("nanokv, events off", "off_us"),
        ("nanokv, events on", "on_us"),
    ]
    for label, key in rows:
        line = f"  {label:<30} {new[key]:7.1f} us"
        if key in ("off_us", "on_us"):
            line += f"   {new[key] / new['seed_us']:.2f}x baseline"
        if old is not None:
            line += f"   {args.against}: {old[key]:7.1f} us = {new[key] / old[key]:.2f}x"
        print(line)
    if args.skip_trace:
        return
    if not TRACE.exists():
        sys.exit(f"trace not found at {TRACE}")
    print(
        f"\nMooncake conversation trace, block size 512 "
        f"(infinite-cache hit rate {infinite_cache_hit_rate(args.limit):.3f}):"
    )
    cols = [
        "arrivals",
        "num_blocks",
        "requests",
        "wall_s",
        "steps",
        "hit_rate",
        "evictions",
        "preemptions",
        "virtual_s",
        "peak_rss_mb",
    ]
    header = "  " + "  ".join(f"{c:>12}" for c in cols)
    if base is not None:
        header += f"  {'base wall_s':>12}  {'ratio':>6}"
    print(header)
    for at_once in (True, False):
        for blocks in args.num_blocks.split(","):
            row, old = both(f"trace:{blocks}/{int(at_once)}")
            line = "  " + "  ".join(f"{row[c]!s:>12}" for c in cols)
            if old is not None:
                line += f"  {old['wall_s']:>12}  {row['wall_s'] / old['wall_s']:>5.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
