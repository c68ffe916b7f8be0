"""Two nanokv servers behind a prefix router, against round-robin.

Starts two ``nanokv serve`` processes, each publishing its KV events over ZMQ
(``--kv-events-config``, vLLM's wire format), and NVIDIA Dynamo's standalone KV indexer
(``python -m dynamo.indexer``, from ai-dynamo-runtime) subscribed to both through its HTTP API
(``/register``). Then it sends one workload twice, to a fresh pair of servers each time:

- **round-robin**: request i goes to server i mod 2;
- **prefix**: the router asks the indexer ``/query`` how many leading tokens of the prompt each
  server holds, and sends the request to the one holding most (ties: fewer requests in flight,
  then round-robin).

The workload: 4 system prompts of about 140 tokens, 6 questions each, shuffled with a fixed
seed; greedy, 8 tokens out, sent one at a time (so the run is deterministic). The router
tokenizes as the servers do (the model's chat template, from nanokv's tokenizer) and sends the
token ids to ``/v1/completions``, as Dynamo's frontend sends tokens to its workers: the indexer
is asked about exactly the tokens the server gets.

Settings: the default model (SmolLM2-135M-Instruct), ``--block-size 16 --num-blocks 24
--threads 1`` per server. 24 blocks hold two system prompts (9 blocks each) with room for the
questions, not four: round-robin makes each server see all four groups and evict, the prefix
router gives each server two. It prints each server's and the overall prefix cache hit rate,
read from the servers' ``/metrics`` (``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``, counted over the workload only). About 15 s on two cores.

    python examples/two_servers.py            # the whole run
    python examples/two_servers.py --quick    # 2 system prompts x 3 questions: a smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from nanokv_cli.engine.model.loader import load_tokenizer
from nanokv_cli.serve.process import ServerProcess

BLOCK_SIZE = 16
NUM_BLOCKS = 24
MAX_TOKENS = 8
MODEL_NAME = "default"  # the indexer's name for the model; any string both sides agree on
START_TIMEOUT = 180.0

PERSONAS = [
    ("Ada", "a patient tutor of algebra", "explains each step with a small worked example"),
    ("Basil", "a gardener who grows tomatoes", "talks about soil, water and sunlight"),
    ("Cleo", "a ship's navigator", "reasons about tides, stars, charts and headings"),
    ("Dmitri", "a bakery owner", "thinks in flour, ovens, proofing times and early mornings"),
]
QUESTIONS = [
    "What should I learn first?",
    "What is a common mistake?",
    "How long does it take to get good?",
    "What tool matters most?",
    "Can you give me one tip for today?",
    "What would you do differently?",
]


def system_prompt(name: str, who: str, style: str) -> str:
    """About 140 tokens, distinct from the first token on (no block shared across groups)."""
    lines = [
        f"{name} speaks here: you are {name}, {who}, and you {style}.",
        f"{name} answers in one short sentence, plainly, without lists or headings.",
        f"{name} never invents facts; when unsure, {name} says so and suggests where to look.",
        f"{name} keeps a warm tone, uses simple words, and avoids jargon unless asked.",
        f"Every answer from {name} stays on the topic of the question that was asked.",
        f"{name} remembers that the person asking is a beginner who wants practical advice.",
        f"{name} prefers concrete examples from daily work over abstract explanations.",
        f"If a question is unclear, {name} answers the most likely meaning in one sentence.",
    ]
    return " ".join(lines)


def workload(groups: int, per_group: int, seed: int = 0) -> list[tuple[int, list[dict]]]:
    """(group, chat messages) pairs: ``groups`` system prompts x ``per_group`` questions,
    interleaved by a seeded shuffle."""
    requests = [
        (
            g,
            [
                {"role": "system", "content": system_prompt(*PERSONAS[g])},
                {"role": "user", "content": q},
            ],
        )
        for g in range(groups)
        for q in QUESTIONS[:per_group]
    ]
    random.Random(seed).shuffle(requests)
    return requests


# -- processes ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], log: Path, children: list[subprocess.Popen], **kw) -> subprocess.Popen:
    """Start ``cmd`` with its output in ``log``, listed in ``children`` at once (so a Ctrl-C
    that lands while it starts still finds it to stop)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, **kw)
    children.append(proc)
    return proc


def stop_all(children: list[subprocess.Popen], grace: float = 20.0) -> None:
    """SIGTERM (a server finishes in-flight requests and exits), then kill what lingers; a
    second Ctrl-C during the wait kills at once."""
    try:
        for proc in children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in children:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@dataclass
