"""Serving: concurrent streaming clients against ``nanokv serve``, vs ``LLM.generate``.

Loopback only and bounded (a fixed number of requests, a deadline for the whole run); it
starts its own server on a free port and stops it with SIGTERM. In one invocation:

1. ``LLM.generate`` runs the clients' requests (the same chat prompts, token for token, greedy,
   ``ignore_eos`` so every request generates ``--max-tokens``) in this process: the baseline.
2. ``--clients`` concurrent streaming chat clients (a shared system prompt) send the same
   requests to the server; all must complete. Throughput is generated tokens over the time
   from the first request sent to the last token received; the ratio to the baseline is
   printed (each side best of ``--repeat``, alternating, on a warm cache for the prompt).
3. ``/metrics`` must then show 0 requests running or waiting, 0 blocks in use (the prefix
   cache keeps its blocks as free-but-cached) and prefix-cache hits > 0.
4. The clients run again and ``--disconnect`` of them (20%) close their stream after a
   quarter of their tokens: those requests must be aborted, the rest complete, and nothing
   leak (step 3's checks again).
5. SIGTERM: the server must exit 0.

The clients run on the same machine, so by default both sides get one torch thread fewer than
there are cores (at least one), leaving a core to the load generator and the server's event
loop; ``--threads N`` sets both. On 2 cores with 2 threads each, the clients' and the event
loop's few milliseconds per step land inside the model's parallel regions and stall them
(``scripts/BENCHMARKS.md`` has both figures).

    python scripts/bench/serve.py
    python scripts/bench/serve.py --quick --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import chat_body, emit, launch_server, set_threads, settled  # noqa: E402

from nanokv_cli import LLM, SamplingParams  # noqa: E402
from nanokv_cli.serve.process import ServerProcess  # noqa: E402

SYSTEM = (
    "You are the operator's assistant for a paged KV cache inference engine. Keep answers "
    "short and concrete, explain which blocks of the cache a request would share with earlier "
    "ones, prefer plain words over jargon, and say so when a question cannot be answered. "
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=None, help="per request (default 64)")
    p.add_argument(
        "--block-size", type=int, default=None, help="default 16; burst: the server's default"
    )
    p.add_argument("--system-repeat", type=int, default=2, help="copies of the system prompt")
    p.add_argument("--disconnect", type=float, default=0.2, help="fraction of clients that leave")
    p.add_argument("--repeat", type=int, default=None, help="runs of each side (default 3)")
    p.add_argument("--min-ratio", type=float, default=0.9, help="fail below this ratio")
    p.add_argument("--timeout", type=float, default=900.0, help="deadline for the whole run (s)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for both sides (default: one fewer than the cores, at least 1)",
    )
    p.add_argument("--quick", action="store_true", help="a smaller workload (smoke test)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument(
        "--burst",
        action="store_true",
        help="the burst scenario instead (below): 16 clients arrive while 4 streams decode",
    )
    p.add_argument(
        "--step-latency-target-ms",
        type=float,
        default=None,
        help="burst: the server's --step-latency-target-ms (default: serve's own default)",
    )
    args = p.parse_args()
    if args.max_tokens is None:
        args.max_tokens = 16 if args.quick else 64
    if args.threads is None:
        args.threads = max(1, len(os.sched_getaffinity(0)) - 1)
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if not 0 <= args.disconnect < 1:
        p.error("--disconnect is a fraction in [0, 1)")
    return args


def conversations(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    system = {"role": "system", "content": SYSTEM * args.system_repeat}
    return [
        [system, {"role": "user", "content": f"Question {i}: what does block {i} hold?"}]
        for i in range(args.clients)
    ]


# -- the server --------------------------------------------------------------------------------


def start_server(
    args: argparse.Namespace, workdir: str, deadline: float, extra: list[str] = ()
) -> ServerProcess:
    flags = ["--block-size", str(args.block_size)] if args.block_size is not None else []
    flags += ["--model", args.model] if args.model else []
    return launch_server([*flags, *extra], workdir, deadline, args.threads, f"server{len(extra)}")


async def one_client(
    http: aiohttp.ClientSession, url: str, messages, max_tokens: int, leave_after: int | None
) -> dict:
    """One streaming chat request; ``leave_after``: close the stream after that many chunks."""
    body = chat_body(messages, max_tokens)
    t0 = time.perf_counter()
    first = None
    events = 0  # server-sent events so far: the role chunk, one per piece of text, the end
    tail = b""
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.read())[:200]!r}"}
        # The load generator stays light (it shares the CPUs with the server): aiohttp's C
        # parser, and it counts events, parsing only the last ones (finish reason, usage).
        async for data in r.content.iter_any():
            events += data.count(b"data: ")
            tail = (tail + data)[-8192:]
            if first is None and events >= 2:
                first = time.perf_counter() - t0
            if leave_after is not None and events > leave_after:
                r.close()  # a disconnect: the connection is dropped, not reused
                return {"left": True, "chunks": events - 1}
    usage = reason = None
    for line in tail.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:  # cut off at the tail's start
            continue
        if "error" in event:
            return {"error": event["error"]["message"]}
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            reason = choice["finish_reason"] or reason
    return {"reason": reason, "usage": usage, "ttft": first, "latency": time.perf_counter() - t0}


async def clients(url: str, convs, max_tokens: int, leavers: set[int], timeout: float):
    connector = aiohttp.TCPConnector(limit=len(convs) + 8)
    timeouts = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeouts) as http:
        t0 = time.perf_counter()
        leave = max(1, max_tokens // 4)
        results = await asyncio.wait_for(
            asyncio.gather(
                *(
                    one_client(http, url, m, max_tokens, leave if i in leavers else None)
                    for i, m in enumerate(convs)
                )
            ),
            timeout,
        )
        return results, time.perf_counter() - t0


# -- the run -----------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.burst:
        burst_main(args)
        return
    if args.block_size is None:
        args.block_size = 16
    deadline = time.monotonic() + args.timeout
    threads = set_threads(args.threads)
    convs = conversations(args)
    n_tokens = args.clients * args.max_tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    failures: list[str] = []

    llm = LLM(args.model, block_size=args.block_size)
    prompts = [llm.chat_prompt(m) for m in convs]
    llm.generate([llm.chat_prompt(convs[0][:1])], greedy)  # warm: the system prompt is cached

    with tempfile.TemporaryDirectory(prefix="bench_serve.") as work:
        server = start_server(args, work, deadline)
        try:
            asyncio.run(clients(server.url, convs[:1], args.max_tokens, set(), 300))  # warm
            base_times, serve_times, ttfts = [], [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, greedy)
                base_times.append(time.perf_counter() - t0)
                assert all(len(o["token_ids"]) == args.max_tokens for o in outs)
                results, elapsed = asyncio.run(
                    clients(server.url, convs, args.max_tokens, set(), deadline - time.monotonic())
                )
                serve_times.append(elapsed)
                bad = [r for r in results if r.get("reason") != "length"]
                if bad:
                    failures.append(f"{len(bad)} clients did not complete: {bad[0]}")
                for r, p in zip(results, prompts):
                    u = r.get("usage") or {}
                    if (u.get("prompt_tokens"), u.get("completion_tokens")) != (
                        len(p),
                        args.max_tokens,
                    ):
                        failures.append(f"usage {u} != ({len(p)}, {args.max_tokens})")
                        break
                ttfts += [r["ttft"] for r in results if r.get("ttft") is not None]
            base_tps, serve_tps = n_tokens / min(base_times), n_tokens / min(serve_times)
            ratio = serve_tps / base_tps
            if ratio < args.min_ratio:
                failures.append(f"throughput ratio {ratio:.3f} < {args.min_ratio}")

            after = settled(server, 30.0)
            cached = after["vllm:prefix_cache_hits_total"]
            used = after["nanokv:kv_cache_blocks{state=used}"]
            running = after["vllm:num_requests_running"] + after["vllm:num_requests_waiting"]
            if running or used or not cached:
                failures.append(f"after the load: {running} in flight, {used} used, hits {cached}")

            # Disconnects: every len/k-th client leaves mid-stream.
            n_leave = round(args.clients * args.disconnect)
            leavers = set(range(0, args.clients, max(1, args.clients // max(1, n_leave))))
            leavers = set(sorted(leavers)[:n_leave])
            aborts0 = after.get("vllm:request_success_total{finished_reason=abort}", 0.0)
            results, _ = asyncio.run(
                clients(server.url, convs, args.max_tokens, leavers, deadline - time.monotonic())
            )
            left = sum(1 for r in results if r.get("left"))
            completed = sum(1 for r in results if r.get("reason") == "length")
            if left != n_leave or completed != args.clients - n_leave:
                failures.append(f"disconnect run: {left} left, {completed} completed")
            final = settled(server, 30.0)
            aborts = final.get("vllm:request_success_total{finished_reason=abort}", 0.0) - aborts0
            used2 = final["nanokv:kv_cache_blocks{state=used}"]
            running2 = final["vllm:num_requests_running"] + final["vllm:num_requests_waiting"]
            if aborts != n_leave or used2 or running2:
                failures.append(
                    f"after disconnects: {aborts:.0f} aborted of {n_leave}, {running2} in "
                    f"flight, {used2} blocks used"
                )
            code = server.stop(timeout=max(10.0, deadline - time.monotonic()))
            if code != 0:
                failures.append(f"SIGTERM: exit status {code}")
        finally:
            server.kill()

    queries = final["vllm:prefix_cache_queries_total"]
    result = {
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "prompt_tokens": [len(p) for p in prompts[:1]][0],
        "block_size": args.block_size,
        "threads": threads,
        "generate_tok_s": base_tps,
        "serve_tok_s": serve_tps,
        "ratio": ratio,
        "generate_times_s": base_times,
        "serve_times_s": serve_times,
        "client_ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "prefix_cache_hits": cached,
        "prefix_cache_hit_rate": final["vllm:prefix_cache_hits_total"] / queries if queries else 0,
        "disconnected": n_leave,
        "aborted": aborts,
        "sigterm_exit": code,
        "failures": failures,
    }
    lines = [
        f"nanokv serve vs LLM.generate: {args.clients} streaming clients x {args.max_tokens} "
        f"tokens, shared system prompt ({result['prompt_tokens']} prompt tokens each), block "
        f"size {args.block_size}, {threads} threads, best of {args.repeat}",
        f"  LLM.generate        {base_tps:8.1f} tok/s   ({', '.join(f'{t:.2f}' for t in base_times)} s)",
        f"  nanokv serve        {serve_tps:8.1f} tok/s   ({', '.join(f'{t:.2f}' for t in serve_times)} s)"
        f", client TTFT p50 {result['client_ttft_p50_s'] * 1e3:.0f} ms",
        f"  ratio serve/generate {ratio:7.3f}   (required >= {args.min_ratio})",
        f"  after the load: {running:.0f} in flight, {used:.0f} blocks used, "
        f"{cached:.0f} prefix-cache hit tokens",
        f"  disconnects: {left} of {args.clients} left mid-stream, {completed} completed, "
        f"{aborts:.0f} aborted; then {running2:.0f} in flight, {used2:.0f} blocks used",
        f"  SIGTERM: exit {code}",
        "  OK" if not failures else "  FAILED: " + "; ".join(failures),
    ]
    emit(result, args.json, lines)
    sys.exit(1 if failures else 0)


# -- the burst scenario ---------------------------------------------------------------------
#
# 4 streams decode; then 16 clients sharing a system prompt start together. On today's fixed
# token budget one step takes every new prompt (seconds on a CPU) and the 4 streams freeze;
# under the step budget a step takes only what keeps it near its latency target. One server
# per setting, in the same run: the default settings, and the budget switched off (0).

BURST_STREAMS, BURST_CLIENTS, QUIET_TOKENS = 4, 16, 40


async def timed_stream(http, url: str, messages, max_tokens: int, stop: asyncio.Event) -> dict:
    """One streaming chat request: the arrival time of each text chunk (until ``stop``) and
    its prompt's tokens (from the usage chunk)."""
    body = chat_body(messages, max_tokens)
    times: list[float] = []
    tail = b""
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}: {(await r.read())[:200]!r}")
        seen = 0
        async for data in r.content.iter_any():
            now = time.perf_counter()
            seen += data.count(b'"content"')
            # The first event carries the role (no content): token chunks are the rest.
            times += [now] * max(0, seen - len(times) - 1)
            tail = (tail + data)[-4096:]
            if stop.is_set():
                r.close()  # the scenario is over: this stream leaves (and is aborted)
                break
    m = re.search(rb'"prompt_tokens": ?(\d+)', tail)
    return {"times": times, "prompt_tokens": int(m.group(1)) if m else 0}


