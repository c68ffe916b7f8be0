"""Flags that several commands share (besides the engine's: ``engine_options``), and the
parsing of flag values: each bad value is a usage error naming its flag."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..engine.config import EngineConfig
from ..engine.sampling_params import SamplingParams
from ..workload.prompts import FORMATS

DEFAULT_BLOCK_SIZE = EngineConfig.block_size
DEFAULT_MAX_TOKENS = 64

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Hugging Face model folder or .gguf file. [default: SmolLM2-135M-Instruct]",
    ),
]
RequestMaxTokensOpt = Annotated[
    int, typer.Option(min=1, help="Tokens to generate for requests that don't say.")
]
ChatOpt = Annotated[
    bool, typer.Option("--chat", help="Wrap plain prompts in the model's chat template.")
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
# A prompt file or request trace, as replay, advise and inspect --prompts read one.
FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        help=f"Format of the prompt file or trace: {', '.join(FORMATS)}.",
        show_default=True,
    ),
]
TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        "--model", "-m", help="Tokenizer for prompt text. [default: SmolLM2-135M-Instruct]"
    ),
]
LimitOpt = Annotated[int | None, typer.Option(min=1, help="Only the first N requests of the file.")]
RateOpt = Annotated[
    str | None,
    typer.Option(
        help="Send requests as a Poisson process of this many per second ('inf': all at once). "
        "[default: the file's timestamps, else all at once]",
        show_default=False,
    ),
]
RecordOpt = Annotated[
    Path | None,
    typer.Option(help="Write every cache event to this trace file (for `nanokv inspect`)."),
]
HtmlOpt = Annotated[
    Path | None,
    typer.Option(
        "--html",
        help="Also write the results as one HTML page with charts, to open offline (no "
        "network: everything is in the file).",
        show_default=False,
    ),
]


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


def parse_size(value: str, flag: str = "--kv-cache-memory") -> int:
    """``"512MiB"``, ``"2GB"``, ``"1.5g"``, ``"1048576"`` -> bytes."""
    from ..engine.config import parse_size as size_of

    try:
        return size_of(value)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=flag) from None


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


def check_format(fmt: str, formats: tuple[str, ...]) -> None:
    if fmt not in formats:
        raise typer.BadParameter(f"choose from {', '.join(formats)}", param_hint="--format")


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


# What a dry run's books take per cache block (measured: ~360 bytes in the BlockManager).
DRY_RUN_BYTES_PER_BLOCK = 400


# What a fleet what-if's instance takes besides its blocks (measured: ~12 KB, its engine,
# scheduler and router books).
DRY_RUN_BYTES_PER_INSTANCE = 16 << 10


def check_dry_run_memory(num_blocks: int) -> None:
    """Refuse a dry-run cache whose books alone would not fit in the memory left (the
    address-space limit, else MemAvailable), before it is built."""
    need = num_blocks * DRY_RUN_BYTES_PER_BLOCK
    _check_fits(need, f"a dry-run cache of {num_blocks:,} blocks", "--num-blocks")


def check_bound_memory(num_blocks: int) -> None:
    """The same for advise's never-evicting cache, sized by the requests themselves."""
    need = num_blocks * DRY_RUN_BYTES_PER_BLOCK
    what = f"a cache that never evicts for these requests ({num_blocks:,} blocks)"
    _check_fits(need, what, "--limit/--max-tokens")


def check_fleet_memory(instances: int, num_blocks: int, blocks_given: bool) -> None:
    """The same for a fleet what-if: ``instances`` engines of ``num_blocks`` (given, or the
    default cache's), then the one-cache bound's engine of them all (never both at once)."""
    need = instances * (num_blocks * DRY_RUN_BYTES_PER_BLOCK + DRY_RUN_BYTES_PER_INSTANCE)
    blocks = f"{num_blocks:,} block{'s' if num_blocks > 1 else ''}"
    what = f"a fleet of {instances:,} instances of {blocks}"
    _check_fits(need, what, "--instances/--num-blocks" if blocks_given else "--instances")


def _check_fits(need: int, what: str, flag: str) -> None:
    free = _memory_free()
    if free is not None and need > free:
        raise typer.BadParameter(
            f"{what} needs about {need / 2**30:.1f} GiB for its books but only "
            f"{max(free, 0) / 2**30:.1f} GiB is free; lower it",
            param_hint=flag,
        )


def _memory_free() -> int | None:
    """Bytes this process may still allocate (see engine/runner/memory.py), or None if unknown."""
    from ..engine.runner.memory import host_memory_limit

    limit = host_memory_limit()
    return None if limit is None else limit.free
