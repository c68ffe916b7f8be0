"""The ``nanokv`` command line: generate, replay, inspect.

Commands drive the engine through its public API (``LLMEngine.add_request/step``, its event
bus, ``RequestOutput``) and learn about the cache only from events, like any other client.
torch is imported only where a model runs, so ``--dry-run`` and ``inspect`` work without it.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Annotated, Any

import typer
from rich.console import Console

from . import __version__

# The loader imports torch only when weights are read: dry runs and inspect stay light.
from .engine.loader import ModelLoadError, default_model_path, load_tokenizer
from .engine.sampling_params import SamplingParams
from .prompts import FORMATS, PromptFile, PromptRequest, read_prompts

DEFAULT_BLOCK_SIZE = 256
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
USER_ERRORS: tuple[type[BaseException], ...] = (CliError, ValueError, OSError, ModelLoadError)


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
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def want_live(live: bool | None, json_out: bool) -> bool:
    """Live view: as asked, else on when stdout is a terminal and no JSON is wanted."""
    if live is not None:
        return live
    return not json_out and sys.stdout.isatty() and os.environ.get("TERM") != "dumb"


# -- models and tokenizers ---------------------------------------------------------------------


def model_label(model: str | None) -> str:
    return str(Path(model).expanduser().resolve()) if model else default_model_path()


class PromptEncoder:
    """Token ids of prompt-file requests; loads the tokenizer only if some request has text."""

    def __init__(self, model: str | None, chat: bool, tokenizer=None) -> None:
        self.model = model
        self.chat = chat
        self._tokenizer = tokenizer

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model)
        return self._tokenizer

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def text(self, prompt: str) -> list[int]:
        if self.chat:
            return self.messages([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def messages(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template already wrote every special token the model expects.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def request(self, req: PromptRequest) -> list[int] | Callable[[], list[int]]:
        if req.token_source is not None:
            return req.token_source
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        if req.messages is not None:
            return self.messages(req.messages)
        return self.text(req.prompt or "")


# -- output ------------------------------------------------------------------------------------


def stdout_console() -> Console:
    return Console(highlight=False)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
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
MaxSeqsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-num-seqs", min=1, help="Most sequences per step. [default: 256]", show_default=False
    ),
]
MaxBatchedOpt = Annotated[
    int | None,
    typer.Option(
        "--max-num-batched-tokens",
        min=1,
        help="Token budget per step (chunked prefill).",
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
        help="Quantized weights on CPU. auto: a GGUF's own Q4/Q8 blocks serve steps of few "
        "sequences (~3x faster single-stream decoding) and, unpacked for a tiled GEMM, "
        "batched decoding; 14-bit fixed-point copies prefills; K/V in float16 (as llama.cpp); none: float32 "
        "only; int8, int4: quantized only (4-8x smaller weights). [default: auto]",
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


def make_llm(model: str | None, *, kv_cache_memory: str | None, **options: Any):
    """The model and its engine; options left at None take the LLM's own defaults."""
    from .llm import LLM

    given = {k: v for k, v in options.items() if v is not None}
    if kv_cache_memory:
        given["kv_cache_memory"] = parse_size(kv_cache_memory)
    llm = LLM(model, **given)
    if llm.rank != 0:
        # A torchrun worker rank: LLM() returned once rank 0 finished; it has nothing to print.
        raise typer.Exit(0)
    return llm


def engine_limits(
    max_num_seqs: int | None, max_num_batched_tokens: int | None, max_model_len: int | None
) -> dict:
    limits = {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": max_model_len,
    }
    return {k: v for k, v in limits.items() if v is not None}


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
    max_num_seqs: MaxSeqsOpt = None,
    max_num_batched_tokens: MaxBatchedOpt = None,
    max_model_len: MaxModelLenOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    tensor_parallel_size: TensorParallelOpt = None,
    quantization: QuantizationOpt = "auto",
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
    if kv_cache_memory:
        parse_size(kv_cache_memory)
    check_model_flags(dtype, device, quantization)
    with user_errors(debug):
        llm = make_llm(
            model,
            dtype=dtype,
            device=device,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=not no_prefix_cache,
            tensor_parallel_size=tensor_parallel_size,
            quantization=quantization,
            **engine_limits(max_num_seqs, max_num_batched_tokens, max_model_len),
        )
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
        text = sys.stdin.read()
        text = text[:-1] if text.endswith("\n") else text
        if not text.strip():
            raise typer.BadParameter("stdin held no prompt", param_hint="PROMPT")
        return [text]
    return prompts


