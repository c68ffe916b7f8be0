"""Mooncake request traces: ``{"timestamp", "input_length", "output_length", "hash_ids"}``.

``hash_ids`` name 512-token prefix blocks; equal ids at the same position mean the same prefix.
The traces carry no text, so token ids are synthesized: each hash id stands for one fixed
pseudo-random block of 512 tokens, and a request's prompt is its ids' blocks laid end to end,
cut to ``input_length`` (a partial last block holds the first tokens of its id's block).
Tokens are made per request, on demand, so a whole trace never sits in memory.
"""

from __future__ import annotations

import json
import math
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_SIZE = 512
_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
# A request line names one hash id per 512 tokens: 1 MiB of them is tens of millions of tokens,
# beyond any model, so a longer line is refused before it is parsed into a list.
MAX_LINE_CHARS = 1 << 20
_MAX_ID = 1 << 64  # ids are synthesized as uint64
_MAX_LENGTH = 1 << 62  # token counts must fit in int64 arithmetic
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # surrogateescape's bytes that are not UTF-8
_SYNTHESIS_BLOCKS = 1024  # hash ids synthesized at once (4 MiB of temporaries)


class MalformedTraceError(ValueError):
    """A trace line that is not a Mooncake request; the message names the line."""


def synthesize_tokens(hash_ids: list[int], input_length: int, vocab_size: int = 32000) -> array:
    """The prompt of a request: hash id ``h`` -> the same 512 tokens wherever it appears.

    Returned as an int64 ``array`` (which Sequence keeps as is): a trace holds ~10^8 prompt
    tokens, and making each one a Python int would cost more than all the accounting."""
    try:
        ids = np.asarray(hash_ids, dtype=np.uint64).reshape(-1, 1)
    except (OverflowError, TypeError, ValueError):
        raise ValueError("hash ids must be integers from 0 to 2**64 - 1") from None
    n = max(0, min(input_length, len(ids) * MOONCAKE_BLOCK_SIZE))
    out = array("q", bytes(8 * n))
    view = np.frombuffer(out, dtype="<i8")
    # A few blocks at a time: the temporaries stay small however long the prompt.
    for first in range(0, -(-n // MOONCAKE_BLOCK_SIZE), _SYNTHESIS_BLOCKS):
        at = first * MOONCAKE_BLOCK_SIZE
        part = _block_tokens(ids[first : first + _SYNTHESIS_BLOCKS], vocab_size)
        view[at : at + len(part)] = part[: n - at]
    return out


def _block_tokens(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    pos = np.arange(MOONCAKE_BLOCK_SIZE, dtype=np.uint64)[None, :]
    # splitmix64 finalizer over (id, position): a stateless pseudo-random block per id.
    x = ids * np.uint64(0x9E3779B97F4A7C15) + pos * np.uint64(0xD1B54A32D192ED03)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x.reshape(-1) % np.uint64(vocab_size)).astype("<i8")


@dataclass(frozen=True)
class SynthesizedPrompt:
    """A prompt known by its recipe: call it for the tokens. Traces store the recipe (a few
    hash ids) instead of the tokens, which for a whole trace would be ~10^8 of them."""

    hash_ids: tuple[int, ...]
    input_length: int
    vocab_size: int = 32000

    def __call__(self) -> array:
        return synthesize_tokens(list(self.hash_ids), self.input_length, self.vocab_size)

    def recipe(self) -> list:
        return ["mooncake", list(self.hash_ids), self.input_length, self.vocab_size]

    @classmethod
    def from_recipe(cls, recipe: list) -> SynthesizedPrompt:
        """The prompt a trace's recipe names; ValueError for a malformed recipe."""
        if not isinstance(recipe, list | tuple) or len(recipe) != 4:
            raise ValueError(f"malformed prompt recipe {_short(recipe)}")
        kind, hash_ids, input_length, vocab_size = recipe
        if kind != "mooncake":
            raise ValueError(f"unknown prompt recipe {_short(kind)}")
        ok = isinstance(hash_ids, list | tuple) and all(
            type(h) is int and 0 <= h < _MAX_ID for h in hash_ids
        )
        ok = (
            ok
            and type(input_length) is int
            and 0 <= input_length <= MOONCAKE_BLOCK_SIZE * len(hash_ids)
        )
        if not ok or type(vocab_size) is not int or not 1 <= vocab_size < _MAX_ID:
            raise ValueError(f"malformed prompt recipe {_short(recipe)}")
        return cls(tuple(hash_ids), input_length, vocab_size)


@dataclass(frozen=True)
class MooncakeRequest:
    line: int
    timestamp: float  # seconds since the trace's start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def prompt_token_ids(self, vocab_size: int = 32000) -> array:
        return synthesize_tokens(list(self.hash_ids), self.input_length, vocab_size)

    @property
    def prompt(self) -> SynthesizedPrompt:
        return SynthesizedPrompt(self.hash_ids, self.input_length)


def parse_mooncake_line(text: str, line: int) -> MooncakeRequest:
    if len(text) > MAX_LINE_CHARS:
        raise MalformedTraceError(f"line {line}: longer than {MAX_LINE_CHARS:,} characters")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedTraceError(f"line {line}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise MalformedTraceError(f"line {line}: JSON nested too deeply") from None
    if not isinstance(d, dict) or any(k not in d for k in _KEYS):
        raise MalformedTraceError(f"line {line}: expected the keys {', '.join(_KEYS)}")
    ts, n_in, n_out, ids = (d[k] for k in _KEYS)
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        # json reads NaN and Infinity: a NaN arrival never comes, and replay would wait forever.
        raise MalformedTraceError(f"line {line}: timestamp must be a finite non-negative number")
    for name, v in (("input_length", n_in), ("output_length", n_out)):
        if type(v) is not int or not 1 <= v < _MAX_LENGTH:
            raise MalformedTraceError(
                f"line {line}: {name} must be a positive integer, got {_short(v)}"
            )
    if not isinstance(ids, list) or not all(type(h) is int and 0 <= h < _MAX_ID for h in ids):
        raise MalformedTraceError(
            f"line {line}: hash_ids must be a list of integers from 0 to 2**64 - 1"
        )
    if -(-n_in // MOONCAKE_BLOCK_SIZE) != len(ids):
        raise MalformedTraceError(
            f"line {line}: {len(ids)} hash_ids do not cover input_length {n_in} "
            f"in {MOONCAKE_BLOCK_SIZE}-token blocks"
        )
    return MooncakeRequest(line, ts / 1000.0, n_in, n_out, tuple(ids))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_mooncake(path: str | Path, limit: int | None = None) -> Iterator[MooncakeRequest]:
    """Stream the requests of a trace file, validating each line."""
    # Bad bytes read as lone surrogates, so the error names their line (strict decoding
    # fails on the first line of the chunk that holds them).
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        n = 0
        # readline's cap: a huge line is refused without being read whole.
        lines = iter(lambda: f.readline(MAX_LINE_CHARS + 1), "")
        for lineno, text in enumerate(lines, 1):
            if not text.isascii() and _UNDECODABLE.search(text):
                raise MalformedTraceError(f"line {lineno}: not UTF-8 text")
            if not text.strip():
                continue
            if limit is not None and n >= limit:
                return
            yield parse_mooncake_line(text, lineno)
            n += 1
