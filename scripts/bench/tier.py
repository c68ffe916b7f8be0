"""How fast the disk KV tier restores a block, against a plain in-memory copy of it.

A block of SmolLM2-135M by default (30 layers, 3 KV heads, head_dim 64, 64 tokens, float32:
2.9 MB). ``--blocks`` blocks are stored from one cache tensor, then restored into the block
views of another, ``kv[:, :, b]`` (strided, as the engine would), three ways in this process:

- copy: ``dst[:, :, b].copy_(src[:, :, b])``, the baseline (memory bandwidth);
- warm: ``DiskTier.load`` with the file in the page cache (a restart soon after, or a
  tier smaller than free RAM): a system call, a kernel copy and the checksum;
- cold: the same after the file's pages are dropped (``posix_fadvise(DONTNEED)``): the
  storage device's read bandwidth.

Each prints GB/s and its ratio to the copy. Restoring a block beats recomputing it while
``block_bytes / bandwidth < block_size / prefill_tokens_per_s``, so the script prints the
prefill speed below which the tier pays; give ``--prefill-tps`` to compare with yours.
(``scripts/bench/tier_ttft.py`` measures what it does to a conversation's time to first
token.)

    python scripts/bench/tier.py
    python scripts/bench/tier.py --path /mnt/nvme/kv --blocks 256 --prefill-tps 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

import torch  # noqa: E402
from common import emit  # noqa: E402

from nanokv_cli.engine.tiers.disk import DiskTier  # noqa: E402
from nanokv_cli.engine.tiers.fingerprint import Fingerprint  # noqa: E402
from nanokv_cli.engine.tiers.layout import FILE_HEADER_BYTES, slot_size  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", help="tier directory (default: a temporary one)")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5, help="timed passes; the median counts")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefill-tps", type=float, help="your prefill speed, tokens/s")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads for the copy (a load is one system call on one thread)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser.parse_args()


def tokens_of(b: int, block_size: int) -> list[int]:
    return [b * block_size + i for i in range(block_size)]


def timed_passes(run, repeat: int, before=None) -> float:
    """The median seconds of ``repeat`` calls of ``run`` (``before`` untimed ahead of each)."""
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def drop_pages(path: str) -> None:
    """Ask the kernel to forget the file's cached pages: the next read goes to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    fp = Fingerprint(
        "bench", args.dtype, "none", args.dtype, args.block_size, args.layers, args.kv_heads,
        args.head_dim,
    )  # fmt: skip
    shape = (args.layers, 2, args.blocks, args.block_size, args.kv_heads, args.head_dim)
    src = torch.randn(shape).to(fp.torch_kv_dtype)
    dst = torch.zeros_like(src)
    size = FILE_HEADER_BYTES + args.blocks * slot_size(fp)
    total = args.blocks * fp.block_bytes
    with tempfile.TemporaryDirectory() as tmp, DiskTier(args.path or tmp, size, fp) as tier:
        for b in range(args.blocks):
            assert tier.store(b, tokens_of(b, args.block_size), src[:, :, b])

        def copy() -> None:
            for b in range(args.blocks):
                dst[:, :, b].copy_(src[:, :, b])

        def load() -> None:
            for b in range(args.blocks):
                assert tier.load(b, tokens_of(b, args.block_size), dst[:, :, b])

        seconds = {
            "copy": timed_passes(copy, args.repeat),
            "warm": timed_passes(load, args.repeat, before=load),
            "cold": timed_passes(load, args.repeat, before=lambda: drop_pages(tier.data_path)),
        }
        assert torch.equal(dst, src)
    gbps = {k: total / s / 1e9 for k, s in seconds.items()}
    # Restoring pays while a block reads faster than it computes: below this prefill speed.
    crossover = {k: args.block_size / (fp.block_bytes / (g * 1e9)) for k, g in gbps.items()}
    result = {
        "block_bytes": fp.block_bytes,
        "blocks": args.blocks,
        "gb_per_s": gbps,
        "vs_copy": {k: g / gbps["copy"] for k, g in gbps.items()},
        "pays_below_prefill_tok_s": crossover,
    }
    lines = [f"{args.blocks} blocks of {fp.block_bytes / 1e6:.2f} MB ({args.dtype}):"]
    for k in ("copy", "warm", "cold"):
        lines.append(
            f"  {k:<5} {gbps[k]:6.2f} GB/s  {gbps[k] / gbps['copy']:.2f}x the copy  "
            f"(restoring pays below {crossover[k]:,.0f} prefill tok/s)"
        )
    if args.prefill_tps:
        recompute = args.block_size / args.prefill_tps
        result["recompute_ms_per_block"] = recompute * 1e3
        lines.append(
            f"at {args.prefill_tps:,.0f} prefill tok/s a block takes {recompute * 1e3:.1f} ms "
            f"to recompute; cold restore {fp.block_bytes / (gbps['cold'] * 1e9) * 1e3:.2f} ms"
        )
    emit(result, args.json, lines)


if __name__ == "__main__":
    main()
