"""What a decoded event must hold before a reader computes with it: ids in range, fields of
their declared types."""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from ..engine.core.cache_stats import MISS_REASONS
from ..engine.core.events import CacheLookup, Event
from ..engine.sequence import TOKEN_ID_RANGE
from ..workload.mooncake import SynthesizedPrompt
from .format import _CODES, _short


def _check_event(event: Event, num_blocks: int) -> None:
    """Refuse fields that would corrupt a rebuilt state (a negative block id would alias
    another block through Python's negative indexing) or break what reads it (a count that
    is a string, a miss reason no view knows)."""
    for name in ("block_id", "seq_id", "ref_count"):
        v = getattr(event, name, 0)
        if type(v) is not int or v < 0 or (name == "block_id" and v >= num_blocks):
            raise ValueError(f"{type(event).__name__}.{name} = {_short(v)} is out of range")
    for name, ok in _FIELD_CHECKS[type(event)]:
        v = getattr(event, name)
        if not ok(v):
            raise ValueError(f"{type(event).__name__}.{name} = {_short(v)} is not valid")


def _is_number(v: object) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _is_schedule(v: object) -> bool:
    return isinstance(v, list) and all(
        len(x) == 2 and type(x[0]) is int and type(x[1]) is int for x in v
    )


def _is_miss_tokens(v: object) -> bool:
    return isinstance(v, dict) and all(type(n) is int for n in v.values())


def check_json_lists(event: Event) -> None:
    """Version 1's lists, which JSON gives as anything: token ids a trace can hold and a
    recipe that makes a prompt (version 2 checks its own when it decodes a record)."""
    for name in ("token_ids", "prompt_token_ids"):
        v = getattr(event, name, [])
        if not _is_token_ids(v):
            raise ValueError(f"{type(event).__name__}.{name} = {_short(v)} is not token ids")
    if not _is_recipe(getattr(event, "prompt_recipe", None)):
        raise ValueError(f"{type(event).__name__}.prompt_recipe is not a prompt's recipe")


def _is_token_ids(v: object) -> bool:
    """A list of token ids a trace can hold (version 2 stores them as int32)."""
    lo, hi = TOKEN_ID_RANGE
    return type(v) is list and all(type(t) is int and lo <= t < hi for t in v)


def _is_recipe(v: object) -> bool:
    """None, or a recipe that makes a prompt (a synthesized Mooncake prompt)."""
    if v is None:
        return True
    try:
        SynthesizedPrompt.from_recipe(v)
    except ValueError:
        return False
    return True


def _field_checks(cls: type) -> tuple[tuple[str, Callable[[Any], bool]], ...]:
    """A type test for each field of ``cls`` that a reader computes with or looks up,
    from its annotation (a string: events.py defers them)."""
    checks: list[tuple[str, Callable[[Any], bool]]] = []
    for f in fields(cls):
        if f.name in ("block_id", "seq_id", "ref_count"):
            continue  # checked with their ranges
        if f.name in ("block_hash", "parent_hash"):
            continue  # only compared and shown; the most frequent fields, so left unchecked
        if f.name == "reason" and cls is CacheLookup:
            checks.append((f.name, MISS_REASONS.__contains__))
        elif f.type == "int":
            checks.append((f.name, lambda v: type(v) is int))
        elif f.type == "float":
            checks.append((f.name, _is_number))
        elif f.type == "bool":
            checks.append((f.name, lambda v: type(v) is bool))
        elif f.type.startswith("Literal["):
            allowed = frozenset(ast.literal_eval(f.type[len("Literal") :]))
            checks.append((f.name, lambda v, allowed=allowed: type(v) is str and v in allowed))
        elif f.type == "list[tuple[int, int]]":
            checks.append((f.name, _is_schedule))
        elif f.type == "dict[str, int]":
            checks.append((f.name, _is_miss_tokens))

    return tuple(checks)


_FIELD_CHECKS = {cls: _field_checks(cls) for cls in _CODES}