def _run_generate(
    llm, texts: list[str], defaults: SamplingParams, chat: bool, live: bool, json_out: bool
) -> list[dict[str, Any]]:
    from .engine.llm_engine import RequestRejected
    from .engine.tokenizer import IncrementalDecoder
    from .views.live import LiveView

    engine, tokenizer = llm.engine, llm.tokenizer
    encoder = PromptEncoder(None, chat, tokenizer=tokenizer)
    seq_ids = []
    for i, text in enumerate(texts):
        try:
            seq_ids.append(engine.add_request(encoder.text(text), defaults))
        except RequestRejected as e:
            prefix = f"prompt {i + 1}: " if len(texts) > 1 else ""
            raise CliError(f"{prefix}{e}") from None
    decoders = {s: IncrementalDecoder(tokenizer) for s in seq_ids}
    pieces: dict[int, list[str]] = {s: [] for s in seq_ids}
    finals: dict[int, Any] = {}
    streaming = not live and not json_out
    printer = _OrderedPrinter(seq_ids, texts) if streaming else None
    t0 = time.perf_counter()
    with ExitStack() as stack:
        view = None
        if live:
            view = LiveView(
                engine.num_blocks,
                engine.block_size,
                console=stdout_console(),
                title="nanokv generate",
                total_requests=len(texts),
                show_text=True,
                transient=True,
            )
            stack.callback(view.attach(engine.events))
            stack.enter_context(view)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            for out in outputs:
                piece = "".join(decoders[out.seq_id].add(t) for t in out.new_token_ids)
                if out.finished:
                    piece += decoders[out.seq_id].flush()
                    finals[out.seq_id] = out
                pieces[out.seq_id].append(piece)
                if view is not None:
                    view.set_text(out.seq_id, "".join(pieces[out.seq_id]))
                if printer is not None:
                    printer.add(out.seq_id, piece, out.finished)
            if view is not None:
                view.tick()
    elapsed = time.perf_counter() - t0
    results = [
        _generate_result(texts[i], "".join(pieces[s]), finals[s]) for i, s in enumerate(seq_ids)
    ]
    if live and not json_out:
        _print_texts(texts, results)
    if not json_out:
        _print_generate_summary(results, elapsed)
    return results


class _OrderedPrinter:
    """Streams outputs to stdout in prompt order: the first one live, each next one as soon
    as those before it are complete."""

    def __init__(self, seq_ids: list[int], texts: list[str]) -> None:
        self.queue = list(seq_ids)
        self.texts = dict(zip(seq_ids, texts))
        self.pending: dict[int, list[str]] = {s: [] for s in seq_ids}
        self.done: set[int] = set()
        self.many = len(seq_ids) > 1
        self.open: int | None = None  # the sequence whose header is written
        self.printed = 0

    def add(self, seq_id: int, piece: str, finished: bool) -> None:
        self.pending[seq_id].append(piece)
        if finished:
            self.done.add(seq_id)
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

    def _header(self, seq_id: int) -> None:
        if self.many:
            sep = "\n" if self.printed else ""
            sys.stdout.write(f"{sep}--- {self.texts[seq_id]!r}\n")
        self.open = seq_id
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


