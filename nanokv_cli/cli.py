"""The ``nanokv`` command line: generate, replay, inspect.

Commands drive the engine through its public API (``LLMEngine.add_request/step``, its event
bus, ``RequestOutput``) and learn about the cache only from events, like any other client.
torch is imported only where a model runs, so ``--dry-run`` and ``inspect`` work without it.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from . import __version__
from .driver import (
    EngineClock,
    PromptEncoder,
    RunError,
    build_requests,
    dry_run_engine,
    encode_prompts,
)
from .engine.block_manager import PREFIX_MATCH_MODES
from .engine.config import EngineConfig

# The loader imports torch only when weights are read: dry runs and inspect stay light.
from .engine.loader import ModelLoadError, default_model_path, load_tokenizer
from .engine.sampling_params import SamplingParams
from .fleet import RouterName
from .fleet_report import FleetOptionError, check_fleet_options
from .kv_events import KVEventsConfig, parse_kv_events_config
from .paths import check_model_path, check_outputs
from .prompts import FORMATS, MAX_LINE_CHARS, PromptFile, PromptRequest, read_prompts

DEFAULT_BLOCK_SIZE = EngineConfig.block_size
DEFAULT_MAX_TOKENS = 64
# Dry-run cache when --num-blocks is not given: the same number of tokens for every block
# size, so a block-size comparison compares layouts, not memory.
DRY_RUN_CACHE_TOKENS = 1 << 18

app = typer.Typer(
    name="nanokv",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


class CliError(Exception):
    """A problem with the user's input or environment: one line on stderr, exit 1."""


# Exceptions that mean "the input was wrong", not "nanokv has a bug": shown as one line.
# ValueError covers the engine's RequestRejected, MalformedTraceError, UnsupportedModelError,
# TokenizerError and SamplingParams' checks; OSError covers missing and unreadable files.
# MemoryError: the input asked for more than the machine has (the message says how much).
USER_ERRORS: tuple[type[BaseException], ...] = (
    CliError,
    ValueError,
    OSError,
    ModelLoadError,
    MemoryError,
)


@contextmanager
def user_errors(debug: bool) -> Iterator[None]:
    """Turn user errors into one line and exit 1, Ctrl-C into exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        print("nanokv: interrupted", file=sys.stderr)
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except Exception as e:
        if not isinstance(e, USER_ERRORS) and not _is_worker_failure(e):
            raise
        if debug:
            raise
        print(f"nanokv: error: {_one_line(e)}", file=sys.stderr)
        raise typer.Exit(1) from None


def _is_worker_failure(e: Exception) -> bool:
    """A tensor-parallel worker died: the user's environment, not a nanokv bug."""
    dist = sys.modules.get("nanokv_cli.engine.distributed")  # loaded only with a TP model
    return dist is not None and isinstance(e, dist.TensorParallelError)


def _one_line(e: BaseException) -> str:
    if isinstance(e, MemoryError):
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return "out of memory" + (f" ({detail})" if detail else "")
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"{e.filename}: no such file"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename or ''}: {e.strerror}".lstrip(": ")
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# -- flag values -------------------------------------------------------------------------------


def parse_int_list(value: str, flag: str, minimum: int = 1) -> list[int]:
    """``"16,64,256"`` -> [16, 64, 256]; anything else is a usage error."""
    try:
        values = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"expected integers separated by commas, got {value!r}", param_hint=flag
        ) from None
    if not values:
        raise typer.BadParameter("no value given", param_hint=flag)
    if any(v < minimum for v in values):
        raise typer.BadParameter(f"values must be >= {minimum}, got {value!r}", param_hint=flag)
    return list(dict.fromkeys(values))


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(value: str, flag: str = "--kv-cache-memory") -> int:
    """``"512MiB"``, ``"2GB"``, ``"1.5g"``, ``"1048576"`` -> bytes."""
    m = _SIZE.match(value)
    if not m:
        raise typer.BadParameter(
            f"expected a size such as 512MiB or 2GB, got {value!r}", param_hint=flag
        )
    number, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    power = "kmgt".index(unit) + 1 if unit else 0
    size = int(number * (1024 if binary or not unit else 1000) ** power)
    if size <= 0:
        raise typer.BadParameter(f"the size must be positive, got {value!r}", param_hint=flag)
    return size


def parse_rate(value: str | None) -> float | None:
    """Requests per second; ``inf`` sends everything at once. None: keep the file's timing."""
    if value is None:
        return None
    try:
        rate = float(value)
    except ValueError:
        raise typer.BadParameter(
            f"expected requests per second or 'inf', got {value!r}", param_hint="--rate"
        ) from None
    if not rate > 0:
        raise typer.BadParameter(f"the rate must be > 0, got {value!r}", param_hint="--rate")
    return rate


def sampling_defaults(**fields: Any) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:  # the message starts with the field: name its flag
        name = str(e).split(" ", 1)[0]
        flag = f"--{name.replace('_', '-')}" if name in fields else None
        raise typer.BadParameter(str(e), param_hint=flag) from None


def want_live(live: bool | None, json_out: bool) -> bool:
    """Live view: as asked, else on when stdout is a terminal and no JSON is wanted."""
    if live is not None:
        return live
    return not json_out and sys.stdout.isatty() and os.environ.get("TERM") != "dumb"


# -- models and tokenizers ---------------------------------------------------------------------


def model_label(model: str | None) -> str:
    return str(Path(model).expanduser().resolve()) if model else default_model_path()


# PromptEncoder lives in the driver (prompt encoding is part of running requests).


# -- output ------------------------------------------------------------------------------------


def stdout_console() -> Console:
    return Console(highlight=False)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def print_json(obj: Any) -> None:
    from .report import json_text  # NaN and infinities as null: JSON has neither

    sys.stdout.write(json_text(obj))
    sys.stdout.flush()


