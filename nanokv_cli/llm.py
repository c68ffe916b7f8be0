"""The user-facing Python API: ``LLM(model).generate(prompts, sampling_params)``."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from .engine.config import EngineConfig
from .engine.core import tier_hits
from .engine.core.llm_engine import LLMEngine, RequestOutput, RequestRejected
from .engine.model.loader import load_model
from .engine.parallel import distributed
from .engine.runner.model_runner import ModelRunner
from .engine.runner.run_plan import RunPlan, resolve_machine
from .engine.sampling_params import SamplingParams
from .engine.tiers.model_tier import check_tier_device, open_model_tier

Prompt = str | list[int]


class LLM:
    """A model on a paged KV cache.

    ``model`` is a Hugging Face folder, a ``.gguf`` file, or None for the default
    SmolLM2-135M-Instruct. The engine's settings are an ``EngineConfig`` (``config``), or its
    field names as keywords (``LLM(model, block_size=16, num_blocks=64)``), or both: keywords
    override the config's fields. After loading, ``engine_config`` holds what runs, with
    ``max_model_len`` resolved against the model's own limit.

    On CPU the cache size comes from ``num_blocks`` or the ``kv_cache_memory`` budget in bytes;
    on GPU from ``gpu_memory_utilization``.

    ``tensor_parallel_size=N`` splits the model over N processes (this one is rank 0 and
    schedules and samples; N-1 workers are spawned, or the ranks of an existing torchrun
    group are used: see ``nanokv_cli.engine.parallel.distributed``). Cache sizes are per rank. Call
    ``shutdown()`` (or use ``with LLM(...) as llm:``) to stop the workers; interpreter exit
    does it too.

    ``quantization="auto"`` (the default) runs a GGUF file's own quantized blocks (Q4_0, Q4_1,
    Q8_0) as they are, each held once in a layout that serves every batch size (CPU, one
    rank): ~3x faster single-sequence decoding than float32 in a sixth of the memory. Every
    row's projection inputs are rounded to 16 bits per 32 values, decode and prompt rows alike,
    so a sequence's greedy tokens do not depend on what shares its steps. Other models and devices run as ``"none"``. ``"int8"`` or
    ``"int4"`` quantize every layer (a file's 4-bit blocks stay 4-bit). None or ``"none"``
    computes in float32 end to end. After loading, ``quantization`` says what runs ("auto",
    "int8", "int4" or None). See ``engine/model/quantize.py``.
    """

    def __init__(
        self, model: str | None = None, *, config: EngineConfig | None = None, **settings: Any
    ) -> None:
        config = EngineConfig(**settings) if config is None else replace(config, **settings)
        size = config.tensor_parallel_size
        # Fails fast (before loading anything) when this process cannot host that many ranks.
        mode = distributed.parallel_mode(size)
        # Checked before loading too, so a bad value or device fails at once. Each rank of a
        # tensor-parallel run resolves its own (its device).
        machine = resolve_machine(config, tp_size=size)
        check_tier_device(config.tier_spec, machine.device)
        loaded = load_model(model)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.source
        self.tensor_parallel_size = size
        self.kv_tier_note: str | None = None  # the tier's start-up line (kv_tier), if any
        self.rank = 0  # tensor-parallel rank: only rank 0 schedules, samples and generates
        # The engine is not thread-safe: generate/stream calls take turns on it.
        self._stream_lock = threading.Lock()
        self._stream_thread: int | None = None
        if mode == "single":
            plan = machine.for_model(loaded.config, config, loaded.blocks)
            config = _resolved(config, plan)
            self.model_runner = ModelRunner(
                loaded.config, loaded.weights, plan, quantized_blocks=loaded.blocks
            )
            self.executor = self.model_runner
            # The second tier (kv_tier): opened once the cache exists, as its fingerprint
            # names the cache's layout; a tier that cannot be opened leaves a note, no tier.
            runner = self.model_runner
            runner.tier, self.kv_tier_note = open_model_tier(
                config.tier_spec,
                config.tier_bandwidth(),
                runner.kv_cache,
                loaded.source,
                plan.dtype,
                plan.quantization,
            )
        else:
            rank = distributed.process_rank()
            executor = distributed.start_tensor_parallel(loaded, config)
            if executor is None:  # a worker rank of a torchrun group: rank 0 has shut down
                self.rank = rank
                self.model_runner = self.executor = self.engine = None
                self.engine_config, self.max_model_len = config, None
                return
            self.executor = executor
            self.model_runner = executor.runner  # rank 0's shard
            config = _resolved(config, executor.runner.plan)
        del loaded
        # What runs: "auto" is None where the file has no blocks a CPU format holds.
        self.quantization = self.model_runner.plan.quantization
        self.engine_config = config
        self.max_model_len = config.max_model_len
        self.engine = LLMEngine(self.executor, config, eos_token_ids=self.config.eos_token_ids)
        # The tier outlives the process: at shutdown (or interpreter exit, for a command
        # that never calls it) the cache's blocks go to it, then its file is let go.
        tier = self.model_runner.tier
        self._tier_closer = (
            weakref.finalize(self, _close_tier, self.engine.block_manager, tier)
            if tier is not None
            else None
        )

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and release their process groups, and close the
        second tier (``kv_tier``) after storing the cache's blocks in it (what a restart
        finds), so another process may open its file.

        Idempotent. A tensor-parallel LLM cannot generate afterwards; one whose tier is closed
        runs on without it (its stores and restores fail as misses).
        """
        stop = getattr(self.executor, "shutdown", None)
        if stop is not None:
            stop()
        closer = getattr(self, "_tier_closer", None)
        if closer is not None:  # the cache's blocks stored; another process may open the file
            closer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_step: Callable[[], None] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt index, output)`` each time a request gets a token.

        All prompts are encoded and admitted (or rejected) before the first step, so a bad
        request fails before any work is done; with several prompts, the error names the
        prompt ("prompt 2: ..."). Engine events go to ``self.engine.events``; ``on_step`` is
        called after each step's outputs were taken (a live view's ``tick``).
        Calls from several threads take turns (the engine steps one batch at a time); a call
        from inside another's loop on the same thread is refused, as it could only deadlock.
        """
        if self.engine is None:
            raise RuntimeError(
                f"this process is tensor-parallel rank {self.rank}: only rank 0 generates"
            )
        if self._stream_thread == threading.get_ident():
            raise RuntimeError(
                "LLM.generate/stream called while this thread is still iterating another "
                "stream of the same LLM; finish (or close) that one first"
            )
        with self._stream_lock:
            self._stream_thread = threading.get_ident()
            try:
                yield from self._stream(prompts, sampling_params, on_step)
            finally:
                self._stream_thread = None

    def _stream(self, prompts, sampling_params, on_step) -> Iterator[tuple[int, RequestOutput]]:
        from .run.loop import Arrivals, Driver, EngineClock, Request

        if isinstance(prompts, str):
            prompts = [prompts]
        params = _broadcast(sampling_params, len(prompts))
        requests = [
            Request(self.encode(p), sp, tag=i) for i, (p, sp) in enumerate(zip(prompts, params))
        ]

        def rejected(req: Request, error: RequestRejected) -> None:
            if len(requests) == 1:
                raise error
            raise RequestRejected(f"prompt {req.tag + 1}: {error}") from None

        clock = EngineClock(self.engine)
        # Every request admitted before the first step: a bad one raises before any work.
        driver = Driver(self.engine, clock, max_waiting=math.inf, on_rejected=rejected)
        try:
            for outputs in driver.run(Arrivals(requests, start=clock())):
                for out in outputs:
                    yield driver.requests[out.seq_id].tag, out
                if on_step is not None:
                    on_step()
        finally:
            # An interrupted stream must not leave requests holding blocks in the engine.
            driver.abort_all()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[dict]:
        """Run every prompt to completion; one dict per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        results: list[RequestOutput | None] = [None] * len(prompts)
        for i, out in self.stream(prompts, sampling_params):
            if out.finished:
                results[i] = out
        return [self._as_dict(out) for out in results]

    def _as_dict(self, out: RequestOutput) -> dict:
        return output_dict(out, self.tokenizer.decode(out.token_ids))


def output_dict(out: RequestOutput, text: str) -> dict[str, Any]:
    """One finished request as ``LLM.generate`` and ``nanokv generate --json`` give it."""

    def since_arrival(t: float | None) -> float | None:
        return None if t is None else t - out.arrival_time

    return {
        "text": text,
        "token_ids": list(out.token_ids),
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_output_tokens": len(out.token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "finish_reason": out.finish_reason,
        "ttft_s": since_arrival(out.first_token_time),
        "latency_s": since_arrival(out.finish_time),
    }


def _close_tier(block_manager, tier) -> None:
    """Store the cache's blocks in the tier (tier_hits.flush), then close it."""
    try:
        tier_hits.flush(block_manager)
    finally:
        tier.close()


def _resolved(config: EngineConfig, plan: RunPlan) -> EngineConfig:
    """``config`` with what the plan resolved against the model: its length limit and the
    quantization that runs."""
    return replace(config, max_model_len=plan.max_model_len, quantization=plan.quantization)


def _broadcast(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
    return list(sampling_params)
