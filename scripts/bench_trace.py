"""What a trace costs and how fast it reads, on the Mooncake conversation trace (examples/traces).

1. The dry run at block size 512 and 8,000 blocks, without and with ``--record`` (the baseline
   is the same command in the same invocation): wall time, the ratio, and the trace's size.
2. ``nanokv inspect`` of the recorded trace at its last step and at a step in the middle (the
   terminal view, as a user runs it): wall time and peak RSS of each.
3. ``inspect --summary``, ``--request`` of a request in the middle, and the vLLM KV-event export.

Every command runs as its own process (``python -m nanokv_cli.cli``), so times include start-up
and peak RSS is that command's alone.

    python scripts/bench_trace.py                  # the whole trace (about a minute)
    python scripts/bench_trace.py --limit 2000     # a slice
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "traces" / "mooncake_conversation_trace.jsonl"


def run(*args: str) -> tuple[float, float, str]:
    """Wall seconds, peak RSS (MB) and stdout of one nanokv command in a fresh process."""
    cmd = [sys.executable, "-c", _MEASURED, *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed: nanokv {' '.join(args)}\n{proc.stderr}")
    out, _, rss = proc.stdout.rpartition("\n@rss ")
    return wall, float(rss) / 1024, out


# Runs the CLI in-process and reports its own peak RSS (children's peaks would mix runs).
_MEASURED = """
import resource, sys
from nanokv_cli.cli import app
sys.argv = ["nanokv", *sys.argv[1:]]
try:
    app(prog_name="nanokv")
except SystemExit as e:
    if e.code:
        raise
finally:
    print("\\n@rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    ap.add_argument("--num-blocks", type=int, default=8000)
    ap.add_argument("--keep", metavar="FILE", help="keep the recorded trace here")
    args = ap.parse_args()
    if not TRACE.exists():
        sys.exit(f"trace not found at {TRACE}")
    base = [
        "replay",
        str(TRACE),
        "--dry-run",
        "--block-size",
        "512",
        "--num-blocks",
        str(args.num_blocks),
        "--json",
    ]
    if args.limit:
        base += ["--limit", str(args.limit)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.keep) if args.keep else Path(tmp) / "run.trace"
        plain, plain_rss, out = run(*base)
        report = json.loads(out)
        recorded, rec_rss, _ = run(*base, "--record", str(path))
        size = path.stat().st_size
        print(
            f"dry run, {report['requests']:,} requests, {report['steps']:,} steps, "
            f"block size 512, {args.num_blocks:,} blocks:"
        )
        print(f"  without --record   {plain:7.2f} s   peak RSS {plain_rss:6.0f} MB")
        print(
            f"  with --record      {recorded:7.2f} s   peak RSS {rec_rss:6.0f} MB   "
            f"= {recorded / plain:.2f}x the run without (target <= 2x)"
        )
        print(f"  trace file         {size / 1e6:7.1f} MB (target <= 150 MB)")
        summary = json.loads(run("inspect", str(path), "--summary", "--json")[2])
        last = summary["steps"] - 1
        print(
            f"  {summary['num_events']:,} events, {summary['checkpoints']} checkpoints; "
            f"bytes: {summary['record_bytes']}"
        )
        print("inspect (terminal view; targets <= 1.0 s end to end, <= 400 MB each):")
        for label, step in (("last step", None), ("middle step", last // 2)):
            extra = [] if step is None else ["--step", str(step)]
            wall, rss, _ = run("inspect", str(path), *extra)
            print(f"  {label:<12} {wall:6.2f} s   peak RSS {rss:6.0f} MB")
        for label, extra in (("--json", ["--json"]), ("--json --all", ["--json", "--all"])):
            wall, rss, _ = run("inspect", str(path), "--step", str(last), *extra)
            target = "   (target <= 2 s, <= 300 MB)" if "--all" not in extra else ""
            print(f"  last step {label:<12} {wall:6.2f} s   peak RSS {rss:6.0f} MB{target}")
        wall, rss, _ = run("inspect", str(path), "--summary")
        print(f"  --summary    {wall:6.2f} s   peak RSS {rss:6.0f} MB")
        middle = report["requests"] // 2
        wall, rss, _ = run("inspect", str(path), "--request", str(middle))
        print(f"  --request {middle:<6} {wall:6.2f} s   peak RSS {rss:6.0f} MB")
        kv = Path(tmp) / "run.kv"
        wall, rss, _ = run("inspect", str(path), "--export", "vllm-kv-events", str(kv))
        print(
            f"  --export vllm-kv-events {wall:6.2f} s   peak RSS {rss:6.0f} MB   "
            f"{kv.stat().st_size / 1e6:.0f} MB"
        )


if __name__ == "__main__":
    main()