def _version_callback(value: bool) -> None:
    if value:
        print(f"nanokv {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            callback=_version_callback,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """Run LLMs on a paged KV cache with prefix caching, and watch the cache work.

    **Examples**

    ```
    nanokv generate "The capital of France is"
    nanokv replay prompts.jsonl --record run.trace
    nanokv replay trace.jsonl --dry-run --block-size 16,64,256
    nanokv inspect run.trace --step 120
    nanokv advise prompts.jsonl         # how to raise the hit rate, each gain measured
    nanokv doctor                       # what this install and machine give nanokv
    ```
    """


# Options shared by generate and replay -------------------------------------------------------

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Hugging Face model folder or .gguf file. [default: SmolLM2-135M-Instruct]",
    ),
]
MaxTokensOpt = Annotated[int, typer.Option(min=1, help="Most tokens to generate per prompt.")]
TemperatureOpt = Annotated[float, typer.Option(min=0.0, help="Sampling temperature; 0 is greedy.")]
TopPOpt = Annotated[
    float,
    typer.Option(
        min=0.0, max=1.0, help="Nucleus sampling: keep the top tokens holding this probability."
    ),
]
TopKOpt = Annotated[int, typer.Option(min=0, help="Keep only the k most likely tokens (0: all).")]
SeedOpt = Annotated[int | None, typer.Option(help="Random seed for sampling.")]
ChatOpt = Annotated[
    bool, typer.Option("--chat", help="Wrap plain prompts in the model's chat template.")
]
IgnoreEosOpt = Annotated[
    bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence tokens.")
]
NumBlocksHelp = "KV cache size in blocks."
KvMemoryOpt = Annotated[
    str | None,
    typer.Option(
        "--kv-cache-memory",
        help="KV cache size as memory, e.g. 512MiB or 2GB (instead of --num-blocks).",
    ),
]
NoPrefixOpt = Annotated[bool, typer.Option("--no-prefix-cache", help="Turn prefix caching off.")]
PrefixMatchOpt = Annotated[
    str,
    typer.Option(
        "--prefix-match",
        metavar="token|block",
        help="How far prefix reuse reaches: token (past the last whole cached block, the "
        "leading tokens shared with a cached block are copied) or block (whole blocks only, "
        "the seed's accounting).",
    ),
]
MaxSeqsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-num-seqs",
        min=1,
        help=f"Most sequences per step. [default: {EngineConfig.max_num_seqs}]",
        show_default=False,
    ),
]
MaxBatchedOpt = Annotated[
    int | None,
    typer.Option(
        "--max-num-batched-tokens",
        min=1,
        help="Token budget per step (chunked prefill). "
        f"[default: {EngineConfig.max_num_batched_tokens}]",
        show_default=False,
    ),
]
# serve's step latency target (ms): the shortest that keeps 90% of the fixed budget's tokens/s
# in bench_serve.py's burst on a 2-core CPU (60 ms: 71%, 100 ms: 83%, 200 ms: 97%), and a burst
# then slows running streams (longest wait 0.4 s) instead of freezing them (3.5 s).
SERVE_STEP_LATENCY_MS = 200.0
StepLatencyOpt = Annotated[
    float | None,
    typer.Option(
        "--step-latency-target-ms",
        min=0,
        help="While sequences decode, a step takes only the prompt tokens that keep it under "
        "this many milliseconds (at costs measured as the run goes), so streams never freeze "
        "behind a burst of prompts; 0: up to the token budget. [default: off; serve: "
        f"{SERVE_STEP_LATENCY_MS:g}]",
        show_default=False,
    ),
]
MaxModelLenOpt = Annotated[
    int | None, typer.Option("--max-model-len", min=1, help="Longest prompt + output allowed.")
]
DTYPES = ("auto", "float32", "bfloat16", "float16")
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        help=f"Weights and KV dtype: {', '.join(DTYPES)}. "
        "[default: auto: float32 on CPU, bfloat16 (else float16) on CUDA]",
        show_default=False,
    ),
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(help="cpu, cuda or cuda:N. [default: cuda if available]", show_default=False),
]
TensorParallelOpt = Annotated[
    int | None,
    typer.Option(
        "--tensor-parallel-size",
        min=1,
        help="Split the model over N processes (tensor parallelism): gloo on CPU, NCCL with "
        "one GPU per rank. Heads, KV heads and vocabulary must divide by N (SmolLM2-135M: 3).",
        show_default=False,
    ),
]
QUANTIZATIONS = ("auto", "none", "int8", "int4")
QuantizationOpt = Annotated[
    str,
    typer.Option(
        help="Quantized weights on CPU. auto: a GGUF's own Q4/Q8 blocks, held once, serve "
        "every step (~6x faster single-stream decoding than float32, the file's size in "
        "memory); K/V in float16 (as llama.cpp); none: float32 only; int8, int4: every layer "
        "quantized at load. [default: auto]",
        show_default=False,
    ),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="CPU threads for the model (per rank with --tensor-parallel-size). "
        "[default: the CPUs this process may run on]",
        show_default=False,
    ),
]
LiveOpt = Annotated[
    bool | None,
    typer.Option(
        "--live/--no-live",
        help="Live cache view. [default: on when stdout is a terminal]",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON instead of text.")
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the full traceback of errors.")]


_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


def check_model_flags(
    dtype: str | None, device: str | None, quantization: str | None = None
) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise typer.BadParameter(
            f"choose from {', '.join(QUANTIZATIONS)}, got {quantization!r}",
            param_hint="--quantization",
        )
    if dtype is not None and dtype not in DTYPES:
        raise typer.BadParameter(
            f"choose from {', '.join(DTYPES)}, got {dtype!r}", param_hint="--dtype"
        )
    if device is not None and not _DEVICE.match(device):
        raise typer.BadParameter(
            f"expected cpu, cuda or cuda:N, got {device!r}", param_hint="--device"
        )


def engine_config_from_flags(
    *,
    block_size: int,
    num_blocks: int | None,
    kv_cache_memory: str | None,
    no_prefix_cache: bool,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    max_model_len: int | None,
    dtype: str | None,
    device: str | None,
    tensor_parallel_size: int | None,
    quantization: str | None,
    threads: int | None,
    step_latency_target_ms: float | None = None,
    prefix_match: str = "token",
) -> EngineConfig:
    """The engine settings of a command's flags (generate, replay and serve share them).

    Flags left at None keep EngineConfig's defaults. Checked before anything loads: a bad value
    is a usage error naming its flag or setting.
    """
    check_model_flags(dtype, device, quantization)
    if prefix_match not in PREFIX_MATCH_MODES:
        raise typer.BadParameter(
            f"choose from {', '.join(PREFIX_MATCH_MODES)}, got {prefix_match!r}",
            param_hint="--prefix-match",
        )
    given = {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "kv_cache_memory": parse_size(kv_cache_memory) if kv_cache_memory else None,
        "enable_prefix_caching": not no_prefix_cache,
        "prefix_match": prefix_match,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": max_model_len,
        "dtype": dtype,
        "device": device,
        "tensor_parallel_size": tensor_parallel_size,
        "quantization": quantization,
        "threads": threads,
        "step_latency_target_ms": step_latency_target_ms or None,
    }
    try:
        return EngineConfig(**{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        # EngineConfig's messages start with the setting's name: name its flag instead.
        name = re.match(r"\w+", str(e))
        flag = f"--{name.group().replace('_', '-')}" if name and name.group() in given else None
        raise typer.BadParameter(str(e), param_hint=flag) from None


def make_llm(model: str | None, config: EngineConfig):
    """The model and its engine."""
    from .llm import LLM

    llm = LLM(model, config=config)
    if llm.rank != 0:
        # A torchrun worker rank: LLM() returned once rank 0 finished; it has nothing to print.
        raise typer.Exit(0)
    if llm.model_runner.device.type == "cpu":
        from .engine.cpu import kernels

        status = kernels.status()
        if status.lib is None and not status.switched_off:
            print(f"nanokv: note: {status.missing} (`nanokv doctor` says more)", file=sys.stderr)
    return llm


# -- generate ----------------------------------------------------------------------------------


@app.command()
def generate(
    prompts: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="PROMPT",
            help="Prompts to complete; `-` reads one prompt from stdin.",
            show_default=False,
        ),
    ] = None,
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = DEFAULT_MAX_TOKENS,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    chat: ChatOpt = False,
    ignore_eos: IgnoreEosOpt = False,
    block_size: Annotated[
        int, typer.Option(min=1, help="Tokens per KV block.")
    ] = DEFAULT_BLOCK_SIZE,
    num_blocks: Annotated[int | None, typer.Option(min=1, help=NumBlocksHelp)] = None,
    kv_cache_memory: KvMemoryOpt = None,
    no_prefix_cache: NoPrefixOpt = False,
    prefix_match: PrefixMatchOpt = "token",
    max_num_seqs: MaxSeqsOpt = None,
    max_num_batched_tokens: MaxBatchedOpt = None,
    step_latency_target_ms: StepLatencyOpt = None,
    max_model_len: MaxModelLenOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    tensor_parallel_size: TensorParallelOpt = None,
    quantization: QuantizationOpt = "auto",
    threads: ThreadsOpt = None,
    live: LiveOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Generate text, streaming it as it comes, with a live view of the KV cache.

    **Examples**

    ```
    nanokv generate "The capital of France is"
    nanokv generate --chat "Write a haiku about caches" --max-tokens 40
    echo "Once upon a time" | nanokv generate - --no-live
    nanokv generate "a" "b" --json
    ```
    """
    texts = _prompt_args(prompts)
    defaults = sampling_defaults(
        temperature=temperature,
        max_tokens=max_tokens,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        ignore_eos=ignore_eos,
    )
    engine_config = engine_config_from_flags(
        block_size=block_size,
        num_blocks=num_blocks,
        kv_cache_memory=kv_cache_memory,
        no_prefix_cache=no_prefix_cache,
        prefix_match=prefix_match,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        step_latency_target_ms=step_latency_target_ms,
        max_model_len=max_model_len,
        dtype=dtype,
        device=device,
        tensor_parallel_size=tensor_parallel_size,
        quantization=quantization,
        threads=threads,
    )
    with user_errors(debug):
        check_model_path(model)
        llm = make_llm(model, engine_config)
        results = _run_generate(llm, texts, defaults, chat, want_live(live, json_out), json_out)
        if json_out:
            print_json(results)


def _prompt_args(prompts: list[str] | None) -> list[str]:
    if not prompts:
        raise typer.BadParameter(
            "give at least one PROMPT, or - to read one from stdin", param_hint="PROMPT"
        )
    if "-" in prompts:
        if len(prompts) > 1:
            raise typer.BadParameter(
                "- (stdin) cannot be mixed with other prompts", param_hint="PROMPT"
            )
        text = _read_stdin(MAX_LINE_CHARS)
        text = text[:-1] if text.endswith("\n") else text
        if not text.strip():
            raise typer.BadParameter("stdin held no prompt", param_hint="PROMPT")
        prompts = [text]
    for i, text in enumerate(prompts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # argv decodes bytes that are not UTF-8 as surrogates
            raise typer.BadParameter(
                f"prompt {i + 1} is not UTF-8 text (at character {e.start})", param_hint="PROMPT"
            ) from None
    return prompts


def _read_stdin(max_chars: int) -> str:
    """stdin up to ``max_chars`` (a prompt, not /dev/zero); more is a usage error."""
    try:
        text = sys.stdin.read(max_chars + 1)
    except UnicodeDecodeError:
        raise typer.BadParameter("stdin is not UTF-8 text", param_hint="PROMPT") from None
    if len(text) > max_chars:
        raise typer.BadParameter(
            f"stdin holds more than {max_chars:,} characters; that is no prompt",
            param_hint="PROMPT",
        )
    return text


def _run_generate(
    llm, texts: list[str], defaults: SamplingParams, chat: bool, live: bool, json_out: bool
) -> list[dict[str, Any]]:
    from .driver import Arrivals, Driver, Request, live_view
    from .engine.tokenizer import IncrementalDecoder

    engine, tokenizer = llm.engine, llm.tokenizer
    encoder = PromptEncoder(None, chat, tokenizer=tokenizer, max_prompt_tokens=llm.max_model_len)
    clock = EngineClock(engine)
    index: dict[int, int] = {}  # seq_id -> prompt index

    def on_rejected(req, error: Exception) -> None:
        prefix = f"prompt {req.tag + 1}: " if len(texts) > 1 else ""
        raise RunError(f"{prefix}{error}")

    driver = Driver(
        engine,
        clock,
        max_waiting=math.inf,  # every prompt is admitted (or rejected) before the first step
        on_added=lambda seq_id, req: index.__setitem__(seq_id, req.tag),
        on_rejected=on_rejected,
    )
    source = Arrivals(
        [Request(encoder.text(text), defaults, 0.0, tag=i) for i, text in enumerate(texts)],
        start=clock(),
    )
    driver.admit(source)
    decoders = [IncrementalDecoder(tokenizer) for _ in texts]
    pieces: list[list[str]] = [[] for _ in texts]
    finals: list[Any] = [None] * len(texts)
    streaming = not live and not json_out
    printer = _OrderedPrinter(texts) if streaming else None
    t0 = time.perf_counter()
    with ExitStack() as stack:
        view = None
        if live:
            view = stack.enter_context(
                live_view(
                    engine,
                    stdout_console(),
                    title="nanokv generate",
                    total_requests=len(texts),
                    show_text=True,
                    transient=True,
                )
            )
        for outputs in driver.run(source):
            for out in outputs:
                i = index[out.seq_id]
                piece = "".join(decoders[i].add(t) for t in out.new_token_ids)
                if out.finished:
                    piece += decoders[i].flush()
                    finals[i] = out
                pieces[i].append(piece)
                if view is not None:
                    view.set_text(out.seq_id, "".join(pieces[i]))
                if printer is not None:
                    printer.add(i, piece, out.finished)
            if view is not None:
                view.tick()
    elapsed = time.perf_counter() - t0
    results = [_generate_result(texts[i], "".join(pieces[i]), finals[i]) for i in range(len(texts))]
    if live and not json_out:
        _print_texts(texts, results)
    if not json_out:
        _print_generate_summary(results, elapsed)
    return results


class _OrderedPrinter:
    """Streams outputs to stdout in prompt order: the first one live, each next one as soon
    as those before it are complete."""

    def __init__(self, texts: list[str]) -> None:
        self.queue = list(range(len(texts)))
        self.texts = texts
        self.pending: list[list[str]] = [[] for _ in texts]
        self.done: set[int] = set()
        self.many = len(texts) > 1
        self.open: int | None = None  # the prompt whose header is written
        self.printed = 0

    def add(self, i: int, piece: str, finished: bool) -> None:
        self.pending[i].append(piece)
        if finished:
            self.done.add(i)
        while self.queue:
            head = self.queue[0]
            if self.open != head:
                self._header(head)
            sys.stdout.write("".join(self.pending[head]))
            self.pending[head].clear()
            if head not in self.done:
                break
            sys.stdout.write("\n")
            self.queue.pop(0)
        sys.stdout.flush()

    def _header(self, i: int) -> None:
        if self.many:
            sep = "\n" if self.printed else ""
            sys.stdout.write(f"{sep}--- {self.texts[i]!r}\n")
        self.open = i
        self.printed += 1


def _generate_result(prompt: str, text: str, out) -> dict[str, Any]:
    ttft = out.first_token_time - out.arrival_time if out.first_token_time is not None else None
    return {
        "prompt": prompt,
        "text": text,
        "token_ids": list(out.token_ids),
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_output_tokens": len(out.token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "finish_reason": out.finish_reason,
        "ttft_s": ttft,
        "latency_s": out.finish_time - out.arrival_time if out.finish_time is not None else None,
    }


def _print_texts(texts: list[str], results: list[dict[str, Any]]) -> None:
    for i, r in enumerate(results):
        if len(results) > 1:
            sys.stdout.write(f"{chr(10) if i else ''}--- {texts[i]!r}\n")
        sys.stdout.write(r["text"] + "\n")
    sys.stdout.flush()


def _print_generate_summary(results: list[dict[str, Any]], elapsed: float) -> None:
    n_out = sum(r["num_output_tokens"] for r in results)
    n_prompt = sum(r["num_prompt_tokens"] for r in results)
    n_cached = sum(r["num_cached_tokens"] for r in results)
    rate = n_out / elapsed if elapsed > 0 else 0.0
    hit_rate = n_cached / n_prompt if n_prompt else 0.0
    stderr_console().print(
        f"[dim]{n_out} tokens in {elapsed:.2f} s ({rate:.1f} tok/s) · prompt {n_prompt} tokens, "
        f"{n_cached} from the prefix cache (hit rate {hit_rate:.1%})[/dim]"
    )


# -- replay ------------------------------------------------------------------------------------


class ReplayInterrupted(Exception):
    """Ctrl-C during a replay; carries the report of what had finished by then."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__("interrupted")
        self.report = report


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda done: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr_console(), transient=True) as bar:
        task = bar.add_task("replay", total=total)
        yield lambda done: bar.update(task, completed=done)


def run_replay(
    engine,
    clock,
    requests: list,
    *,
    config: dict[str, Any],
    latencies: bool,
    live: bool,
    progress: bool,
    record: Path | None,
    per_request: Path | None = None,
    infinite=None,
    transient: bool = False,
    label: str | None = None,
) -> dict[str, Any]:
    """Replay ``requests`` on ``engine`` to the end; return the run's report."""
    from .driver import Run

    with Run(
        engine,
        clock,
        config=config,
        latencies=latencies,
        record=record,
        per_request=per_request,
        infinite=infinite,
    ) as run:
        return _run_replay(
            run, requests, live=live, progress=progress, transient=transient, label=label
        )


def _run_replay(
    run, requests: list, *, live: bool, progress: bool, transient: bool, label: str | None
) -> dict[str, Any]:
    from .driver import Arrivals, Driver, live_view

    engine, config = run.engine, run.config
    rejected: list[str] = []

    def on_rejected(req, error: Exception) -> None:
        rejected.append(f"line {req.tag}: {error}")
        if len(rejected) <= 3:
            where = f" ({label})" if label else ""
            print(
                f"nanokv: skipped {config['file']} line {req.tag}{where}: {error}", file=sys.stderr
            )

    driver = Driver(
        engine,
        run.clock,
        on_added=lambda seq_id, req: run.tag(seq_id, line=req.tag),
        on_rejected=on_rejected,
    )
    with ExitStack() as stack:
        view = None
        if live:
            view = stack.enter_context(
                live_view(
                    engine,
                    stdout_console(),
                    title=f"nanokv replay {Path(config['file']).name}",
                    total_requests=len(requests),
                    transient=transient,
                )
            )
        advance = stack.enter_context(_progress(len(requests), progress and not live))
        tick = view.tick if view is not None else None
        try:
            # Arrival times count from the run's start (a model engine's clock has run since
            # it was built).
            for outputs in driver.run(Arrivals(requests, start=run.start)):
                run.observe(outputs)
                if outputs:
                    advance(run.stats.finished)
                if tick is not None:
                    tick()
        except KeyboardInterrupt:
            report = run.report(rejected=len(rejected), interrupted=True)
            raise ReplayInterrupted(report) from None
    if len(rejected) > 3:
        where = f" ({label})" if label else ""
        print(f"nanokv: skipped {len(rejected)} requests in all{where}", file=sys.stderr)
    if rejected and not run.stats.requests:
        raise CliError(f"every request was rejected; the first: {rejected[0]}")
    return run.report(rejected=len(rejected), interrupted=False)


@app.command("replay")
def replay_cmd(
    file: Annotated[
        Path,
        typer.Argument(metavar="FILE", help="Prompt file or request trace.", show_default=False),
    ],
    fmt: Annotated[
        str, typer.Option("--format", help=f"File format: {', '.join(FORMATS)}.", show_default=True)
    ] = "auto",
    model: ModelOpt = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="No model: accounting only, on a virtual clock (no torch)."),
    ] = False,
    block_size: Annotated[
        str, typer.Option(help="Tokens per KV block; with --dry-run a list such as 16,64,256.")
    ] = str(DEFAULT_BLOCK_SIZE),
    num_blocks: Annotated[
        str | None,
        typer.Option(
            help=f"KV cache size in blocks; with --dry-run a list such as 100,1000. "
            f"[default: dry run {DRY_RUN_CACHE_TOKENS:,} tokens' worth, model: sized from memory]",
            show_default=False,
        ),
    ] = None,
    kv_cache_memory: KvMemoryOpt = None,
    no_prefix_cache: NoPrefixOpt = False,
    prefix_match: PrefixMatchOpt = "token",
    max_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens to generate for requests that don't say.")
    ] = DEFAULT_MAX_TOKENS,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    ignore_eos: IgnoreEosOpt = False,
    chat: ChatOpt = False,
    rate: Annotated[
        str | None,
        typer.Option(
            help="Send requests as a Poisson process of this many per second ('inf': all at once). "
            "[default: the file's timestamps, else all at once]",
            show_default=False,
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(min=1, help="Replay only the first N requests.")
    ] = None,
    max_num_seqs: MaxSeqsOpt = None,
    max_num_batched_tokens: MaxBatchedOpt = None,
    step_latency_target_ms: StepLatencyOpt = None,
    max_model_len: MaxModelLenOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    tensor_parallel_size: TensorParallelOpt = None,
    quantization: QuantizationOpt = "auto",
    threads: ThreadsOpt = None,
    live: LiveOpt = None,
    json_out: JsonOpt = False,
    report: Annotated[
        Path | None, typer.Option(help="Write the report as JSON to this file.")
    ] = None,
    record: Annotated[
        Path | None,
        typer.Option(help="Write every cache event to this trace file (for `nanokv inspect`)."),
    ] = None,
    per_request: Annotated[
        Path | None,
        typer.Option(
            "--per-request",
            help="Write one JSON line per finished request: prompt and cached tokens, "
            "why the rest missed, latencies.",
        ),
    ] = None,
    instances: Annotated[
        int,
        typer.Option(
            "--instances",
            min=1,
            help="Fleet what-if (with --dry-run): N engines of --num-blocks each behind "
            "--router, on one virtual timeline; reports per-instance and fleet hit rates "
            "against one engine with N times the blocks, and the misses cached on another "
            "instance (elsewhere).",
        ),
    ] = 1,
    router: Annotated[
        RouterName | None,
        typer.Option(
            "--router",
            help="Fleet routing policy: round-robin; least-loaded (fewest unfinished requests, "
            "then prompt tokens); prefix (Dynamo's KV router: lowest w * prefill_blocks + "
            "decode_blocks, prefill_blocks = (tokens still to prefill there + prompt tokens - "
            "cached prefix blocks there * block size) / block size, decode_blocks = blocks of "
            "its unfinished requests + this prompt's, w = overlap_score_weight = 1.0). With "
            "--instances 1 it runs the fleet report for one engine. [default: round-robin]",
            show_default=False,
        ),
    ] = None,
    debug: DebugOpt = False,
) -> None:
    """Replay a prompt file or a request trace and report throughput, latency and cache hits.

    Formats (detected from the content): plain text, one prompt per line; JSONL with
    `{"prompt"}`, `{"messages"}` or `{"prompt_token_ids"}` per line, plus optional
    temperature / max_tokens / top_p / top_k / seed / ignore_eos / timestamp; ShareGPT JSON;
    Mooncake traces (`{"timestamp", "input_length", "output_length", "hash_ids"}`).

    **Examples**

    ```
    nanokv replay prompts.txt --max-tokens 32
    nanokv replay prompts.jsonl --record run.trace --report run.json
    nanokv replay mooncake.jsonl --dry-run --limit 500 --block-size 16,64,256 --num-blocks 2000,8000
    nanokv replay mooncake.jsonl --dry-run --rate 5 --json
    nanokv replay prompts.jsonl --per-request requests.jsonl   # why each request hit or missed
    nanokv replay mooncake.jsonl --dry-run --instances 4 --router prefix   # a fleet what-if
    ```
    """
    block_sizes = parse_int_list(block_size, "--block-size")
    sizes = parse_int_list(num_blocks, "--num-blocks") if num_blocks else None
    if dry_run and sizes:
        check_dry_run_memory(max(sizes))
    rate_value = parse_rate(rate)
    defaults = sampling_defaults(
        temperature=temperature,
        max_tokens=max_tokens,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        ignore_eos=ignore_eos,
    )
    several = len(block_sizes) > 1 or (sizes is not None and len(sizes) > 1)
    if several and not dry_run:
        raise typer.BadParameter(
            "several values need --dry-run (a model run uses one cache)",
            param_hint="--block-size/--num-blocks",
        )
    if several and record is not None:
        raise typer.BadParameter(
            "a trace records one run: give one --block-size and --num-blocks", param_hint="--record"
        )
    if several and per_request is not None:
        raise typer.BadParameter(
            "per-request records describe one run: give one --block-size and --num-blocks",
            param_hint="--per-request",
        )
    if dry_run and kv_cache_memory:
        raise typer.BadParameter(
            "a dry run has no model to size memory for; use --num-blocks",
            param_hint="--kv-cache-memory",
        )
    try:
        flags = dict(record=record, per_request=per_request, live=live, several=several)
        fleet = check_fleet_options(instances, router, dry_run=dry_run, **flags)
    except FleetOptionError as e:
        raise typer.BadParameter(str(e), param_hint=e.flag) from None
    if fleet and sizes:
        check_dry_run_memory(sizes[0] * instances)  # the one-cache bound's engine
    # One cache for a model run; a dry run takes each (block size, cache size) of the grid.
    engine_config = engine_config_from_flags(
        block_size=block_sizes[0],
        num_blocks=sizes[0] if sizes else None,
        kv_cache_memory=kv_cache_memory,
        no_prefix_cache=no_prefix_cache,
        prefix_match=prefix_match,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        step_latency_target_ms=step_latency_target_ms,
        max_model_len=max_model_len,
        dtype=dtype,
        device=device,
        tensor_parallel_size=tensor_parallel_size,
        quantization=quantization,
        threads=threads,
    )
    if fmt not in FORMATS:
        raise typer.BadParameter(f"choose from {', '.join(FORMATS)}", param_hint="--format")
    live_on = want_live(live, json_out)
    progress = not json_out and sys.stderr.isatty()
    reports: list[dict[str, Any]] = []
    with user_errors(debug):
        check_model_path(model)
        outputs = {"--report": report, "--record": record, "--per-request": per_request}
        check_outputs(outputs, inputs=[file, model])  # before the run, not after it
        pf = read_prompts(file, fmt, limit)
        try:
            if dry_run:
                grid = [
                    (bs, n)
                    for bs in block_sizes
                    for n in (sizes or [-(-DRY_RUN_CACHE_TOKENS // bs)])
                ]
                # The longest prompt any run of the grid admits.
                longest = engine_config.max_model_len or max(bs * n for bs, n in grid)
                encoder = PromptEncoder(model, chat, max_prompt_tokens=longest)
                requests = build_requests(pf, encoder, defaults, rate_value)
                config = _run_config(pf, rate_value, dry_run=True)
                config["model"] = model_label(model) if encoder.loaded else None
                if fleet:
                    bs, n = grid[0]
                    fleet_config = replace(engine_config, block_size=bs, num_blocks=n)
                    fleet_out = dict(json_out=json_out, report=report, progress=progress)
                    _fleet_replay(requests, config, fleet_config, instances, router, **fleet_out)
                    return
                _dry_runs(
                    grid,
                    requests,
                    config,
                    engine_config,
                    reports,
                    live_on,
                    progress,
                    record,
                    several,
                    per_request,
                )
            else:
                llm = make_llm(model, engine_config)
                encoder = PromptEncoder(
                    model, chat, tokenizer=llm.tokenizer, max_prompt_tokens=llm.max_model_len
                )
                requests = build_requests(pf, encoder, defaults, rate_value)
                config = _run_config(pf, rate_value, dry_run=False)
                config["model"] = llm.model_path
                config["block_size"] = llm.engine.block_size
                config["prefix_caching"] = engine_config.enable_prefix_caching
                config["prefix_match"] = engine_config.prefix_match
                config["quantization"] = llm.quantization or "none"
                clock = EngineClock(llm.engine)
                reports.append(
                    run_replay(
                        llm.engine,
                        clock,
                        requests,
                        config=config,
                        latencies=True,
                        live=live_on,
                        progress=progress,
                        record=record,
                        per_request=per_request,
                    )
                )
        except ReplayInterrupted as e:
            reports.append(e.report)
            if report is not None:
                _write_report(report, reports, several)
            raise KeyboardInterrupt from None
        _print_reports(reports, several, json_out)  # first: a failed write keeps the summary
        if report is not None:
            _write_report(report, reports, several)


def _run_config(pf: PromptFile, rate: float | None, *, dry_run: bool) -> dict[str, Any]:
    timing = "rate" if rate is not None else ("timestamps" if pf.has_timestamps else "all at once")
    return {
        "file": str(pf.path),
        "format": pf.format,
        "dry_run": dry_run,
        "arrivals": timing,
        "rate": None if rate is None or math.isinf(rate) else rate,
    }


# What a dry run's books take per cache block (measured: ~360 bytes in the BlockManager).
DRY_RUN_BYTES_PER_BLOCK = 400


def check_dry_run_memory(num_blocks: int) -> None:
    """Refuse a dry-run cache whose books alone would not fit in the memory left (the
    address-space limit, else MemAvailable), before it is built."""
    need = num_blocks * DRY_RUN_BYTES_PER_BLOCK
    free = _memory_free()
    if free is not None and need > free:
        raise typer.BadParameter(
            f"a dry-run cache of {num_blocks:,} blocks needs about {need / 2**30:.1f} GiB for "
            f"its books but only {max(free, 0) / 2**30:.1f} GiB is free; lower it",
            param_hint="--num-blocks",
        )


def _memory_free() -> int | None:
    """Bytes this process may still allocate (see engine/memory.py), or None if unknown."""
    from .engine.memory import host_memory_limit

    limit = host_memory_limit()
    return None if limit is None else limit.free


def _dry_runs(
    grid: list[tuple[int, int]],
    requests: list,
    config: dict[str, Any],
    engine_config: EngineConfig,
    reports: list[dict[str, Any]],
    live: bool,
    progress: bool,
    record: Path | None,
    several: bool,
    per_request: Path | None = None,
) -> None:
    """One replay per (block size, cache size) on ``engine_config``'s other settings; the
    infinite-cache bound once per block size."""
    from .report import InfiniteCache

    for i, (bs, n) in enumerate(grid):
        engine, clock = dry_run_engine(replace(engine_config, block_size=bs, num_blocks=n))
        # Per run, not per block size: rejected requests (too big for this cache) stay out of
        # both the hit rate and its bound.
        infinite = InfiniteCache(bs, engine_config.prefix_match)
        label = f"block size {bs}, {n:,} blocks"
        if several and not live and progress:
            print(f"nanokv: configuration {i + 1}/{len(grid)}: {label}", file=sys.stderr)
        reports.append(
            run_replay(
                engine,
                clock,
                requests,
                config={
                    **config,
                    "block_size": bs,
                    "prefix_caching": engine_config.enable_prefix_caching,
                    "prefix_match": engine_config.prefix_match,
                },
                # On the virtual clock: per-request lines carry them, labelled (their "clock").
                latencies=per_request is not None,
                live=live,
                progress=progress,
                record=record,
                per_request=per_request,
                infinite=infinite,
                transient=several,
                label=label if several else None,
            )
        )


def _fleet_replay(
    requests, config, engine_config, instances, router, *, json_out, report, progress
) -> None:
    """``replay --dry-run --instances N --router R``: the fleet what-if (fleet.py)."""
    from .fleet import DEFAULT_ROUTER
    from .fleet_report import SkippedPrinter, what_if
    from .views.fleet import fleet_table

    skipped = SkippedPrinter(config["file"])
    total = len(requests) * (2 if instances > 1 else 1)  # the fleet, then the one-cache bound
    with _progress(total, progress) as advance:
        result = what_if(
            requests,
            engine_config,
            instances,
            router or DEFAULT_ROUTER,
            run_config=config,
            on_progress=advance,
            on_rejected=skipped,
        )
    skipped.finish()
    if json_out:
        print_json(result)
    else:
        stdout_console().print(fleet_table(result))
    if report is not None:
        _write_report(report, [result], False)


def _write_report(path: Path, reports: list[dict[str, Any]], several: bool) -> None:
    from .report import write_json_atomic

    write_json_atomic(path, reports if several else reports[0])


def _print_reports(reports: list[dict[str, Any]], several: bool, json_out: bool) -> None:
    from .views.tables import comparison_table, hit_rate_chart, summary_table

    if json_out:
        print_json(reports if several else reports[0])
        return
    console = stdout_console()
    if several:
        console.print(comparison_table(reports))
        console.print()
        console.print(hit_rate_chart(reports, console.width))
    else:
        console.print(summary_table(reports[0]))


# -- serve -------------------------------------------------------------------------------------


def _kv_events_flag(text: str) -> KVEventsConfig:
    """``--kv-events-config``'s JSON (kv_events.py); a bad one is a usage error."""
    try:
        return parse_kv_events_config(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@app.command("serve")
def serve_cmd(
    model: ModelOpt = None,
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on: loopback by default; 0.0.0.0 for every interface."
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="TCP port; 0 takes a free one (printed at start).")
    ] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="NANOKV_API_KEY",
            show_envvar=True,
            help="Require `Authorization: Bearer KEY` on /v1/* (as vLLM; /health and /metrics "
            "stay open; the environment variable keeps the key out of the process list).",
            show_default=False,
        ),
    ] = None,
    guard_metrics: Annotated[
        bool,
        typer.Option(
            "--guard-metrics", help="With --api-key, /metrics needs the key too (scrapers send it)."
        ),
    ] = False,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            "--served-model-name",
            help="The model name clients send. [default: --model as given, else "
            "SmolLM2-135M-Instruct]",
            show_default=False,
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens to generate for requests that don't say.")
    ] = DEFAULT_MAX_TOKENS,
    block_size: Annotated[
        int, typer.Option(min=1, help="Tokens per KV block.")
    ] = DEFAULT_BLOCK_SIZE,
    num_blocks: Annotated[int | None, typer.Option(min=1, help=NumBlocksHelp)] = None,
    kv_cache_memory: KvMemoryOpt = None,
    no_prefix_cache: NoPrefixOpt = False,
    prefix_match: PrefixMatchOpt = "token",
    max_num_seqs: MaxSeqsOpt = None,
    max_num_batched_tokens: MaxBatchedOpt = None,
    step_latency_target_ms: StepLatencyOpt = None,
    max_model_len: MaxModelLenOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    tensor_parallel_size: TensorParallelOpt = None,
    quantization: QuantizationOpt = "auto",
    threads: ThreadsOpt = None,
    live: LiveOpt = None,
    record: Annotated[
        Path | None,
        typer.Option(help="Write every cache event to this trace file (for `nanokv inspect`)."),
    ] = None,
    report: Annotated[
        Path | None, typer.Option(help="Write the run's report as JSON to this file on exit.")
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            min=0.0, help="Seconds SIGTERM waits for in-flight requests before aborting them."
        ),
    ] = 30.0,
    limit_concurrency: Annotated[
        int,
        typer.Option(
            min=1,
            help="Requests in flight (a stream counts until it ends) before more get a 503; "
            "/health and /metrics are never refused.",
        ),
    ] = 512,  # serve.ServeLimits' defaults (serve.py loads FastAPI: not at start-up)
    limit_connections: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Open connections; one beyond is closed as it is accepted. [default: 3/4 of "
            "the open-files limit]",
            show_default=False,
        ),
    ] = None,
    timeout_keep_alive: Annotated[
        float, typer.Option(min=0.0, help="Seconds a connection may idle between requests.")
    ] = 5.0,
    timeout_header: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Seconds a request's headers may take, from its first byte or the "
            "connection's start (then a 408).",
        ),
    ] = 10.0,
    timeout_body: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Seconds a request's body may take after its headers (then closed).",
        ),
    ] = 30.0,
    kv_events_config: Annotated[
        KVEventsConfig | None,
        typer.Option(
            "--kv-events-config",
            parser=_kv_events_flag,
            metavar="JSON",
            help="Publish the KV cache's events for KV-aware routers (Dynamo, llm-d), as vLLM's "
            'flag does, e.g. `{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
            '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}`. '
            "Keys as vLLM's: publisher, buffer_steps, hwm, max_queue_size. [default: off]",
            show_default=False,
        ),
    ] = None,
    debug: DebugOpt = False,
) -> None:
    """Serve the OpenAI API (completions, chat, streaming) from one engine, with metrics.

    Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
    `GET /health`, `GET /metrics` (Prometheus, vLLM's names). Every client's requests are
    batched continuously by one engine loop; the live view shows their cache on a terminal.
    SIGTERM stops accepting and finishes in-flight requests (exit 0); Ctrl-C aborts them
    (exit 130); both write `--record` and `--report`.

    **Examples**

    ```
    nanokv serve
    nanokv serve --port 8080 --block-size 16 --record serve.trace --report serve.json
    NANOKV_API_KEY=secret nanokv serve --host 0.0.0.0
    ```
    """
    from .engine.loader import DEFAULT_MODEL_FILE

    engine_config = engine_config_from_flags(
        block_size=block_size,
        num_blocks=num_blocks,
        kv_cache_memory=kv_cache_memory,
        no_prefix_cache=no_prefix_cache,
        prefix_match=prefix_match,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        step_latency_target_ms=SERVE_STEP_LATENCY_MS
        if step_latency_target_ms is None
        else step_latency_target_ms,
        max_model_len=max_model_len,
        dtype=dtype,
        device=device,
        tensor_parallel_size=tensor_parallel_size,
        quantization=quantization,
        threads=threads,
    )
    if api_key is not None and not api_key.strip():
        raise typer.BadParameter("the API key is empty", param_hint="--api-key")
    live_on = want_live(live, False)
    with user_errors(debug):
        check_model_path(model)
        check_outputs({"--report": report, "--record": record}, inputs=[model])
        from .serve import ServeLimits, bind_socket, serve
        from .views.tables import summary_table

        sock = bind_socket(host, port)  # before loading: a taken port fails at once
        llm = make_llm(model, engine_config)
        config = {
            "model": llm.model_path,
            "dry_run": False,
            "block_size": llm.engine.block_size,
            "prefix_caching": engine_config.enable_prefix_caching,
            "prefix_match": engine_config.prefix_match,
            "quantization": llm.quantization or "none",
        }
        result = serve(
            llm,
            sock,
            model_name=served_model_name or model or DEFAULT_MODEL_FILE.split(".")[0],
            default_max_tokens=max_tokens,
            api_key=api_key,
            config=config,
            record=record,
            report=report,
            live=live_on,
            console=stdout_console(),
            shutdown_timeout=shutdown_timeout,
            limits=ServeLimits(
                limit_concurrency=limit_concurrency,
                limit_connections=limit_connections,
                timeout_keep_alive=timeout_keep_alive,
                timeout_header=timeout_header,
                timeout_body=timeout_body,
            ),
            guard_metrics=guard_metrics,
            kv_events=kv_events_config,
        )
        stdout_console().print(summary_table(result.report))
    if result.exit_code == 130:
        print("nanokv: interrupted", file=sys.stderr)
    elif result.exit_code:
        print("nanokv: error: the engine failed (traceback above)", file=sys.stderr)
    raise typer.Exit(result.exit_code)


