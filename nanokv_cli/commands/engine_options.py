"""The engine's flags, declared once: every ``EngineConfig`` field whose metadata names a
flag (engine/config.py) is an option of each command that runs the engine, and
``EngineFlags.config`` builds the EngineConfig of them, in one place. A new engine setting
is one field there: its flag, help, checks and errors come with it (as vLLM's
``EngineArgs.add_cli_args``).

A command asks for them with ``@engine_options(...)`` and an ``engine: EngineFlags``
parameter, where the options then stand in its signature and ``--help``.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import Field, dataclass, fields
from typing import Annotated, Any

import typer

from ..engine.config import EngineConfig
from .option_groups import Command, option, with_options

_FIELDS: dict[str, Field] = {f.name: f for f in fields(EngineConfig) if "flag" in f.metadata}
_TYPES = typing.get_type_hints(EngineConfig)
FLAGS = {name: f.metadata["flag"] for name, f in _FIELDS.items()}  # setting -> its flag


@dataclass(frozen=True)
class EngineFlags:
    """What a command's engine flags set: ``given``, the settings whose flag was given
    (parsed and checked), over ``defaults``, the command's own (serve's step latency)."""

    given: Mapping[str, Any]
    defaults: Mapping[str, Any]

    def config(self, **settings: Any) -> EngineConfig:
        """The EngineConfig of the command's defaults, the flags given and ``settings`` (the
        command's own values, such as a dry run's block size; None leaves one unset), later
        ones winning. A value EngineConfig refuses is a usage error naming its flag."""
        chosen = {k: v for k, v in settings.items() if v is not None}
        try:
            return EngineConfig(**{**self.defaults, **self.given, **chosen})
        except ValueError as e:
            # EngineConfig's messages start with the setting's name: name its flag instead.
            name = re.match(r"\w+", str(e))
            raise typer.BadParameter(str(e), param_hint=FLAGS.get(name and name.group())) from None


def engine_options(
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    help: Mapping[str, str] | None = None,
) -> Callable[[Command], Command]:
    """Put the engine's flags in place of the command's ``engine: EngineFlags`` parameter.

    ``only``/``exclude``: the settings to offer (by field name; default: every one with a
    flag). ``defaults``: the command's own default of a setting (its help shows it).
    ``help``: a setting's whole help text in this command, its default included.
    """
    defaults, help = dict(defaults or {}), dict(help or {})
    unknown = (set(only or ()) | set(exclude) | set(defaults) | set(help)) - set(_FIELDS)
    if unknown:
        raise ValueError(f"no engine flag for {sorted(unknown)}")
    names = [n for n in _FIELDS if (only is None or n in only) and n not in exclude]
    options = [_option(n, defaults.get(n), help.get(n)) for n in names]
    return with_options("engine", options, lambda values: EngineFlags(_given(values), defaults))


def _option(name: str, default: Any, help_text: str | None):
    """A setting's option, defaulting to None (not given: the command's or EngineConfig's
    default applies); a bool setting's is a switch."""
    meta = _FIELDS[name].metadata
    text = help_text or _help(_FIELDS[name], default)
    if _TYPES[name] is bool:
        return option(name, Annotated[bool, typer.Option(meta["flag"], help=text)], False)
    kind = str if "parse" in meta or "choices" in meta else _without_none(_TYPES[name])
    settings = {"min": meta.get("min"), "metavar": meta.get("metavar"), "show_default": False}
    return option(
        name, Annotated[kind | None, typer.Option(meta["flag"], help=text, **settings)], None
    )


def _help(f: Field, command_default: Any) -> str:
    default = command_default
    if default is None:
        default = f.metadata.get("default_help", f.default)
    if default is None or isinstance(default, bool):  # a switch is off unless given
        return f.metadata["help"]
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    return f"{f.metadata['help']} [default: {shown}]"


def _without_none(annotation: Any) -> Any:
    kinds = [t for t in typing.get_args(annotation) if t is not type(None)]
    return kinds[0] if len(kinds) == 1 else annotation


def _given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings whose flag was given, as EngineConfig takes them: a switch turns its
    setting's default around; ``choices`` and ``parse`` check the rest."""
    given = {}
    for name, value in values.items():
        f = _FIELDS[name]
        if _TYPES[name] is bool:
            if value:
                given[name] = not f.default
            continue
        if value is None:
            continue
        flag, choices, parse = (f.metadata.get(k) for k in ("flag", "choices", "parse"))
        if choices is not None and value not in choices:
            raise typer.BadParameter(
                f"choose from {', '.join(choices)}, got {value!r}", param_hint=flag
            )
        try:
            given[name] = parse(value) if parse is not None else value
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint=flag) from None
    return given
