"""The machine's limits the CPU benchmarks print their speed against (issue 32): the read
bandwidth of the C kernels' own pool and the kernels' peak multiply-adds per weight format,
per thread count. The functions behind them, and a step's bound, are in ``scripts/common.py``.

    python scripts/profile/roofline.py --threads 1,2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import kernel_peak_flops, read_bandwidth  # noqa: E402

from nanokv_cli.engine.cpu import kernels  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description="the machine's read bandwidth and kernel peaks")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = p.parse_args()
    if not kernels.available():
        sys.exit("the C kernels are not built here (nanokv doctor says why)")
    for threads in (int(t) for t in args.threads.split(",")):
        peaks = ", ".join(
            f"{fmt} {kernel_peak_flops(fmt, threads) / 1e9:.1f}" for fmt in ("q4", "q8", "f32")
        )
        print(
            f"{threads} thread(s): read {read_bandwidth(threads) / 1e9:.1f} GB/s; "
            f"kernel peak GFLOP/s: {peaks}"
        )


if __name__ == "__main__":
    main()
