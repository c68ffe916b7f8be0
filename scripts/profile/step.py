"""Where a decode step's time goes, in µs per step, on the default model at default settings.

N sequences decode together through ``LLM.engine.step()`` (greedy, EOS ignored) while each part
of the step is timed where it runs (issue 32):

- ``schedule``: the scheduler and the block manager's books;
- ``prepare``: the runner's Python that lays out the batch (token ids, slots, block tables);
- ``decoder``: the model's forward pass (one recorded C program on the CPU kernels). Split
  further, by timing its parts alone on the same inputs: ``attention`` (the paged attention
  kernel, every layer) and ``weights at bandwidth`` (the bytes of weights the step multiplies
  by, over the read bandwidth measured here: the floor no code change can go under);
- ``lm head`` and ``sampler``;
- ``events``: the engine's listeners (the block map every view reads, ``CacheState``);
- ``detokenize``: each new token's text, as ``generate`` and ``serve`` stream it;
- ``live view``: the Rich live view's event handling and one frame, rendered to a null
  console (a terminal draws a few frames a second, not one a step);
- ``engine rest``: what ``step()`` takes beyond its timed parts (outputs, snapshots, Python).

    python scripts/profile/step.py --threads 1 --batch 1 64
    python scripts/profile/step.py --json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

from common import decode_bytes, read_bandwidth  # noqa: E402

from nanokv_cli import LLM, SamplingParams  # noqa: E402
from nanokv_cli.engine.core.events import CacheState
from nanokv_cli.engine.cpu import kernels as cpu_kernels  # noqa: E402


class Timers:
    """Seconds per named part, summed over the timed steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


class _TimedSampler:
    """The runner's sampler, its calls timed (its other methods pass through)."""

    def __init__(self, sampler, timers: Timers) -> None:
        self.sampler, self.timed = sampler, timers.wrap("sampler", sampler.__call__)

    def __call__(self, *args):
        return self.timed(*args)

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)


def instrument(llm: LLM, timers: Timers, last: dict[str, Any]) -> Callable[[], None]:
    """Wrap the parts of ``llm``'s step in timers (instance attributes, so nothing else sees
    them); ``last["batch"]`` holds the latest step's batch. Returns what undoes it."""
    engine, runner, model = llm.engine, llm.model_runner, llm.model_runner.model
    prepare = runner._prepare

    def keep_batch(seqs):
        last["batch"] = prepare(seqs)
        return last["batch"]

    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    runner._prepare = timers.wrap("prepare", keep_batch)
    runner._forward = timers.wrap("decoder", runner._forward)
    model.compute_logits = timers.wrap("lm head", model.compute_logits)
    sampler, runner.sampler = runner.sampler, _TimedSampler(runner.sampler, timers)
    state = CacheState(engine.num_blocks)
    unsubscribe = engine.events.subscribe(timers.wrap("events", state.apply))

    def undo() -> None:
        unsubscribe()
        for obj, name in ((engine.scheduler, "schedule"), (runner, "_prepare"),
                          (runner, "_forward"), (model, "compute_logits")):  # fmt: skip
            delattr(obj, name)
        runner.sampler = sampler

    return undo


def attention_seconds(llm: LLM, batch, repeats: int = 5) -> float:
    """The paged attention kernel alone, every layer, on a step's own inputs (best of
    ``repeats``): the decoder's attention share."""
    runner, config = llm.model_runner, llm.config
    paged = batch.meta.paged_decode
    rows = paged.block_tables.shape[0]
    heads, dim = config.num_attention_heads, config.head_dim
    q = torch.randn(rows, heads, dim)
    out = torch.empty_like(q)
    layer = runner.attention_layers[0]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in runner.attention_layers:
            cpu_kernels.paged_decode(
                q,
                layer.k_cache,
                layer.v_cache,
                paged.block_tables,
                paged.context_lens,
                dim**-0.5,
                out,
            )
        best = min(best, time.perf_counter() - start)
    return best


def profile(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
    """µs per step of each part, over ``steps`` decode steps of ``batch`` sequences."""
    engine, tokenizer = llm.engine, llm.tokenizer
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 4)
    prompts = [[(7 * i + 13 * j) % 9000 + 100 for i in range(prompt_len)] for j in range(batch)]
    for p in prompts:
        engine.add_request(p, params)
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill first: the timed steps are decode steps
    engine.step()  # a warm-up decode step (it records the step program)
    timers, last = Timers(), {}
    undo = instrument(llm, timers, last)
    from rich.console import Console

    from nanokv_cli.views.live import LiveView

    console = Console(file=io.StringIO(), width=120, force_terminal=True)
    view = LiveView(engine.num_blocks, engine.block_size, console=console)
    unsubscribe = engine.events.subscribe(timers.wrap("live view", view.on_event))
    walls, attention = [], []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        walls.append(time.perf_counter() - start)
        detok_start = time.perf_counter()
        for out in outputs:
            tokenizer.decode(out.token_ids[-1:])
        timers.seconds["detokenize"] += time.perf_counter() - detok_start
        view_start = time.perf_counter()
        console.print(view.render())
        console.file.seek(0)
        console.file.truncate()
        timers.seconds["live view"] += time.perf_counter() - view_start
        attention.append(attention_seconds(llm, last["batch"]))
    unsubscribe()
    undo()
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(seq.seq_id)
    per_step = {k: v / steps * 1e6 for k, v in timers.seconds.items()}
    inside = ("schedule", "prepare", "decoder", "lm head", "sampler", "events")
    # The live view's listener runs inside step(); its frames after it.
    wall = statistics.mean(walls) * 1e6
    # The LM head and the sampler run inside the decoder's timer's caller, not inside it.
    per_step["engine rest"] = wall - sum(per_step[k] for k in inside if k in per_step)
    per_step["attention"] = statistics.mean(attention) * 1e6
    return {"batch": batch, "step_us": wall, "parts_us": per_step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(enable_prefix_caching=False, threads=args.threads)
    if not llm.model_runner.plan.fused_decoder:
        sys.exit("the C kernels are not built here: nothing to split (nanokv doctor says why)")
    threads = llm.model_runner.threads
    bandwidth = read_bandwidth(threads)
    results = []
    for batch in args.batch:
        r = profile(llm, batch, args.prompt_len, args.steps)
        weights = decode_bytes(llm, 0)
        r["parts_us"]["weights at bandwidth"] = weights / bandwidth * 1e6
        results.append(r)
    report = {"threads": threads, "read_bytes_per_s": bandwidth, "runs": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"default model, quantization auto, {threads} thread(s), prompt {args.prompt_len} "
        f"tokens, {args.steps} decode steps; read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    order = [
        "schedule", "prepare", "decoder", "attention", "weights at bandwidth", "lm head",
        "sampler", "events", "engine rest", "detokenize", "live view",
    ]  # fmt: skip
    for r in results:
        parts = r["parts_us"]
        print(
            f"\nbatch {r['batch']}: step {r['step_us']:9.0f} µs ({r['batch'] / r['step_us'] * 1e6:.1f} tok/s)"
        )
        for name in order:
            share = parts[name] / r["step_us"]
            note = "  (inside decoder, timed alone)" if name in ("attention",) else ""
            note = "  (the floor of decoder + lm head)" if name == "weights at bandwidth" else note
            print(f"  {name:22s} {parts[name]:9.0f} µs {share:6.1%}{note}")


if __name__ == "__main__":
    main()
