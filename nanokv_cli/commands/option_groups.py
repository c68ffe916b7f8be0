"""Groups of options declared once and added to several commands.

A command names a group by one parameter (``engine: EngineFlags``, ``sampling:
SamplingParams``); ``with_options`` puts the group's options in that parameter's place in
the signature typer reads (``__signature__``), and calls the command with what the group
builds of their values. The help lists the options where the parameter stands.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

import typer

from .options import DEFAULT_MAX_TOKENS, sampling_defaults

Command = TypeVar("Command", bound=Callable[..., Any])


def with_options(
    name: str, options: Sequence[inspect.Parameter], build: Callable[[dict[str, Any]], Any]
) -> Callable[[Command], Command]:
    """A decorator: the command's parameter ``name`` becomes ``options`` (parameters whose
    annotations are typer's), and the command gets ``build({option: value})`` as ``name``."""

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        if name not in signature.parameters:
            raise TypeError(f"{command.__name__} has no parameter {name!r} for its options")
        ours = [option.name for option in options]
        if clash := set(ours) & set(signature.parameters):
            raise TypeError(f"{command.__name__} already has parameters {sorted(clash)}")
        kind = signature.parameters[name].kind  # keyword-only where the command says `*`
        parameters = []
        for p in signature.parameters.values():
            parameters += [o.replace(kind=kind) for o in options] if p.name == name else [p]

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            values = {option: kwargs.pop(option) for option in ours}
            return command(**kwargs, **{name: build(values)})

        run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run  # type: ignore[return-value]

    return decorate


def option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def sampling_options(max_tokens_help: str) -> Callable[[Command], Command]:
    """The sampling flags (--max-tokens, --temperature, --top-p, --top-k, --seed,
    --ignore-eos) in place of the command's ``sampling: SamplingParams``, which gets the
    request defaults they make (a bad value is a usage error naming its flag)."""
    top_p = "Nucleus sampling: keep the top tokens holding this probability."
    options = [
        option(
            "max_tokens",
            Annotated[int, typer.Option(min=1, help=max_tokens_help)],
            DEFAULT_MAX_TOKENS,
        ),
        option(
            "temperature",
            Annotated[float, typer.Option(min=0.0, help="Sampling temperature; 0 is greedy.")],
            0.0,
        ),
        option("top_p", Annotated[float, typer.Option(min=0.0, max=1.0, help=top_p)], 1.0),
        option(
            "top_k",
            Annotated[
                int, typer.Option(min=0, help="Keep only the k most likely tokens (0: all).")
            ],
            0,
        ),
        option("seed", Annotated[int | None, typer.Option(help="Random seed for sampling.")], None),
        option(
            "ignore_eos",
            Annotated[
                bool,
                typer.Option("--ignore-eos", help="Keep generating past end-of-sequence tokens."),
            ],
            False,
        ),
    ]
    return with_options("sampling", options, lambda values: sampling_defaults(**values))
