"""``nanokv advise`` on the whole Mooncake conversation trace (examples/traces): its wall time
end to end (target: under 60 s), its grid, and its notes (the trace's 512-token hash ids).

The baseline is one ``nanokv replay --dry-run`` at the same settings, in the same invocation:
the ratio says what the grid costs in single runs (its runs go two at a time in a process
pool). Each command runs as its own process, so times include start-up.

    python scripts/bench/advise.py                             # advise's default settings
    python scripts/bench/advise.py --block-size 512 --num-blocks 8000
    python scripts/bench/advise.py --limit 2000                # a slice
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import TRACE, run_measured  # noqa: E402

TARGET_S = 60.0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=None, help="advise --jobs [default: its own]")
    args = ap.parse_args()
    if not TRACE.exists():
        sys.exit(f"trace not found at {TRACE}")
    settings: list[str] = []
    if args.block_size:
        settings += ["--block-size", str(args.block_size)]
    if args.num_blocks:
        settings += ["--num-blocks", str(args.num_blocks)]
    limit = ["--limit", str(args.limit)] if args.limit else []
    jobs = ["--jobs", str(args.jobs)] if args.jobs else []
    wall, own, child, out = run_measured("advise", str(TRACE), *settings, *limit, *jobs, "--json")
    advice = json.loads(out)
    now = advice["now"]
    one, one_rss, _, _ = run_measured(
        "replay",
        str(TRACE),
        "--dry-run",
        "--json",
        "--block-size",
        str(now["block_size"]),
        "--num-blocks",
        str(now["num_blocks"]),
        *limit,
    )
    print(
        f"advise {TRACE.name}: {advice['input']['requests']:,} requests, block size "
        f"{now['block_size']}, {now['num_blocks']:,} blocks"
    )
    print(f"  {'run':<24} {'block':>6} {'blocks':>9} {'hit rate':>9} {'gain':>8} {'seconds':>8}")
    for r in advice["grid"]:
        gain = "" if r["kind"] == "now" else f"{r['gain'] * 100:+.2f}"
        print(
            f"  {r['label']:<24} {r['block_size']:>6} {r['num_blocks']:>9,} "
            f"{r['hit_rate']:>9.2%} {gain:>8} {r['wall_time_s']:>8.1f}"
        )
    print("  notes:")
    for note in advice["notes"]:
        print(f"    - {note}")
    verdict = "ok" if wall < TARGET_S else "OVER"
    print(
        f"advise      {wall:7.2f} s end to end ({verdict}: target < {TARGET_S:.0f} s)   "
        f"peak RSS {own:6.0f} MB, largest worker {child:6.0f} MB"
    )
    print(f"one replay  {one:7.2f} s (--dry-run, the same settings)   peak RSS {one_rss:6.0f} MB")
    print(f"advise = {wall / one:.2f}x one replay, for {len(advice['grid'])} grid runs")


if __name__ == "__main__":
    main()