async def burst_run(url: str, args, system: str, new_tokens: int) -> dict:
    def chat(i: int) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {i}: what does block {i} hold?"},
        ]

    connector = aiohttp.TCPConnector(limit=64)
    timeouts = aiohttp.ClientTimeout(total=args.timeout)
    stop_old, never = asyncio.Event(), asyncio.Event()
    async with aiohttp.ClientSession(connector=connector, timeout=timeouts) as http:
        old = [
            asyncio.create_task(timed_stream(http, url, chat(100 + i), 4000, stop_old))
            for i in range(BURST_STREAMS)
        ]
        # The quiet phase: the streams decode alone until each has QUIET_TOKENS tokens. The
        # tasks' lists fill in as chunks arrive, so poll the server's count instead.
        start = time.perf_counter()
        while time.perf_counter() - start < 0.05 * QUIET_TOKENS + 60:
            await asyncio.sleep(0.05)
            done = httpx.get(f"{url}/metrics", timeout=30).text
            m = re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)", done, re.M)
            if m and float(m.group(1)) >= BURST_STREAMS * (QUIET_TOKENS + 5):
                break
        burst_start = time.perf_counter()
        new = await asyncio.gather(
            *(timed_stream(http, url, chat(i), new_tokens, never) for i in range(BURST_CLIENTS))
        )
        burst_end = time.perf_counter()
        stop_old.set()
        old_times = [r["times"] for r in await asyncio.gather(*old)]
    prompt_tokens = sum(r["prompt_tokens"] for r in new)
    new = [r["times"] for r in new]
    quiet, during = [], []
    for times in old_times:
        for a, b in zip(times, times[1:]):
            if b <= burst_start:
                quiet.append(b - a)
            elif a >= burst_start - 1.0 and b <= burst_end:
                during.append(b - a)
    quiet = quiet[len(quiet) // 4 :]  # past the streams' own first tokens
    ttft = [t[0] - burst_start for t in new if t]
    new_itl = [b - a for t in new for a, b in zip(t, t[1:])]
    generated = sum(len(t) for t in new) + sum(
        sum(1 for x in t if burst_start <= x <= burst_end) for t in old_times
    )
    return {
        "quiet_itl_s": percentiles(quiet),
        "burst_itl_s": percentiles(during),
        "burst_max_gap_s": max(during, default=0.0),
        "new_ttft_s": percentiles(ttft),
        "new_itl_s": percentiles(new_itl),
        "burst_s": burst_end - burst_start,
        "generated_tokens": generated,
        "prompt_tokens": prompt_tokens,
        # Tokens computed in the burst window: the new prompts and every token generated.
        "tokens_per_s": (prompt_tokens + generated) / (burst_end - burst_start),
    }


def percentiles(values: list[float]) -> dict[str, float]:
    from nanokv_cli.run.stats import percentiles as pct

    return pct(values)


def burst_main(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.timeout
    new_tokens = 16 if args.quick else 64
    system = SYSTEM * args.system_repeat
    settings = {
        "default": []
        if args.step_latency_target_ms is None
        else ["--step-latency-target-ms", str(args.step_latency_target_ms)],
        "fixed budget": ["--step-latency-target-ms", "0"],
    }
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench_serve.") as work:
        for name, extra in settings.items():
            server = start_server(args, work, deadline, extra)
            try:
                asyncio.run(
                    clients(server.url, [[{"role": "user", "content": "hi"}]], 4, set(), 300)
                )
                runs[name] = asyncio.run(burst_run(server.url, args, system, new_tokens))
            finally:
                server.kill()
    base, new = runs["fixed budget"], runs["default"]
    ratio = new["tokens_per_s"] / base["tokens_per_s"]
    quiet = new["quiet_itl_s"]["p50"]
    failures = []
    if new["burst_itl_s"]["p99"] > 3 * quiet:
        failures.append(
            f"running streams' p99 ITL {new['burst_itl_s']['p99'] * 1e3:.0f} ms > 3x quiet"
        )
    if new["burst_max_gap_s"] > 2.0:
        failures.append(f"a stream waited {new['burst_max_gap_s']:.2f} s")
    if ratio < 0.9:
        failures.append(f"tokens/s ratio {ratio:.3f} < 0.9")
    ms = lambda p: f"p50 {p['p50'] * 1e3:7.1f} ms, p99 {p['p99'] * 1e3:7.1f} ms"  # noqa: E731
    lines = [
        f"burst: {BURST_CLIENTS} clients sharing a system prompt arrive while {BURST_STREAMS} "
        f"streams decode ({new_tokens} tokens each); default settings vs the fixed budget",
    ]
    for name, run in (("default", new), ("fixed budget", base)):
        lines += [
            f"  {name}:",
            f"    running streams  quiet ITL {ms(run['quiet_itl_s'])}",
            f"                     burst ITL {ms(run['burst_itl_s'])}, longest wait "
            f"{run['burst_max_gap_s'] * 1e3:.0f} ms",
            f"    new clients      TTFT      {ms(run['new_ttft_s'])}",
            f"                     ITL       {ms(run['new_itl_s'])}",
            f"    burst            {run['burst_s']:.2f} s, {run['tokens_per_s']:.0f} tokens/s (prompt + generated)",
        ]
    lines += [
        f"  running streams' burst p99 / quiet p50: {new['burst_itl_s']['p99'] / quiet:.2f}x "
        "(required <= 3)",
        f"  tokens/s default / fixed budget: {ratio:.3f} (required >= 0.9)",
        "  OK" if not failures else "  FAILED: " + "; ".join(failures),
    ]
    emit({"runs": runs, "ratio": ratio, "failures": failures}, args.json, lines)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
