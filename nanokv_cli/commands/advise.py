"""``nanokv advise``: how to raise a workload's prefix-cache hit rate, each gain measured by a
dry run (``nanokv_cli.whatif.advise`` works it out, ``views/advise.py`` draws it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..paths import check_model_path, check_outputs, model_inputs, write_atomic
from ..whatif.replay import DRY_RUN_CACHE_TOKENS
from ..workload.prompts import FORMATS, read_prompts
from .engine_options import EngineFlags, engine_options
from .errors import user_errors
from .options import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_TOKENS,
    ChatOpt,
    DebugOpt,
    FormatOpt,
    HtmlOpt,
    JsonOpt,
    LimitOpt,
    RateOpt,
    RequestMaxTokensOpt,
    TokenizerOpt,
    check_bound_memory,
    check_dry_run_memory,
    check_format,
    parse_rate,
    sampling_defaults,
)
from .output import print_json, stdout_console

FileOrTraceArg = Annotated[
    Path,
    typer.Argument(
        metavar="FILE|TRACE",
        help="Prompt file or request trace (as `replay` takes), or a trace written by "
        "`replay --record`.",
        show_default=False,
    ),
]
JobsOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Processes that run the grid's dry runs. [default: 2, or 1 on one CPU]",
        show_default=False,
    ),
]
# The settings "now", that the advice measures its changes against: a trace's own by default.
NOW_HELP = {
    "block_size": f"Tokens per KV block now. [default: a trace's, else {DEFAULT_BLOCK_SIZE}]",
    "num_blocks": f"KV cache size now, in blocks. [default: a trace's, else "
    f"{DRY_RUN_CACHE_TOKENS:,} tokens' worth, as `replay --dry-run`]",
    "prefix_match": "Prefix-match mode now (where the engine has them). [default: the engine's]",
}


@engine_options(only=(*NOW_HELP, "enable_prefix_caching"), help=NOW_HELP)
def advise_cmd(
    file: FileOrTraceArg,
    fmt: FormatOpt = "auto",
    model: TokenizerOpt = None,
    chat: ChatOpt = False,
    *,
    engine: EngineFlags,
    max_tokens: RequestMaxTokensOpt = DEFAULT_MAX_TOKENS,
    rate: RateOpt = None,
    limit: LimitOpt = None,
    jobs: JobsOpt = None,
    json_out: JsonOpt = False,
    html: HtmlOpt = None,
    debug: DebugOpt = False,
) -> None:
    """How to raise the prefix-cache hit rate, with every gain measured by a dry run.

    Runs FILE as `replay --dry-run` would (no model), then again at its bounds (a cache that
    never evicts; block size 1), with each change it can suggest (other block sizes, a cache
    x2 and x4, the other prefix-match mode) and with each fix of the prompts' layout it finds
    (varying text before shared text, the same parts in another order, near-duplicates,
    short shared prefixes, truncated chat histories), and at cache sizes from tiny to
    never-evicting. Prints the hit rate against its bounds, the missed tokens by reason, where
    many prompts part from earlier ones (with the text there), the changes ranked by measured
    gain (a layout fix with its cause and both texts where they part), the hit rate by cache
    size (in tokens and GiB of K/V) and over the requests, and what the input cannot show.
    --html writes all of it as one page with charts.

    **Examples**

    ```
    nanokv advise prompts.jsonl
    nanokv advise prompts.jsonl --block-size 64 --json
    nanokv advise run.trace                  # a recorded run, run again
    nanokv advise mooncake.jsonl --block-size 512 --num-blocks 8000
    nanokv advise prompts.jsonl --html advice.html   # the same, as a page too
    ```
    """
    from ..run.encode import PromptEncoder
    from ..whatif.advise import advise, default_jobs
    from ..whatif.advise_grid import never_evicting_size
    from ..whatif.advise_workload import is_trace, prompt_file_workload, trace_workload

    check_format(fmt, FORMATS)
    rate_value = parse_rate(rate)
    defaults = sampling_defaults(temperature=0.0, max_tokens=max_tokens)
    with user_errors(debug):
        check_model_path(model)
        check_outputs({"--html": html}, inputs=[file, *model_inputs(model)])  # before the run
        trace = is_trace(file) if file.is_file() else False
        header_bs = header_n = None
        if trace:
            workload = trace_workload(file)
            header_bs, header_n = workload.recorded["block_size"], workload.recorded["num_blocks"]
        bs = engine.given.get("block_size") or header_bs or DEFAULT_BLOCK_SIZE
        n = engine.given.get("num_blocks") or (header_n if bs == header_bs else None)
        n = n or -(-DRY_RUN_CACHE_TOKENS // bs)
        check_dry_run_memory(n)
        config = engine.config(block_size=bs, num_blocks=n)
        if not trace:
            pf = read_prompts(file, fmt, limit)
            encoder = PromptEncoder(model, chat, max_prompt_tokens=bs * n)
            workload = prompt_file_workload(pf, encoder, defaults, rate_value)
        workload.model = model or workload.model  # whose K/V the cache's GiB are of
        check_bound_memory(never_evicting_size(workload, config))
        advice = advise(workload, config, jobs or default_jobs())
    if json_out:
        print_json(advice)
    else:
        from ..views.advise import render_advice

        stdout_console().print(render_advice(advice), crop=False)  # numbers are never cut
    if html is not None:  # last: a failed write keeps what was printed
        from ..views.pages import advise_html

        with user_errors(debug):
            write_atomic(html, advise_html(advice).encode("utf-8"), "--html")
