"""What token-granular prefix reuse buys: hit rate and time to first token, whole blocks against
token-granular at the default block size, and both against the token-level bound.

On the default model, one request at a time (as a user sends them), each workload runs three
times in this process: block size 256 with ``prefix_match="block"`` (the seed's whole blocks,
nanokv's behaviour before token-granular reuse), block size 256 with ``"token"`` (the default
now), and block size 1 (every token its own block: the token-level bound on the same engine).
Time to first token is measured on the real clock, per request, with ``--threads`` threads.

Workloads: ``examples/prompts.jsonl``; 10 prompts sharing a ~400-token policy with a variable
line after it; a two-turn chat (turn 2 carries turn 1's real answer); the serving page's
example (a ~360-token system prompt, two questions).

A second part checks the duplicate rule on a model-free dry run: prompts that are prefixes of
one another, sequential, in a small cache, with the newest copy of a duplicate serving its hash
(the engine) against the first copy serving it (the rule before, as a subclass here).

    python scripts/bench/reuse.py                # everything (a few minutes at 1 thread)
    python scripts/bench/reuse.py --skip-model   # the duplicate rule only, no model
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import ROOT  # noqa: E402

from nanokv_cli import LLM, SamplingParams  # noqa: E402
from nanokv_cli.engine.block_manager import BlockManager  # noqa: E402
from nanokv_cli.engine.config import EngineConfig  # noqa: E402
from nanokv_cli.engine.core.dry_run import DryRunExecutor, VirtualClock  # noqa: E402
from nanokv_cli.engine.core.llm_engine import LLMEngine  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
POLICY = (
    "Support policy. Answer only from this policy. Refunds are possible within thirty days "
    "with a receipt; store credit without one. Opened software cannot be returned. Shipping "
    "is free above fifty euros and takes three to five working days; express costs twelve "
    "euros and arrives the next working day when ordered before noon. Warranty claims need "
    "the serial number and a description of the fault; we reply within two working days. "
) * 5


def workloads(llm: LLM) -> dict[str, list[list[int]]]:
    lines = [json.loads(x) for x in (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()]
    examples = [
        llm.chat_prompt(r["messages"]) if "messages" in r else llm.encode(r["prompt"])
        for r in lines
    ]
    policy = [
        llm.encode(POLICY + f"\nCustomer {i} (order {1000 + 37 * i}): " + q)
        for i, q in enumerate(["Can I return opened software?", "How long does shipping take?"] * 5)
    ]
    system = {"role": "system", "content": "You are a concise assistant. " * 60}
    serving = [
        llm.chat_prompt([system, {"role": "user", "content": q}])
        for q in ["What is a KV cache?", "What is prefix caching?"]
    ]
    chat = []
    for topic in ["paged attention", "a block table", "prefix caching", "preemption"]:
        first = [system, {"role": "user", "content": f"Explain {topic} in one sentence."}]
        answer = llm.generate([llm.chat_prompt(first)], GREEDY)[0]["text"]
        second = [*first, {"role": "assistant", "content": answer}]
        second.append({"role": "user", "content": "And why does it matter?"})
        chat += [llm.chat_prompt(first), llm.chat_prompt(second)]
    return {
        "examples/prompts.jsonl": examples,
        "policy x10": policy,
        "two-turn chat": chat,
        "serving page": serving,
    }


def run(prompts: list[list[int]], threads: int, block_size: int, match: str) -> dict:
    llm = LLM(
        block_size=block_size,
        prefix_match=match,
        threads=threads,
        num_blocks=max(64, 65536 // block_size),
    )
    ttft = []
    for p in prompts:
        start, first = time.perf_counter(), None
        for _ in llm.stream([p], GREEDY):
            if first is None:
                first = time.perf_counter() - start
        ttft.append(first)
    stats = llm.engine.block_manager.stats
    return {"hit_rate": stats.hit_rate, "copied": stats.copied_hits, "ttft": ttft}


def model_part(threads: int) -> None:
    probe = LLM(threads=threads, num_blocks=64)
    work = workloads(probe)
    del probe
    print(f"one request at a time, default model, {threads} thread(s); TTFT mean over requests")
    head = f"{'workload':24} {'block 256':>10} {'token 256':>10} {'bound':>8} {'token/bound':>12}"
    print(head + f" {'TTFT block':>11} {'TTFT token':>11} {'ratio':>6}")
    for name, prompts in work.items():
        block = run(prompts, threads, 256, "block")
        token = run(prompts, threads, 256, "token")
        bound = run(prompts, threads, 1, "token")
        tb, tt = statistics.mean(block["ttft"]), statistics.mean(token["ttft"])
        ratio = token["hit_rate"] / bound["hit_rate"] if bound["hit_rate"] else float("nan")
        print(
            f"{name:24} {block['hit_rate']:>10.1%} {token['hit_rate']:>10.1%} "
            f"{bound['hit_rate']:>8.1%} {ratio:>12.3f} {tb * 1000:>9.0f}ms {tt * 1000:>9.0f}ms "
            f"{tt / tb:>6.2f}"
        )


class FirstCopyServes(BlockManager):
    """The duplicate rule before: a block whose hash is already cached stays unregistered."""

    def hash_blocks(self, seq) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start = seq.num_cached_tokens // bs
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // bs
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            h = self._block_hash(seq, i)
            if block.hash != -1 or h in self.hash_to_block_id:
                continue  # a hit, or a duplicate: the first copy keeps serving
            tokens, parent = seq.block(i), seq.block_hashes[i - 1] if i else -1
            self._explainer.stored(h, parent, tokens[0])
            block.update(h, tokens)
            self.hash_to_block_id[h] = block.block_id
        self._explainer.progressed(self, seq, start, end)


def duplicate_part() -> None:
    rng = random.Random(0)
    bs = 16
    pool = [[rng.randrange(50000) for _ in range(bs * 6)] for _ in range(6)]
    prompts = [rng.choice(pool)[: bs * rng.randint(1, 6)] for _ in range(400)]
    print("\nduplicates: 400 prompts that are prefixes of 6 others, one at a time, block size 16")
    print(f"{'num_blocks':>10} {'first copy serves':>18} {'newest serves':>14} {'ratio':>6}")
    for num_blocks in (24, 32, 48):
        rates = []
        for cls in (FirstCopyServes, BlockManager):
            cfg = EngineConfig(
                num_blocks=num_blocks, block_size=bs, max_num_seqs=1, prefix_match="block"
            )
            clock = VirtualClock()
            engine = LLMEngine(DryRunExecutor(cfg, vocab_size=50000, clock=clock), cfg, clock=clock)
            engine.block_manager.__class__ = cls
            for p in prompts:
                engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
                while engine.has_unfinished_requests():
                    engine.step()
            engine.block_manager.check_invariants([])
            rates.append(engine.block_manager.stats.hit_rate)
        print(f"{num_blocks:>10} {rates[0]:>18.2%} {rates[1]:>14.2%} {rates[1] / rates[0]:>6.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-model", action="store_true", help="only the model-free part")
    args = ap.parse_args()
    if not args.skip_model:
        model_part(args.threads)
    duplicate_part()


if __name__ == "__main__":
    main()
