"""``nanokv replay``: replay a prompt file or request trace (on the model, or dry runs over a
grid of cache layouts, or a fleet what-if) and print the reports (``nanokv_cli.whatif.replay``
runs them)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..engine.sampling_params import SamplingParams
from ..paths import check_model_path, check_outputs, model_inputs, write_atomic
from ..whatif.fleet import RouterName
from ..whatif.fleet_report import FleetOptionError, check_fleet_options
from ..whatif.replay import (
    DRY_RUN_CACHE_TOKENS,
    ReplayInterrupted,
    ReplayPlan,
    dry_runs,
    fleet_what_if,
    model_run,
    write_report,
)
from ..workload.prompts import FORMATS, read_prompts
from .engine_options import EngineFlags, engine_options
from .errors import user_errors
from .models import make_llm
from .option_groups import sampling_options
from .options import (
    DEFAULT_BLOCK_SIZE,
    ChatOpt,
    DebugOpt,
    FormatOpt,
    HtmlOpt,
    JsonOpt,
    LimitOpt,
    LiveOpt,
    ModelOpt,
    RateOpt,
    RecordOpt,
    check_dry_run_memory,
    check_fleet_memory,
    check_format,
    parse_int_list,
    parse_rate,
    want_live,
)
from .output import print_json, stdout_console

FileArg = Annotated[
    Path, typer.Argument(metavar="FILE", help="Prompt file or request trace.", show_default=False)
]
DryRunOpt = Annotated[
    bool,
    typer.Option("--dry-run", help="No model: accounting only, on a virtual clock (no torch)."),
]
# A dry run takes lists of these two: the grid of cache layouts it compares.
BlockSizesOpt = Annotated[
    str, typer.Option(help="Tokens per KV block; with --dry-run a list such as 16,64,256.")
]
NumBlocksOpt = Annotated[
    str | None,
    typer.Option(
        help=f"KV cache size in blocks; with --dry-run a list such as 100,1000. "
        f"[default: dry run {DRY_RUN_CACHE_TOKENS:,} tokens' worth, model: sized from memory]",
        show_default=False,
    ),
]
ReportOpt = Annotated[Path | None, typer.Option(help="Write the report as JSON to this file.")]
PerRequestOpt = Annotated[
    Path | None,
    typer.Option(
        "--per-request",
        help="Write one JSON line per finished request: prompt and cached tokens, "
        "why the rest missed, latencies.",
    ),
]
InstancesOpt = Annotated[
    int,
    typer.Option(
        "--instances",
        min=1,
        help="Fleet what-if (with --dry-run): N engines of --num-blocks each behind "
        "--router, on one virtual timeline; reports per-instance and fleet hit rates "
        "against one engine with N times the blocks, and the misses cached on another "
        "instance (elsewhere).",
    ),
]
RouterOpt = Annotated[
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
]


@sampling_options("Tokens to generate for requests that don't say.")
@engine_options(exclude=("block_size", "num_blocks"))
def replay_cmd(
    file: FileArg,
    fmt: FormatOpt = "auto",
    model: ModelOpt = None,
    dry_run: DryRunOpt = False,
    block_size: BlockSizesOpt = str(DEFAULT_BLOCK_SIZE),
    num_blocks: NumBlocksOpt = None,
    *,
    engine: EngineFlags,
    sampling: SamplingParams,
    chat: ChatOpt = False,
    rate: RateOpt = None,
    limit: LimitOpt = None,
    live: LiveOpt = None,
    json_out: JsonOpt = False,
    report: ReportOpt = None,
    record: RecordOpt = None,
    per_request: PerRequestOpt = None,
    html: HtmlOpt = None,
    instances: InstancesOpt = 1,
    router: RouterOpt = None,
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
    plan = ReplayPlan(
        engine.config(block_size=block_sizes[0], num_blocks=sizes[0] if sizes else None),
        block_sizes,
        sizes,
        sampling,
        rate=parse_rate(rate),
        model=model,
        chat=chat,
        live=want_live(live, json_out),
        progress=not json_out and sys.stderr.isatty(),
        record=record,
        per_request=per_request,
    )
    fleet = _check_plan(plan, dry_run, live, instances, router)
    check_format(fmt, FORMATS)
    with user_errors(debug):
        check_model_path(model)
        outputs = {"--report": report, "--record": record, "--per-request": per_request}
        outputs["--html"] = _html_option(html, dry_run, fleet)
        check_outputs(outputs, inputs=[file, *model_inputs(model)])  # before the run
        pf = read_prompts(file, fmt, limit)
        if dry_run:  # a model run's line comes with its model (make_llm)
            print(_dry_run_cache_line(plan, instances), file=sys.stderr, flush=True)
        if fleet:
            _print_fleet(fleet_what_if(pf, plan, instances, router), json_out, report)
            return
        interrupted = False
        try:
            reports = _replay(pf, plan, dry_run)
        except ReplayInterrupted as e:  # what had finished, summed up as a whole run's is
            reports, interrupted = e.reports, True
        _print_reports(reports, plan.several, json_out)  # first: a failed write keeps the summary
        if report is not None:
            write_report(report, reports, plan.several)
        _write_html(html, reports)
        if interrupted:
            raise KeyboardInterrupt


def _check_plan(
    plan: ReplayPlan, dry_run: bool, live: bool | None, instances: int, router: str | None
) -> bool:
    """Usage errors of the flags together; whether they ask for the fleet what-if."""
    several, sizes = plan.several, plan.sizes
    if dry_run and sizes:
        check_dry_run_memory(max(sizes))
    if several and not dry_run:
        raise typer.BadParameter(
            "several values need --dry-run (a model run uses one cache)",
            param_hint="--block-size/--num-blocks",
        )
    if several and plan.record is not None:
        raise typer.BadParameter(
            "a trace records one run: give one --block-size and --num-blocks", param_hint="--record"
        )
    if several and plan.per_request is not None:
        raise typer.BadParameter(
            "per-request records describe one run: give one --block-size and --num-blocks",
            param_hint="--per-request",
        )
    if dry_run and plan.engine_config.kv_cache_memory is not None:
        raise typer.BadParameter(
            "a dry run has no model to size memory for; use --num-blocks",
            param_hint="--kv-cache-memory",
        )
    try:
        flags = dict(record=plan.record, per_request=plan.per_request, live=live, several=several)
        fleet = check_fleet_options(instances, router, dry_run=dry_run, **flags)
    except FleetOptionError as e:
        raise typer.BadParameter(str(e), param_hint=e.flag) from None
    if fleet:  # the default cache too: a fleet of them can be as big as any given
        check_fleet_memory(instances, plan.grid[0][1], blocks_given=bool(sizes))
    return fleet


def _html_option(html: Path | None, dry_run: bool, fleet: bool) -> Path | None:
    """``--html``, which draws the comparison grid of dry runs: a usage error elsewhere."""
    if html is not None and (not dry_run or fleet):
        raise typer.BadParameter(
            "draws the grid of a dry run: give --dry-run (and no --instances or --router)",
            param_hint="--html",
        )
    return html


def _write_html(html: Path | None, reports: list[dict[str, Any]]) -> None:
    """The dry runs' reports as one HTML page (``views/pages.py``), if ``--html`` asks."""
    if html is not None:
        from ..views.pages import replay_html

        write_atomic(html, replay_html(reports).encode("utf-8"), "--html")


