"""Decode speed on a shared machine: the same ``nanokv generate`` command, quiet and beside a
competing process.

Each round runs the command twice, alternating: once on a quiet machine, once while a
competitor runs. The command is a default ``nanokv generate`` (greedy, EOS ignored, its own
default thread count unless ``--threads``), and its decode rate is read from its ``--json``
output: the tokens after the first over the time from the first to the last. Competitors:

- ``busy`` (the default): one process spinning on one core, as a compile job or another
  user's script would;
- ``nanokv``: the same command again, in a loop, as a second user of the same tool would.

Printed: each run's decode tok/s, and the contended over the quiet rate (the target is at
least 0.5 beside one busy process).

    python scripts/bench/contention.py
    python scripts/bench/contention.py --competitor nanokv --rounds 3 --json
    python scripts/bench/contention.py --threads 1 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import emit  # noqa: E402

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith in "
    "Mainz combined a screw press with movable metal type."
)
BUSY_LOOP = "while True: pass"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=None, help="nanokv --threads (default: its own)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per run (default 256)")
    p.add_argument("--rounds", type=int, default=2, help="quiet/contended pairs (default 2)")
    p.add_argument("--competitor", choices=("busy", "nanokv"), default="busy")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args()
    if args.rounds < 1 or args.max_tokens < 2:
        p.error("--rounds must be >= 1 and --max-tokens >= 2")
    return args


def generate_command(args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "nanokv_cli.cli",
        "generate",
        PROMPT,
        "--max-tokens",
        str(args.max_tokens),
        "--ignore-eos",
        "--json",
        "--no-live",
    ]
    if args.model:
        command += ["--model", args.model]
    if args.threads:
        command += ["--threads", str(args.threads)]
    return command


def decode_tok_s(command: list[str]) -> float:
    """The decode rate one run of ``command`` reports."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"nanokv generate failed:\n{done.stderr[-2000:]}")
    (result,) = json.loads(done.stdout)
    seconds = result["latency_s"] - result["ttft_s"]
    return (result["num_output_tokens"] - 1) / seconds


def start_competitor(kind: str, command: list[str]) -> subprocess.Popen:
    if kind == "busy":
        code = BUSY_LOOP
    else:
        code = f"import subprocess\nwhile True: subprocess.run({command!r}, capture_output=True)"
    competitor = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(1.0 if kind == "busy" else 3.0)  # let it reach its steady state (a model loaded)
    return competitor


def stop(competitor: subprocess.Popen) -> None:
    competitor.kill()
    competitor.wait()
    if os.name == "posix":  # a nanokv competitor's own child
        subprocess.run(["pkill", "-f", "nanokv_cli generate"], check=False)


def main() -> None:
    args = parse_args()
    command = generate_command(args)
    decode_tok_s(command)  # builds the kernels and warms the page cache for both sides
    quiet, contended = [], []
    for _ in range(args.rounds):
        quiet.append(decode_tok_s(command))
        competitor = start_competitor(args.competitor, command)
        try:
            contended.append(decode_tok_s(command))
        finally:
            stop(competitor)
        time.sleep(1.0)
    ratio = statistics.median(contended) / statistics.median(quiet)
    result = {
        "benchmark": "contention",
        "competitor": args.competitor,
        "threads": args.threads or "default",
        "cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "max_tokens": args.max_tokens,
        "quiet_tok_s": quiet,
        "contended_tok_s": contended,
        "ratio": ratio,
    }
    lines = [
        f"nanokv generate, {args.max_tokens} tokens, threads {result['threads']} "
        f"on {result['cpus']} CPUs; competitor: {args.competitor}",
        "quiet:     " + ", ".join(f"{v:7.1f}" for v in quiet) + " tok/s",
        "contended: " + ", ".join(f"{v:7.1f}" for v in contended) + " tok/s",
        f"contended / quiet (medians): {ratio:.2f}x",
    ]
    emit(result, args.json, lines)


if __name__ == "__main__":
    main()