class Server:
    """One ``nanokv serve`` on a free port, publishing KV events on free loopback ports."""

    name: str
    workdir: Path
    threads: int
    process: ServerProcess = field(init=False)
    events: str = field(init=False)
    replay: str = field(init=False)

    @property
    def url(self) -> str:
        return self.process.url

    def start(self, children: list[subprocess.Popen]) -> None:
        """Start it (``ServerProcess``: ready once ``/health`` answers; a start cut short by
        Ctrl-C kills it) and list it in ``children``, to be stopped with the fleet."""
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:*",  # a free port, printed by serve
            "replay_endpoint": "tcp://127.0.0.1:*",
            "topic": "kv-events",
        }
        args = ["--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS)]
        args += ["--threads", str(self.threads), "--no-live"]
        args += ["--kv-events-config", json.dumps(config)]
        env = {"OMP_NUM_THREADS": str(self.threads)}
        self.process = ServerProcess(args, self.workdir, env, name=self.name, timeout=START_TIMEOUT)
        children.append(self.process.proc)
        m = self.process.wait_for(r"KV events on (\S+) \(.*replay on (\S+)\)", START_TIMEOUT)
        self.events, self.replay = m.group(1), m.group(2)

    def complete(self, client: httpx.Client, tokens: list[int]) -> int:
        """One greedy completion of ``tokens``; the prompt tokens it found cached."""
        body = {"prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = client.post(f"{self.url}/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def counters(self, client: httpx.Client) -> tuple[float, float]:
        """(prefix cache hits, queries) in tokens, from /metrics."""
        text = client.get(f"{self.url}/metrics").text

        def total(name: str) -> float:
            values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            if not values:
                raise RuntimeError(f"{self.url}/metrics has no {name}")
            return sum(float(v) for v in values)

        return total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} never answered; the log:\n{log.read_text()}")


class Indexer:
    """Dynamo's standalone KV indexer: workers register over HTTP, ``/query`` answers each
    worker's overlap with a prompt, in tokens, from the events it received."""

    def __init__(self, workdir: Path, children: list[subprocess.Popen]) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = workdir / "indexer.log"
        cmd = [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"]
        self.proc = spawn(cmd, log, children)
        wait_healthy(f"{self.url}/workers", self.proc, log)

    def register(self, client: httpx.Client, worker: int, server: Server) -> None:
        body = {"instance_id": worker, "endpoint": server.events}
        body |= {"replay_endpoint": server.replay, "model_name": MODEL_NAME}
        client.post(
            f"{self.url}/register", json={**body, "block_size": BLOCK_SIZE}
        ).raise_for_status()

    def overlap(self, client: httpx.Client, tokens: list[int]) -> dict[int, int]:
        """Leading prompt tokens each worker holds (workers holding none are absent)."""
        r = client.post(f"{self.url}/query", json={"token_ids": tokens, "model_name": MODEL_NAME})
        r.raise_for_status()
        return {int(w): ranks.get("0", 0) for w, ranks in r.json()["scores"].items()}


def attach(client: httpx.Client, indexer: Indexer, worker: int, server: Server) -> None:
    """Register ``server`` and wait until the indexer's subscription is live (a ZMQ SUB that
    joins late misses the first batches): a probe prompt of its own shows up in ``/query``."""
    indexer.register(client, worker, server)
    for attempt in range(50):
        probe = [1, worker, attempt] + [7] * (2 * BLOCK_SIZE)  # shares no block with the workload
        server.complete(client, probe)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if indexer.overlap(client, probe).get(worker):
                return
            time.sleep(0.05)
    raise RuntimeError(f"the indexer never received {server.name}'s KV events")


# -- routing ------------------------------------------------------------------------------------


def run_policy(policy: str, prompts: list[list[int]], workdir: Path, threads: int) -> list[tuple]:
    """Start a fresh fleet, send ``prompts`` in order under ``policy``; per server
    (name, hits, queries, requests) over the workload."""
    servers = [Server(f"{policy}-{i}", workdir, threads) for i in range(2)]
    children: list[subprocess.Popen] = []
    try:
        indexer = Indexer(workdir, children)
        for s in servers:
            s.start(children)
        with httpx.Client(timeout=120) as client:
            for worker, s in enumerate(servers):
                attach(client, indexer, worker, s)
            before = [s.counters(client) for s in servers]
            sent, ties = [0, 0], 0
            for i, tokens in enumerate(prompts):
                target = i % 2
                if policy == "prefix":
                    overlap = indexer.overlap(client, tokens)
                    best = max(overlap.get(w, 0) for w in range(2))
                    tied = [w for w in range(2) if overlap.get(w, 0) == best]
                    # One request at a time: none in flight, so ties go round-robin.
                    if len(tied) > 1:
                        target, ties = tied[ties % len(tied)], ties + 1
                    else:
                        target = tied[0]
                servers[target].complete(client, tokens)
                sent[target] += 1
            after = [s.counters(client) for s in servers]
        return [
            (f"server {w}", a[0] - b[0], a[1] - b[1], sent[w])
            for w, (b, a) in enumerate(zip(before, after))
        ]
    finally:
        stop_all(children)


def report(policy: str, rows: list[tuple]) -> float:
    """Print each server's hit rate and the overall one; return the overall one."""
    overall = (
        "overall",
        sum(r[1] for r in rows),
        sum(r[2] for r in rows),
        sum(r[3] for r in rows),
    )
    for name, hits, queries, n in [*rows, overall]:
        print(f"  {policy:<12} {name + ':':<9} {n:>2} requests, hit rate {hits / queries:6.1%}")
    return overall[1] / overall[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="2 system prompts x 3 questions")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per server")
    args = parser.parse_args()
    groups, per_group = (2, 3) if args.quick else (4, 6)
    tokenizer = load_tokenizer()

    def tokens(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    prompts = [tokens(m) for _, m in workload(groups, per_group)]
    print(
        f"{len(prompts)} requests ({groups} system prompts x {per_group} questions, "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens), 2 servers of "
        f"{NUM_BLOCKS} blocks x {BLOCK_SIZE} tokens"
    )
    start = time.monotonic()
    rates = {}
    with tempfile.TemporaryDirectory(prefix="nanokv-two-servers-") as tmp:
        for policy in ["round-robin", "prefix"]:
            rows = run_policy(policy, prompts, Path(tmp), args.threads)
            rates[policy] = report(policy, rows)
    rr, px = rates["round-robin"], rates["prefix"]
    print(f"prefix routing: {px:.1%} of prompt tokens from cache, round-robin {rr:.1%}", end="")
    print(f" ({px / rr:.2f}x)")
    print(f"({time.monotonic() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C does: run_policy's finally stops the fleet.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        main()
    except KeyboardInterrupt:  # the fleet is already stopped by run_policy's finally
        sys.exit(130)