def build_requests(
    pf: PromptFile, encoder: PromptEncoder, defaults: SamplingParams, rate: float | None
) -> list:
    """Engine requests in arrival order: the file's timestamps, a Poisson ``rate``, or all at 0."""
    from .engine.replay import Request, all_at_once, at_rate

    requests = []
    for r in pf.requests:
        try:
            tokens = encoder.request(r)
        except ValueError as e:
            raise CliError(f"{pf.path} line {r.line}: {e}") from None
        requests.append(
            Request(tokens, r.sampling_params(defaults), r.timestamp or 0.0, tag=r.line)
        )
    if rate is not None:
        if math.isinf(rate):
            return list(all_at_once(requests))
        return list(at_rate(requests, rate))
    if pf.has_timestamps:
        return sorted(requests, key=lambda q: q.arrival_time)
    return list(all_at_once(requests))


def dry_run_engine(block_size: int, num_blocks: int, **limits: Any):
    """An engine on the model-free executor and its virtual clock."""
    from .engine.dry_run import DryRunExecutor, VirtualClock
    from .engine.llm_engine import LLMEngine

    clock = VirtualClock()
    engine = LLMEngine(
        DryRunExecutor(clock=clock),
        num_blocks=num_blocks,
        block_size=block_size,
        clock=clock,
        **limits,
    )
    return engine, clock


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
    from .report import RunStats

    with ExitStack() as files:
        records = None
        if per_request is not None:
            records = files.enter_context(_open_output(per_request, "--per-request"))

            def write_record(rec: dict[str, Any]) -> None:
                records.write(json.dumps(rec) + "\n")
                records.flush()  # one line per request as it finishes: Ctrl-C loses nothing

        stats = RunStats(infinite, on_request=write_record if records else None)
        return _run_replay(
            engine,
            clock,
            requests,
            stats,
            config=config,
            latencies=latencies,
            live=live,
            progress=progress,
            record=record,
            transient=transient,
            label=label,
        )


