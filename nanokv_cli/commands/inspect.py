"""``nanokv inspect``: the KV cache at a recorded step, one request's lookups, a trace's
summary or export, or how a prompt file's prompts map onto blocks."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from ..engine.model.loader import ModelLoadError, load_tokenizer
from ..paths import check_model_path, check_outputs
from ..run.encode import PromptEncoder, encode_prompts
from ..whatif.replay import DRY_RUN_CACHE_TOKENS
from ..workload.prompts import FORMATS, PromptRequest, read_prompts
from .engine_options import EngineFlags, engine_options
from .errors import CliError, one_line, user_errors
from .options import (
    DEFAULT_BLOCK_SIZE,
    ChatOpt,
    DebugOpt,
    FormatOpt,
    JsonOpt,
    LimitOpt,
    TokenizerOpt,
    check_format,
)
from .output import print_json, stdout_console

# inspect --json lists this many blocks and sequences unless --all: a cache of 8,000 blocks
# holds ~4 M token ids, which took 7.9 s and 638 MB to print.
JSON_LIST_LIMIT = 1000

TraceArg = Annotated[
    Path | None,
    typer.Argument(
        metavar="TRACE", help="Trace file written by `nanokv replay --record`.", show_default=False
    ),
]
StepOpt = Annotated[
    int | None,
    typer.Option(
        min=0, help="Step to show (the first is 0). [default: the last]", show_default=False
    ),
]
SummaryOpt = Annotated[
    bool, typer.Option("--summary", help="Steps, events per type and bytes of a TRACE.")
]
ExportOpt = Annotated[
    tuple[str, Path] | None,
    typer.Option(
        "--export",
        metavar="FORMAT FILE",
        help="Write a TRACE's events to FILE as jsonl (one event per line), "
        "vllm-kv-events (vLLM's KVEventBatch msgpack stream, events as tagged maps) or "
        "vllm-kv-events-array (the same, events as vLLM's older positional arrays).",
        show_default=False,
    ),
]
RequestOpt = Annotated[
    int | None,
    typer.Option(
        "--request",
        min=0,
        help="Explain one request's prefix-cache lookups block by block (its seq id).",
        show_default=False,
    ),
]
PromptsOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompts", help="Instead of a trace: show how this prompt file's prompts map onto blocks."
    ),
]
AllOpt = Annotated[
    bool,
    typer.Option(
        "--all",
        help=f"With --json: every block and sequence (default: the first "
        f"{JSON_LIST_LIMIT:,} of each, with their counts).",
    ),
]


@engine_options(
    only=("block_size", "prefix_match"),
    help={"block_size": f"Tokens per block for --prompts. [default: {DEFAULT_BLOCK_SIZE}]"},
)
def inspect(
    trace: TraceArg = None,
    step: StepOpt = None,
    summary: SummaryOpt = False,
    export: ExportOpt = None,
    request: RequestOpt = None,
    prompts: PromptsOpt = None,
    fmt: FormatOpt = "auto",
    *,
    engine: EngineFlags,
    model: TokenizerOpt = None,
    chat: ChatOpt = False,
    limit: LimitOpt = None,
    json_out: JsonOpt = False,
    list_all: AllOpt = False,
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
    check_format(fmt, FORMATS)
    layout = engine.config()  # --prompts' block size and prefix-match mode
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
            block_size, prefix_match = layout.block_size, layout.prefix_match
            _inspect_prompts(prompts, fmt, block_size, prefix_match, model, chat, limit, json_out)


def _reader(path: Path):
    from ..trace.reader import TraceReader

    reader = TraceReader(path)
    if reader.note:
        print(f"nanokv: {path}: {reader.note}", file=sys.stderr)
    return reader


def _inspect_trace(path: Path, step: int | None, json_out: bool, list_all: bool = False) -> None:
    from ..run.analysis import describe_state
    from ..views.inspect import MAX_ROWS, render_trace_state

    reader = _reader(path)
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
        print(f"nanokv: block text not shown: {one_line(e)}", file=sys.stderr)
        return None

    def decode(ids: list[int]) -> str:
        # Special tokens are part of what a block holds: show them.
        return tokenizer.decode(ids, skip_special_tokens=False)

    return decode


def _export_trace(path: Path, fmt: str, out: Path) -> None:
    from ..paths import atomic_output
    from ..trace.exporter import export

    reader = _reader(path)
    check_outputs({"--export": out}, inputs=[path])
    with atomic_output(out, "--export") as f:
        n = export(reader, fmt, f)
    unit = "events" if fmt == "jsonl" else "event batches"
    print(f"nanokv: wrote {n:,} {unit} to {out}", file=sys.stderr)


def _trace_summary(path: Path, json_out: bool) -> None:
    info = _reader(path).summary()
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
        f"copied {c['copied_hit_tokens']:,}"
        + (f", restored {c['restored_hit_tokens']:,}" if c.get("restored_hit_tokens") else "")
        + "), "
        f"{c['evictions']:,} evictions, {c['preemptions']:,} preemptions"
    )
    for name, n in sorted(info["events"].items(), key=lambda kv: -kv[1]):
        console.print(f"  {name:<18} {n:>12,}")
    for name, n in info["record_bytes"].items():
        console.print(f"  [dim]{name} records {n:,} bytes[/dim]")


def _inspect_request(path: Path, seq_id: int, json_out: bool) -> None:
    from ..run.analysis import explain_request
    from ..views.inspect import render_request

    reader = _reader(path)
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
    from ..run.divergence import annotate_prompts  # where each prompt parts from an earlier one
    from ..views.inspect import render_prompt_map
    from ..workload.prompts import map_prompt_blocks

    pf = read_prompts(path, fmt, limit)
    encoder = PromptEncoder(model, chat, max_prompt_tokens=DRY_RUN_CACHE_TOKENS)
    token_lists = []
    for r, tokens in zip(pf.requests, encode_prompts(pf, encoder)):
        try:
            token_lists.append(list(tokens() if callable(tokens) else tokens))
        except ValueError as e:  # a synthesized prompt too long to make
            raise CliError(f"{pf.path} line {r.line}: {e}") from None
    info = map_prompt_blocks(token_lists, block_size, prefix_match)
    decode = None
    if encoder.loaded:

        def decode(ids: list[int]) -> str:
            return encoder.tokenizer.decode(ids, skip_special_tokens=False)

    annotate_prompts(info["prompts"], token_lists, [r.token_source for r in pf.requests], decode)
    if json_out:
        print_json({"file": str(path), "format": pf.format, **info})
        return
    texts = None
    if pf.format != "mooncake":
        texts = [r.prompt if r.prompt is not None else _last_message(r) for r in pf.requests]
    console = stdout_console()
    console.print(render_prompt_map(info, texts, console.width, decode, token_lists))


def _last_message(r: PromptRequest) -> str:
    if r.messages:
        return r.messages[-1]["content"]
    return " ".join(map(str, r.prompt_token_ids or []))