# -- inspect -----------------------------------------------------------------------------------


@app.command()
def inspect(
    trace: Annotated[
        Path | None,
        typer.Argument(
            metavar="TRACE",
            help="Trace file written by `nanokv replay --record`.",
            show_default=False,
        ),
    ] = None,
    step: Annotated[
        int | None,
        typer.Option(
            min=0, help="Step to show (the first is 0). [default: the last]", show_default=False
        ),
    ] = None,
    summary: Annotated[
        bool, typer.Option("--summary", help="Steps, events per type and bytes of a TRACE.")
    ] = False,
    export: Annotated[
        tuple[str, Path] | None,
        typer.Option(
            "--export",
            metavar="FORMAT FILE",
            help="Write a TRACE's events to FILE as jsonl (one event per line) or "
            "vllm-kv-events (vLLM's EventBatch msgpack stream).",
            show_default=False,
        ),
    ] = None,
    request: Annotated[
        int | None,
        typer.Option(
            "--request",
            min=0,
            help="Explain one request's prefix-cache lookups block by block (its seq id).",
            show_default=False,
        ),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            help="Instead of a trace: show how this prompt file's prompts map onto blocks.",
        ),
    ] = None,
    fmt: Annotated[
        str, typer.Option("--format", help=f"Format of --prompts: {', '.join(FORMATS)}.")
    ] = "auto",
    block_size: Annotated[
        int, typer.Option(min=1, help="Tokens per block for --prompts.")
    ] = DEFAULT_BLOCK_SIZE,
    prefix_match: PrefixMatchOpt = "token",
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="Tokenizer for --prompts text. [default: SmolLM2-135M-Instruct]"
        ),
    ] = None,
    chat: ChatOpt = False,
    limit: Annotated[
        int | None, typer.Option(min=1, help="Only the first N prompts of --prompts.")
    ] = None,
    json_out: JsonOpt = False,
    list_all: Annotated[
        bool,
        typer.Option(
            "--all",
            help=f"With --json: every block and sequence (default: the first "
            f"{JSON_LIST_LIMIT:,} of each, with their counts).",
        ),
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Show the KV cache at a recorded step, or how prompts would share blocks.

    For a trace: the block map, every live sequence's block table, and each block's state,
    ref count, hash and text (when the trace names its model).

    **Examples**

    ```
    nanokv inspect run.trace
    nanokv inspect run.trace --step 120 --json
    nanokv inspect run.trace --request 3        # why request 3 hit or missed, block by block
    nanokv inspect run.trace --summary
    nanokv inspect run.trace --export vllm-kv-events run.kv   # vLLM's KV event stream
    nanokv inspect --prompts prompts.jsonl --block-size 16
    ```
    """
    if (trace is None) == (prompts is None):
        raise typer.BadParameter(
            "give a TRACE file or --prompts FILE (one of them)", param_hint="TRACE"
        )
    if request is not None and (trace is None or step is not None):
        raise typer.BadParameter(
            "--request explains a TRACE; it takes no --step", param_hint="--request"
        )
    if fmt not in FORMATS:
        raise typer.BadParameter(f"choose from {', '.join(FORMATS)}", param_hint="--format")
    with user_errors(debug):
        check_model_path(model)
        if export is not None:
            _export_trace(trace, export[0], export[1])
        elif summary:
            _trace_summary(trace, json_out)
        elif request is not None:
            _inspect_request(trace, request, json_out)
        elif trace is not None:
            _inspect_trace(trace, step, json_out, list_all)
        else:
            _inspect_prompts(prompts, fmt, block_size, prefix_match, model, chat, limit, json_out)


# inspect --json lists this many blocks and sequences unless --all: a cache of 8,000 blocks
# holds ~4 M token ids, which took 7.9 s and 638 MB to print.
JSON_LIST_LIMIT = 1000


def _inspect_trace(path: Path, step: int | None, json_out: bool, list_all: bool = False) -> None:
    from .trace import TraceReader, describe_state
    from .views.inspect import MAX_ROWS, render_trace_state

    reader = TraceReader(path)
    if reader.note:
        print(f"nanokv: {path}: {reader.note}", file=sys.stderr)
    state = reader.state_at(step)
    # What is shown is all that is described: the terminal's tables, or --json's lists.
    limit = None if json_out and list_all else JSON_LIST_LIMIT if json_out else MAX_ROWS
    info = describe_state(state, reader.block_size, _block_text_decoder(reader), limit=limit)
    if json_out:
        if info["blocks_listed"] < info["blocks_total"] and sys.stderr.isatty():
            print(f"nanokv: listing {limit:,} of each (--all for every one)", file=sys.stderr)
        print_json({"trace": str(path), "header": reader.header, **info})
        return
    console = stdout_console()
    console.print(render_trace_state(reader.header, state, info, max(20, console.width - 2)))


def _block_text_decoder(reader) -> Callable[[list[int]], str] | None:
    """Decodes block text with the tokenizer of the trace's model; None (and a note) when
    the header names none that loads: the blocks then show token ids only."""
    model, why = reader.model_path()
    if model is None:
        if why is not None:
            print(f"nanokv: block text not shown: {why}", file=sys.stderr)
        return None
    try:
        tokenizer = load_tokenizer(model)
    except (CliError, ValueError, OSError, ModelLoadError, MemoryError) as e:
        print(f"nanokv: block text not shown: {_one_line(e)}", file=sys.stderr)
        return None

    def decode(ids: list[int]) -> str:
        # Special tokens are part of what a block holds: show them.
        return tokenizer.decode(ids, skip_special_tokens=False)

    return decode


def _export_trace(path: Path, fmt: str, out: Path) -> None:
    from .trace import TraceReader, export

    reader = TraceReader(path)
    if reader.note:
        print(f"nanokv: {path}: {reader.note}", file=sys.stderr)
    from .paths import atomic_output

    check_outputs({"--export": out}, inputs=[path])
    with atomic_output(out, "--export") as f:
        n = export(reader, fmt, f)
    unit = "events" if fmt == "jsonl" else "event batches"
    print(f"nanokv: wrote {n:,} {unit} to {out}", file=sys.stderr)


def _trace_summary(path: Path, json_out: bool) -> None:
    from .trace import TraceReader

    reader = TraceReader(path)
    if reader.note:
        print(f"nanokv: {path}: {reader.note}", file=sys.stderr)
    info = reader.summary()
    if json_out:
        print_json({"trace": str(path), **info})
        return
    console = stdout_console()
    console.print(
        f"[b]{path}[/b]: trace version {info['version']}, {info['steps']:,} steps, "
        f"{info['num_events']:,} events, {info['file_bytes']:,} bytes, "
        f"{info['checkpoints']:,} checkpoints"
    )
    c = info["cache"]
    if info["requests"] is not None:
        console.print(f"{info['requests']:,} requests (ids 0 to {max(0, info['requests'] - 1):,})")
    console.print(
        f"prefix-cache hit rate {c['hit_rate']:.1%}: {c['cache_hits']:,} of "
        f"{c['cache_queries']:,} prompt tokens (first admissions; shared "
        f"{c['shared_hit_tokens']:,}, revived {c['revived_hit_tokens']:,}, "
        f"copied {c['copied_hit_tokens']:,}), "
        f"{c['evictions']:,} evictions, {c['preemptions']:,} preemptions"
    )
    for name, n in sorted(info["events"].items(), key=lambda kv: -kv[1]):
        console.print(f"  {name:<18} {n:>12,}")
    for name, n in info["record_bytes"].items():
        console.print(f"  [dim]{name} records {n:,} bytes[/dim]")


def _inspect_request(path: Path, seq_id: int, json_out: bool) -> None:
    from .trace import TraceReader, explain_request
    from .views.inspect import render_request

    reader = TraceReader(path)
    if reader.note:
        print(f"nanokv: {path}: {reader.note}", file=sys.stderr)
    info = explain_request(reader, seq_id, _block_text_decoder(reader))
    if json_out:
        print_json({"trace": str(path), "block_size": reader.block_size, **info})
        return
    stdout_console().print(render_request(info, reader.block_size))


def _inspect_prompts(
    path: Path,
    fmt: str,
    block_size: int,
    prefix_match: str,
    model: str | None,
    chat: bool,
    limit: int | None,
    json_out: bool,
) -> None:
    from .prompts import map_prompt_blocks
    from .views.inspect import render_prompt_map

    pf = read_prompts(path, fmt, limit)
    encoder = PromptEncoder(model, chat, max_prompt_tokens=DRY_RUN_CACHE_TOKENS)
    token_lists = []
    for r, tokens in zip(pf.requests, encode_prompts(pf, encoder)):
        try:
            token_lists.append(list(tokens() if callable(tokens) else tokens))
        except ValueError as e:  # a synthesized prompt too long to make
            raise CliError(f"{pf.path} line {r.line}: {e}") from None
    if prefix_match not in PREFIX_MATCH_MODES:
        raise typer.BadParameter(
            f"choose from {', '.join(PREFIX_MATCH_MODES)}, got {prefix_match!r}",
            param_hint="--prefix-match",
        )
    info = map_prompt_blocks(token_lists, block_size, prefix_match)
    decode = None
    if encoder.loaded:

        def decode(ids: list[int]) -> str:
            return encoder.tokenizer.decode(ids, skip_special_tokens=False)

    from .divergence import annotate_prompts  # where each prompt parts from an earlier one

    annotate_prompts(info["prompts"], token_lists, [r.token_source for r in pf.requests], decode)
    if json_out:
        print_json({"file": str(path), "format": pf.format, **info})
        return
    texts = None
    if pf.format != "mooncake":
        texts = [r.prompt if r.prompt is not None else _last_message(r) for r in pf.requests]
    console = stdout_console()
    console.print(render_prompt_map(info, texts, console.width, decode, token_lists))


# -- advise ------------------------------------------------------------------------------------


@app.command("advise")
def advise_cmd(
    file: Annotated[
        Path,
        typer.Argument(
            metavar="FILE|TRACE",
            help="Prompt file or request trace (as `replay` takes), or a trace written by "
            "`replay --record`.",
            show_default=False,
        ),
    ],
    fmt: Annotated[
        str, typer.Option("--format", help=f"Format of a prompt file: {', '.join(FORMATS)}.")
    ] = "auto",
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="Tokenizer for prompt text. [default: SmolLM2-135M-Instruct]"
        ),
    ] = None,
    chat: ChatOpt = False,
    block_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help=f"Tokens per KV block now. [default: a trace's, else {DEFAULT_BLOCK_SIZE}]",
            show_default=False,
        ),
    ] = None,
    num_blocks: Annotated[
        int | None,
        typer.Option(
            min=1,
            help=f"KV cache size now, in blocks. [default: a trace's, else "
            f"{DRY_RUN_CACHE_TOKENS:,} tokens' worth, as `replay --dry-run`]",
            show_default=False,
        ),
    ] = None,
    prefix_match: Annotated[
        str | None,
        typer.Option(
            "--prefix-match",
            metavar="token|block",
            help="Prefix-match mode now (where the engine has them). [default: the engine's]",
            show_default=False,
        ),
    ] = None,
    no_prefix_cache: NoPrefixOpt = False,
    max_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens to generate for requests that don't say.")
    ] = DEFAULT_MAX_TOKENS,
    rate: Annotated[
        str | None,
        typer.Option(
            help="Requests per second ('inf': all at once). [default: the file's timestamps, "
            "else all at once]",
            show_default=False,
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(min=1, help="Only the first N requests of a prompt file.")
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Processes that run the grid's dry runs. [default: 2, or 1 on one CPU]",
            show_default=False,
        ),
    ] = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """How to raise the prefix-cache hit rate, with every gain measured by a dry run.

    Runs FILE as `replay --dry-run` would (no model), then again at its bounds (a cache that
    never evicts; block size 1) and with each change it can suggest: other block sizes, a
    cache x2 and x4, the other prefix-match mode, and prompt layout (a varying first line
    moved after the shared text). Prints the hit rate against its bounds, the missed tokens by
    reason, where many prompts part from earlier ones (with the text there), the changes
    ranked by measured gain, and what the input cannot show.

    **Examples**

    ```
    nanokv advise prompts.jsonl
    nanokv advise prompts.jsonl --block-size 64 --json
    nanokv advise run.trace                  # a recorded run, run again
    nanokv advise mooncake.jsonl --block-size 512 --num-blocks 8000
    ```
    """
    from . import advise as advising

    if fmt not in FORMATS:
        raise typer.BadParameter(f"choose from {', '.join(FORMATS)}", param_hint="--format")
    if prefix_match is not None and not advising.HAS_PREFIX_MATCH:
        raise typer.BadParameter(
            "this engine has no prefix-match modes", param_hint="--prefix-match"
        )
    rate_value = parse_rate(rate)
    defaults = sampling_defaults(temperature=0.0, max_tokens=max_tokens)
    with user_errors(debug):
        check_model_path(model)
        trace = advising.is_trace(file) if file.is_file() else False
        header_bs = header_n = None
        if trace:
            workload = advising.trace_workload(file)
            header_bs, header_n = workload.recorded["block_size"], workload.recorded["num_blocks"]
        bs = block_size or header_bs or DEFAULT_BLOCK_SIZE
        n = num_blocks or (header_n if bs == header_bs else None) or -(-DRY_RUN_CACHE_TOKENS // bs)
        check_dry_run_memory(n)
        settings: dict[str, Any] = {"block_size": bs, "num_blocks": n}
        settings["enable_prefix_caching"] = not no_prefix_cache
        if prefix_match is not None:
            settings["prefix_match"] = prefix_match
        try:
            config = EngineConfig(**settings)
        except (TypeError, ValueError) as e:
            raise typer.BadParameter(str(e), param_hint="--prefix-match") from None
        if not trace:
            pf = read_prompts(file, fmt, limit)
            encoder = PromptEncoder(model, chat, max_prompt_tokens=bs * n)
            workload = advising.prompt_file_workload(pf, encoder, defaults, rate_value)
        advice = advising.advise(workload, config, jobs or advising.default_jobs())
    if json_out:
        print_json(advice)
        return
    from .views.advise import render_advice

    stdout_console().print(render_advice(advice))


@app.command()
def doctor(json_out: JsonOpt = False) -> None:
    """Check this install and machine: kernels, compiler, threads, memory, model.

    Each line says `ok`, `warn` or `fail` with what to do, or `info` for an optional part.
    The CPU kernels are loaded (built first if the cache has none). Exits 1 if a line fails.

    **Examples**

    ```
    nanokv doctor
    nanokv doctor --json
    ```
    """
    from .doctor import as_json, render, run_checks

    with user_errors(False):
        checks = run_checks()
    if json_out:
        print_json(as_json(checks))
    else:
        print(render(checks))
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


# -- top ---------------------------------------------------------------------------------------


@app.command("top")
def top_cmd(
    urls: Annotated[
        list[str],
        typer.Argument(
            metavar="URL",
            help="Running `nanokv serve` servers, e.g. http://127.0.0.1:8000 (several: a fleet).",
            show_default=False,
        ),
    ],
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="NANOKV_API_KEY",
            show_envvar=True,
            help="The servers' `--api-key` (the cache stream is under /v1, behind it).",
            show_default=False,
        ),
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="Print one frame and exit (1 if a server is not up).")
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="With --once: the frame's numbers as JSON.")
    ] = False,
    interval: Annotated[
        float, typer.Option(min=0.1, help="Seconds between frames at most (piped: exactly).")
    ] = 1.0,
    timeout: Annotated[
        float, typer.Option(min=0.1, help="With --once: seconds to wait for every server.")
    ] = 10.0,
) -> None:
    """Watch running servers' KV caches live: the block map, hits by kind, misses, tokens/s.

    Reads each server's cache stream (`GET /v1/nanokv/events`). One URL: the live view of
    that server. Several: one row per server and the fleet's merged figures. A server that
    stops shows as down until it answers again (a restart is picked up). Ctrl-C exits.

    **Examples**

    ```
    nanokv top http://127.0.0.1:8000
    nanokv top http://10.0.0.1:8000 http://10.0.0.2:8000
    nanokv top localhost:8000 --once --json
    ```
    """
    from . import top as topping
    from .views.top import Frames, watch

    if json_out and not once:
        raise typer.BadParameter("--json needs --once", param_hint="--json")
    with user_errors(False):
        top = topping.Top(urls, api_key)
    if once:
        with top:
            top.wait(topping.settled, timeout)
            views = top.views()
        if json_out:
            print_json(topping.top_json(views))
        else:
            stdout_console().print(Frames(stdout_console()).render(views))
    else:
        try:
            with top:
                watch(top, stdout_console(), interval)  # returns once every server refused
        except KeyboardInterrupt:
            raise typer.Exit(0) from None  # Ctrl-C is the way out of top
        views = top.views()
    failed = [v for v in views if v.status != "up"]
    sys.stdout.flush()  # the frame first, then what went wrong
    for v in failed:
        why = v.error or f"no answer within {timeout:g} s"  # still connecting
        print(f"nanokv: {v.name}: {why}", file=sys.stderr)
    raise typer.Exit(1 if failed else 0)


def _last_message(r: PromptRequest) -> str:
    if r.messages:
        return r.messages[-1]["content"]
    return " ".join(map(str, r.prompt_token_ids or []))


def main() -> None:
    """Console-script entry point (``nanokv``)."""
    app(prog_name="nanokv")


if __name__ == "__main__":
    main()