def _dry_run_cache_line(plan: ReplayPlan, instances: int) -> str:
    """The KV cache a dry run (or each of a grid's) accounts for, in one line, as model runs
    say theirs at start-up."""
    grid = plan.grid
    source = (
        "--num-blocks" if plan.sizes else f"the dry-run default of {DRY_RUN_CACHE_TOKENS:,} tokens"
    )
    if len(grid) == 1:
        bs, n = grid[0]
        fleet, each = (f"{instances:,} instances of ", " each") if instances > 1 else ("", "")
        sizes = f"KV cache {fleet}{n:,} blocks × {bs:,} tokens = {n * bs:,} tokens{each}"
    else:
        tokens = {bs * n for bs, n in grid}
        each = f"; {tokens.pop():,} tokens each" if len(tokens) == 1 else ""
        pairs = ", ".join(f"{n:,} × {bs:,}" for bs, n in grid)
        sizes = f"KV caches of {len(grid)} dry runs: {pairs} (blocks × tokens{each})"
    return f"nanokv: {sizes}, accounting only (no memory), from {source}"


def _replay(pf, plan: ReplayPlan, dry_run: bool) -> list[dict[str, Any]]:
    if dry_run:
        return dry_runs(pf, plan)
    return model_run(make_llm(plan.model, plan.engine_config), pf, plan)


def _print_fleet(result: dict[str, Any], json_out: bool, report: Path | None) -> None:
    from ..views.fleet import fleet_table

    if json_out:
        print_json(result)
    else:
        stdout_console().print(fleet_table(result))
    if report is not None:
        write_report(report, [result], False)


def _print_reports(reports: list[dict[str, Any]], several: bool, json_out: bool) -> None:
    from ..views.tables import comparison_table, hit_rate_chart, summary_table

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
