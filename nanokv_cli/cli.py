"""The ``nanokv`` command line: generate, replay, serve, inspect, advise, doctor, top.

Commands drive the engine through its public API (``LLMEngine.add_request/step``, its event
bus, ``RequestOutput``) and learn about the cache only from events, like any other client.
torch is imported only where a model runs, so ``--dry-run`` and ``inspect`` work without it.
Each command is a module of ``commands/``; this one puts them on the app.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .commands.advise import advise_cmd
from .commands.doctor import doctor
from .commands.generate import generate
from .commands.inspect import inspect
from .commands.replay import replay_cmd
from .commands.serve import serve_cmd
from .commands.top import top_cmd
from .version import __version__

app = typer.Typer(
    name="nanokv",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


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


app.command()(generate)
app.command("replay")(replay_cmd)
app.command("serve")(serve_cmd)
app.command()(inspect)
app.command("advise")(advise_cmd)
app.command()(doctor)
app.command("top")(top_cmd)


def main() -> None:
    """Console-script entry point (``nanokv``)."""
    app(prog_name="nanokv")


if __name__ == "__main__":
    main()
