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
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_SIZE = 512
_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


class MalformedTraceError(ValueError):
    """A trace line that is not a Mooncake request; the message names the line."""


def synthesize_tokens(hash_ids: list[int], input_length: int, vocab_size: int = 32000) -> array:
    """The prompt of a request: hash id ``h`` -> the same 512 tokens wherever it appears.

    Returned as an int64 ``array`` (which Sequence keeps as is): a trace holds ~10^8 prompt
    tokens, and making each one a Python int would cost more than all the accounting."""
    ids = np.asarray(hash_ids, dtype=np.uint64)[:, None]
    pos = np.arange(MOONCAKE_BLOCK_SIZE, dtype=np.uint64)[None, :]
    # splitmix64 finalizer over (id, position): a stateless pseudo-random block per id.
    x = ids * np.uint64(0x9E3779B97F4A7C15) + pos * np.uint64(0xD1B54A32D192ED03)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    tokens = (x.reshape(-1)[:input_length] % np.uint64(vocab_size)).astype("<i8")
    return array("q", tokens.tobytes())


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
        kind, hash_ids, input_length, vocab_size = recipe
        if kind != "mooncake":
            raise ValueError(f"unknown prompt recipe {kind!r}")
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
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedTraceError(f"line {line}: not valid JSON ({e.msg})") from None
    if not isinstance(d, dict) or any(k not in d for k in _KEYS):
        raise MalformedTraceError(f"line {line}: expected the keys {', '.join(_KEYS)}")
    ts, n_in, n_out, ids = (d[k] for k in _KEYS)
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        # json reads NaN and Infinity: a NaN arrival never comes, and replay would wait forever.
        raise MalformedTraceError(f"line {line}: timestamp must be a finite non-negative number")
    for name, v in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(v, int) or v < 1:
            raise MalformedTraceError(f"line {line}: {name} must be a positive integer, got {v!r}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
        raise MalformedTraceError(f"line {line}: hash_ids must be a list of non-negative integers")
    if -(-n_in // MOONCAKE_BLOCK_SIZE) != len(ids):
        raise MalformedTraceError(
            f"line {line}: {len(ids)} hash_ids do not cover input_length {n_in} "
            f"in {MOONCAKE_BLOCK_SIZE}-token blocks"
        )
    return MooncakeRequest(line, ts / 1000.0, n_in, n_out, tuple(ids))


def read_mooncake(path: str | Path, limit: int | None = None) -> Iterator[MooncakeRequest]:
    """Stream the requests of a trace file, validating each line."""
    with open(path, encoding="utf-8") as f:
        n = 0
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            if limit is not None and n >= limit:
                return
            yield parse_mooncake_line(text, lineno)
            n += 1
