"""Soak: rounds of streaming clients that leave at random, against ``nanokv serve``.

Loopback only and bounded: it starts its own server on a free port (``--threads 1`` by
default, leaving a core to the clients), runs ``--rounds`` rounds of ``--clients`` concurrent
streaming completions, and stops the server with SIGTERM; a deadline covers the whole run.
In each round every client, at random, reads its stream to the end, closes it after a few
events, resets it (``SO_LINGER`` 0, then close: a TCP RST) after a few events, or resets it
before the first event. Once the round has settled (``/metrics``: nothing running or waiting,
no block in use) it prints the server process's RSS (``VmRSS``), threads and open file
descriptors (``/proc/PID``) and what ``/metrics`` says.

Verdict (issue #27): from round 5 on, RSS stays within ``--tolerance-mb`` (30 MB) of its round
5 value; threads and open files stay flat (as after round 1, open files within 2); every client
that stayed got its whole stream; the server's log has no traceback and SIGTERM exits 0.

    python scripts/check/soak_serve.py
    python scripts/check/soak_serve.py --rounds 6 --clients 32 --max-tokens 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import launch_server, settled  # noqa: E402

from nanokv_cli.serve.process import ServerProcess  # noqa: E402

BEHAVIOURS = ("complete", "close", "reset", "reset-early")
WORDS = "cache block prefix token page share evict hash query answer engine stream".split()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--clients", type=int, default=64, help="concurrent clients per round")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens a request asks for")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance-mb", type=float, default=30.0, help="RSS growth after round 5")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline for the whole run (s)")
    p.add_argument("--server-arg", action="append", default=[], help="passed to nanokv serve")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args()
    if args.rounds < 1 or args.clients < 1 or args.max_tokens < 1:
        p.error("--rounds, --clients and --max-tokens must be >= 1")
    return args


# -- the server --------------------------------------------------------------------------------


def start_server(args: argparse.Namespace, workdir: str, deadline: float) -> ServerProcess:
    return launch_server(
        [
            "--threads",
            str(args.threads),
            *args.server_arg,
            *(["--model", args.model] if args.model else []),
        ],
        workdir,
        deadline,
        args.threads,
        "server",
    )


# -- the clients -------------------------------------------------------------------------------


def request_bytes(address: tuple[str, int], rng: random.Random, max_tokens: int) -> bytes:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens),
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST: SO_LINGER on with a zero timeout, then close at once."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def one_client(address, request: bytes, behaviour: str, leave_after: int) -> str:
    """One streaming completion over a raw socket; returns what happened."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(request)
        await writer.drain()
        if behaviour == "reset-early":
            reset(writer)
            return "reset"
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return "http " + head[9:12].decode()
        seen, events = b"", 0
        while True:
            data = await reader.read(65536)
            if not data:
                return "complete" if b"data: [DONE]" in seen else "cut"
            seen = (seen + data)[-4096:]
            events += data.count(b"data: ")
            if behaviour == "complete" and b"data: [DONE]" in seen:
                return "complete"
            if behaviour != "complete" and events > leave_after:
                if behaviour == "reset":
                    reset(writer)
                    return "reset"
                writer.close()
                return "close"
    finally:
        if not writer.transport.is_closing():
            writer.close()


async def one_round(address, rng: random.Random, args, timeout: float) -> dict[str, int]:
    jobs = []
    for _ in range(args.clients):
        behaviour = rng.choice(BEHAVIOURS)
        request = request_bytes(address, rng, args.max_tokens)
        jobs.append(one_client(address, request, behaviour, rng.randint(1, 6)))
    results = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), timeout)
    counts: dict[str, int] = {}
    for r in results:
        key = r if isinstance(r, str) else type(r).__name__
        counts[key] = counts.get(key, 0) + 1
    return counts


# -- the verdict -------------------------------------------------------------------------------


def verdict(rows: list[dict], tolerance_mb: float) -> list[str]:
    failures = []
    if len(rows) >= 5:
        base = rows[4]["rss_mb"]
        worst = max(r["rss_mb"] for r in rows[4:])
        if worst - base > tolerance_mb:
            failures.append(f"RSS grew {worst - base:.1f} MB after round 5 (> {tolerance_mb})")
    first = rows[0]
    if any(r["threads"] != first["threads"] for r in rows):
        failures.append(f"threads moved: {[r['threads'] for r in rows]}")
    if any(abs(r["fds"] - first["fds"]) > 2 for r in rows):
        failures.append(f"open files moved: {[r['fds'] for r in rows]}")
    for r in rows:
        bad = {k: v for k, v in r["clients"].items() if k not in ("complete", "close", "reset")}
        if bad:
            failures.append(f"round {r['round']}: clients {bad}")
        if r["running"] or r["waiting"] or r["blocks_used"]:
            failures.append(f"round {r['round']}: not idle after the round")
    return failures


def main() -> None:
    args = parse_args()
    deadline = time.monotonic() + args.timeout
    rng = random.Random(args.seed)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="soak_serve.") as work:
        server = start_server(args, work, deadline)
        try:
            print(f"soak: {args.rounds} rounds x {args.clients} clients on {server.url}")
            print("round  RSS MB  threads  fds  running waiting used  clients", flush=True)
            for n in range(1, args.rounds + 1):
                left = deadline - time.monotonic()
                counts = asyncio.run(one_round(server.address, rng, args, left))
                m = settled(server, 60.0)
                time.sleep(0.5)  # the server closes its side of the last connections
                row = {"round": n, **server.process_stats(), "clients": counts}
                row["running"] = m["vllm:num_requests_running"]
                row["waiting"] = m["vllm:num_requests_waiting"]
                row["blocks_used"] = m["nanokv:kv_cache_blocks{state=used}"]
                rows.append(row)
                print(
                    f"{n:5d} {row['rss_mb']:7.1f} {row['threads']:8d} {row['fds']:4d} "
                    f"{row['running']:8.0f} {row['waiting']:7.0f} {row['blocks_used']:4.0f}  "
                    + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                    flush=True,
                )
            code = server.stop(timeout=max(10.0, deadline - time.monotonic()))
        finally:
            server.kill()
        log = server.err_path.read_text()
    failures = verdict(rows, args.tolerance_mb)
    tracebacks = log.count("Traceback")
    if tracebacks:
        failures.append(f"{tracebacks} tracebacks in the server's log")
    if code != 0:
        failures.append(f"SIGTERM: exit status {code}")
    if args.json:
        print(json.dumps({"rounds": rows, "sigterm_exit": code, "failures": failures}, indent=2))
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
