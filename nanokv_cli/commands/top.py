"""``nanokv top``: running servers' KV caches, live (``nanokv_cli.serve.top`` reads them)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .errors import user_errors
from .output import print_json, stdout_console

UrlsArg = Annotated[
    list[str],
    typer.Argument(
        metavar="URL",
        help="Running `nanokv serve` servers, e.g. http://127.0.0.1:8000 (several: a fleet).",
        show_default=False,
    ),
]
ServersApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="NANOKV_API_KEY",
        show_envvar=True,
        help="The servers' `--api-key` (the cache stream is under /v1, behind it).",
        show_default=False,
    ),
]
OnceOpt = Annotated[
    bool, typer.Option("--once", help="Print one frame and exit (1 if a server is not up).")
]
OnceJsonOpt = Annotated[
    bool, typer.Option("--json", help="With --once: the frame's numbers as JSON.")
]
IntervalOpt = Annotated[
    float, typer.Option(min=0.1, help="Seconds between frames at most (piped: exactly).")
]
TimeoutOpt = Annotated[
    float, typer.Option(min=0.1, help="With --once: seconds to wait for every server.")
]


def top_cmd(
    urls: UrlsArg,
    api_key: ServersApiKeyOpt = None,
    once: OnceOpt = False,
    json_out: OnceJsonOpt = False,
    interval: IntervalOpt = 1.0,
    timeout: TimeoutOpt = 10.0,
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
    from ..serve import top as topping
    from ..views.top import Frames, watch

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
