"""Per-request sampling settings, validated once where they are built.

Values reach here straight from flags, prompt files, HTTP bodies and Python callers, so every
field is checked for its type (``bool`` is not an integer here, although Python says it is),
for being finite and for its range, with a message that starts with the field's name (the CLI
turns it into a flag, the server into OpenAI's ``param``). Whatever passes cannot make a
sampling step raise.
"""

from dataclasses import dataclass
from math import isfinite
from numbers import Integral, Real
from typing import Any

# Temperatures below this are greedy, as in vLLM: logits / 1e-40 overflow float32 to inf, and
# the softmax of inf is NaN (sampling then returned garbage tokens).
GREEDY_TEMPERATURE = 1e-5
# What torch.Generator.manual_seed takes: int64 and uint64 values.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature 0 (or below ``GREEDY_TEMPERATURE``) is greedy.

    Invalid values raise ``TypeError`` (wrong type) or ``ValueError`` (out of range) naming the
    field. Numbers are stored as ``float`` and ``int``.
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        temperature = _number("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature = 0.0 if temperature < GREEDY_TEMPERATURE else temperature
        self.max_tokens = _integer("max_tokens", self.max_tokens, 1)
        self.top_k = _integer("top_k", self.top_k, 0)
        self.top_p = _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, SEED_MIN, SEED_MAX)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a boolean, got {_show(self.ignore_eos)}")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = float("inf") if value > 0 else float("-inf")
    if not isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {number}")
    return number


def _integer(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an integer, got {_show(value)}")
    number = int(value)
    if number < minimum or (maximum is not None and number > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        # Never echo a huge number whole (nor make its decimal text: Python refuses past 4,300
        # digits): its size in digits says enough.
        digits = int(number.bit_length() * 0.30103) + 1
        shown = number if digits <= 40 else f"a number of about {digits:,} digits"
        raise ValueError(f"{name} must be an integer {bound}, got {shown}")
    return number


def _show(value: Any) -> str:
    text = repr(value)
    return (
        f"{text[:40]}... ({type(value).__name__})"
        if len(text) > 40
        else f"{text} ({type(value).__name__})"
    )