@contextmanager
def _open_output(path: Path, flag: str) -> Iterator[IO[str]]:
    """Open an output file before the run starts, so a bad path fails at once, by name."""
    try:
        f = open(path, "w", encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        raise CliError(f"cannot write {flag} {path}: {e.strerror or e}") from None
    with f:
        yield f


def _run_replay(
    engine,
    clock,
    requests: list,
    stats,
    *,
    config: dict[str, Any],
    latencies: bool,
    live: bool,
    progress: bool,
    record: Path | None,
    transient: bool,
    label: str | None,
) -> dict[str, Any]:
    from .engine.replay import Request, replay
    from .trace import TraceWriter, make_header
    from .views.live import LiveView

    unsubscribe = [engine.events.subscribe(stats)]
    rejected: list[str] = []

    def on_rejected(req, error: Exception) -> None:
        rejected.append(f"line {req.tag}: {error}")
        if len(rejected) <= 3:
            where = f" ({label})" if label else ""
            print(
                f"nanokv: skipped {config['file']} line {req.tag}{where}: {error}", file=sys.stderr
            )

    t0, start = time.perf_counter(), clock()
    if start:  # a model engine's clock has run since it was built: arrivals count from now
        requests = [
            Request(r.prompt_token_ids, r.sampling_params, r.arrival_time + start, r.tag)
            for r in requests
        ]

    def report(interrupted: bool = False) -> dict[str, Any]:
        return stats.report(
            duration=clock() - start,
            wall_time=time.perf_counter() - t0,
            **config,
            num_blocks=engine.num_blocks,
            rejected=len(rejected),
            interrupted=interrupted,
        )

    with ExitStack() as stack:
        for u in unsubscribe:
            stack.callback(u)
        if record is not None:
            header = make_header(
                block_size=engine.block_size,
                num_blocks=engine.num_blocks,
                model=config.get("model"),
                dry_run=config.get("dry_run", False),
                source=config["file"],
            )
            writer = stack.enter_context(TraceWriter(record, header))
            stack.callback(engine.events.subscribe(writer))
        if live:
            title = f"nanokv replay {Path(config['file']).name}"
            view = LiveView(
                engine.num_blocks,
                engine.block_size,
                console=stdout_console(),
                title=title,
                total_requests=len(requests),
                transient=transient,
            )
            stack.callback(view.attach(engine.events))
            stack.enter_context(view)
        advance = stack.enter_context(_progress(len(requests), progress and not live))
        tick = view.tick if live else None
        try:
            tag = lambda seq_id, req: stats.tag(seq_id, line=req.tag)  # noqa: E731
            for outputs in replay(engine, requests, clock, on_added=tag, on_rejected=on_rejected):
                if latencies:
                    stats.observe(outputs, engine.clock)
                if outputs:
                    advance(stats.finished)
                if tick is not None:
                    tick()
        except KeyboardInterrupt:
            raise ReplayInterrupted(report(interrupted=True)) from None
    if len(rejected) > 3:
        where = f" ({label})" if label else ""
        print(f"nanokv: skipped {len(rejected)} requests in all{where}", file=sys.stderr)
    if rejected and not stats.requests:
        raise CliError(f"every request was rejected; the first: {rejected[0]}")
    return report()


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
    max_model_len: MaxModelLenOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    tensor_parallel_size: TensorParallelOpt = None,
    quantization: QuantizationOpt = "auto",
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
    ```
    """
    block_sizes = parse_int_list(block_size, "--block-size")
    sizes = parse_int_list(num_blocks, "--num-blocks") if num_blocks else None
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
    if kv_cache_memory:
        parse_size(kv_cache_memory)
    if fmt not in FORMATS:
        raise typer.BadParameter(f"choose from {', '.join(FORMATS)}", param_hint="--format")
    live_on = want_live(live, json_out)
    progress = not json_out and sys.stderr.isatty()
    check_model_flags(dtype, device, quantization)
    limits = engine_limits(max_num_seqs, max_num_batched_tokens, max_model_len)
    limits["enable_prefix_caching"] = not no_prefix_cache
    reports: list[dict[str, Any]] = []
    with user_errors(debug):
        pf = read_prompts(file, fmt, limit)
        try:
            if dry_run:
                encoder = PromptEncoder(model, chat)
                requests = build_requests(pf, encoder, defaults, rate_value)
                config = _run_config(pf, rate_value, dry_run=True)
                config["model"] = model_label(model) if encoder.loaded else None
                grid = [
                    (bs, n)
                    for bs in block_sizes
                    for n in (sizes or [-(-DRY_RUN_CACHE_TOKENS // bs)])
                ]
                _dry_runs(
                    grid,
                    requests,
                    config,
                    limits,
                    reports,
                    live_on,
                    progress,
                    record,
                    several,
                    per_request,
                )
            else:
                llm = make_llm(
                    model,
                    dtype=dtype,
                    device=device,
                    block_size=block_sizes[0],
                    num_blocks=sizes[0] if sizes else None,
                    kv_cache_memory=kv_cache_memory,
                    tensor_parallel_size=tensor_parallel_size,
                    quantization=quantization,
                    **limits,
                )
                encoder = PromptEncoder(model, chat, tokenizer=llm.tokenizer)
                requests = build_requests(pf, encoder, defaults, rate_value)
                config = _run_config(pf, rate_value, dry_run=False)
                config["model"] = llm.model_path
                config["block_size"] = llm.engine.block_size
                config["prefix_caching"] = limits["enable_prefix_caching"]
                config["quantization"] = llm.quantization or "none"
                clock = _wall_clock(llm.engine)
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
        if report is not None:
            _write_report(report, reports, several)
        _print_reports(reports, several, json_out)


def _run_config(pf: PromptFile, rate: float | None, *, dry_run: bool) -> dict[str, Any]:
    timing = "rate" if rate is not None else ("timestamps" if pf.has_timestamps else "all at once")
    return {
        "file": str(pf.path),
        "format": pf.format,
        "dry_run": dry_run,
        "arrivals": timing,
        "rate": None if rate is None or math.isinf(rate) else rate,
    }


def _dry_runs(
    grid: list[tuple[int, int]],
    requests: list,
    config: dict[str, Any],
    limits: dict[str, Any],
    reports: list[dict[str, Any]],
    live: bool,
    progress: bool,
    record: Path | None,
    several: bool,
    per_request: Path | None = None,
) -> None:
    """One replay per (block size, cache size); the infinite-cache bound once per block size."""
    from .report import InfiniteCache

    for i, (bs, n) in enumerate(grid):
        engine, clock = dry_run_engine(bs, n, **limits)
        # Per run, not per block size: rejected requests (too big for this cache) stay out of
        # both the hit rate and its bound.
        infinite = InfiniteCache(bs)
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
                    "prefix_caching": limits["enable_prefix_caching"],
                },
                latencies=False,
                live=live,
                progress=progress,
                record=record,
                per_request=per_request,
                infinite=infinite,
                transient=several,
                label=label if several else None,
            )
        )


def _wall_clock(engine):
    """A wall clock the replay driver can wait on, reading the engine's own clock."""

    class EngineWallClock:
        def __call__(self) -> float:
            return engine.clock

        def wait_until(self, t: float) -> None:
            delay = t - engine.clock
            if delay > 0:
                time.sleep(delay)

    return EngineWallClock()


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
        if request is not None:
            _inspect_request(trace, request, json_out)
        elif trace is not None:
            _inspect_trace(trace, step, json_out)
        else:
            _inspect_prompts(prompts, fmt, block_size, model, chat, limit, json_out)


def _inspect_trace(path: Path, step: int | None, json_out: bool) -> None:
    from .trace import TraceReader, describe_state
    from .views.inspect import render_trace_state

    reader = TraceReader(path)
    state = reader.state_at(step)
    decode = None
    if reader.header.get("model"):
        try:
            tokenizer = load_tokenizer(reader.header["model"])

            def decode(ids: list[int]) -> str:
                # Special tokens are part of what a block holds: show them.
                return tokenizer.decode(ids, skip_special_tokens=False)

        except (CliError, ValueError, OSError) as e:
            print(f"nanokv: block text not shown: {_one_line(e)}", file=sys.stderr)
    info = describe_state(state, reader.block_size, decode)
    if json_out:
        print_json({"trace": str(path), "header": reader.header, **info})
        return
    console = stdout_console()
    console.print(render_trace_state(reader.header, state, info, max(20, console.width - 2)))


def _inspect_request(path: Path, seq_id: int, json_out: bool) -> None:
    from .trace import TraceReader, explain_request
    from .views.inspect import render_request

    reader = TraceReader(path)
    info = explain_request(reader, seq_id)
    if json_out:
        print_json({"trace": str(path), "block_size": reader.block_size, **info})
        return
    stdout_console().print(render_request(info, reader.block_size))


def _inspect_prompts(
    path: Path,
    fmt: str,
    block_size: int,
    model: str | None,
    chat: bool,
    limit: int | None,
    json_out: bool,
) -> None:
    from .prompts import map_prompt_blocks
    from .views.inspect import render_prompt_map

    pf = read_prompts(path, fmt, limit)
    encoder = PromptEncoder(model, chat)
    token_lists = []
    for r in pf.requests:
        try:
            tokens = encoder.request(r)
        except ValueError as e:
            raise CliError(f"{pf.path} line {r.line}: {e}") from None
        token_lists.append(list(tokens() if callable(tokens) else tokens))
    info = map_prompt_blocks(token_lists, block_size)
    if json_out:
        print_json({"file": str(path), "format": pf.format, **info})
        return
    texts = None
    if pf.format != "mooncake":
        texts = [r.prompt if r.prompt is not None else _last_message(r) for r in pf.requests]
    decode = None
    if encoder.loaded:

        def decode(ids: list[int]) -> str:
            return encoder.tokenizer.decode(ids, skip_special_tokens=False)

    console = stdout_console()
    console.print(render_prompt_map(info, texts, console.width, decode, token_lists))


def _last_message(r: PromptRequest) -> str:
    if r.messages:
        return r.messages[-1]["content"]
    return " ".join(map(str, r.prompt_token_ids or []))


def main() -> None:
    """Console-script entry point (``nanokv``)."""
    app(prog_name="nanokv")


if __name__ == "__main__":
    main()
