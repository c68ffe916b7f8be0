"""What a trace costs and how fast it reads, on the Mooncake conversation trace (examples/traces).

1. The dry run at block size 512 and 8,000 blocks, without and with ``--record`` (the baseline
   is the same command in the same invocation): wall time, the ratio, and the trace's size.
2. ``nanokv inspect`` of the recorded trace at its last step and at a step in the middle (the
   terminal view, as a user runs it): wall time and peak RSS of each.
3. ``inspect --summary``, ``--request`` of a request in the middle, and the vLLM KV-event export.

Every command runs as its own process (``python -m nanokv_cli.cli``), so times include start-up
and peak RSS is that command's alone.

    python scripts/bench/traces.py                  # the whole trace (about a minute)
    python scripts/bench/traces.py --limit 2000     # a slice
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import TRACE, run_measured  # noqa: E402


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
        plain, plain_rss, _, out = run_measured(*base)
        report = json.loads(out)
        recorded, rec_rss, _, _ = run_measured(*base, "--record", str(path))
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
        summary = json.loads(run_measured("inspect", str(path), "--summary", "--json")[3])
        last = summary["steps"] - 1
        print(
            f"  {summary['num_events']:,} events, {summary['checkpoints']} checkpoints; "
            f"bytes: {summary['record_bytes']}"
        )
        print("inspect (terminal view; targets <= 1.0 s end to end, <= 400 MB each):")
        for label, step in (("last step", None), ("middle step", last // 2)):
            extra = [] if step is None else ["--step", str(step)]
            wall, rss, _, _ = run_measured("inspect", str(path), *extra)
            print(f"  {label:<12} {wall:6.2f} s   peak RSS {rss:6.0f} MB")
        for label, extra in (("--json", ["--json"]), ("--json --all", ["--json", "--all"])):
            wall, rss, _, _ = run_measured("inspect", str(path), "--step", str(last), *extra)
            target = "   (target <= 2 s, <= 300 MB)" if "--all" not in extra else ""
            print(f"  last step {label:<12} {wall:6.2f} s   peak RSS {rss:6.0f} MB{target}")
        wall, rss, _, _ = run_measured("inspect", str(path), "--summary")
        print(f"  --summary    {wall:6.2f} s   peak RSS {rss:6.0f} MB")
        middle = report["requests"] // 2
        wall, rss, _, _ = run_measured("inspect", str(path), "--request", str(middle))
        print(f"  --request {middle:<6} {wall:6.2f} s   peak RSS {rss:6.0f} MB")
        kv = Path(tmp) / "run.kv"
        wall, rss, _, _ = run_measured("inspect", str(path), "--export", "vllm-kv-events", str(kv))
        print(
            f"  --export vllm-kv-events {wall:6.2f} s   peak RSS {rss:6.0f} MB   "
            f"{kv.stat().st_size / 1e6:.0f} MB"
        )


if __name__ == "__main__":
    main()
