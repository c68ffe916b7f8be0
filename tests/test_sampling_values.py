"""Sampling values, validated once where ``SamplingParams`` is built (issue #31, findings 1-3):
types (``bool`` is not an integer), finite values, ranges and the seed's range, with messages
that name the field; a temperature below ``GREEDY_TEMPERATURE`` is greedy. The CLI and the
server go through the same check (their tests: ``test_serve.py`` and the CLI cases here)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from decimal import Decimal
from fractions import Fraction
from math import isfinite
from numbers import Integral, Real

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.models import make_tiny_model

from nanokv_cli import LLM
from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.runner.sampler import Sampler
from nanokv_cli.engine.sampling_params import (
    GREEDY_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from nanokv_cli.engine.sequence import Sequence

PROMPT = "The capital of France is"


def nanokv(*args, bounded: bool = False) -> subprocess.CompletedProcess:
    """``nanokv ARGS`` in a subprocess; ``bounded``: a refusal that loads no model, under a
    512 MiB address-space limit and in under 5 s."""

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))

    t0 = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "nanokv_cli.cli", *map(str, args)],
        env={**os.environ, "COLUMNS": "200"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_memory if bounded else None,
    )
    if bounded:
        assert time.perf_counter() - t0 < 5.0, args
    return result


# -- finding 1: a temperature too small for float32 is greedy ------------------------------------


@pytest.mark.parametrize("tiny_temperature", [1e-40, 1e-300, GREEDY_TEMPERATURE / 2])
def test_a_temperature_below_the_epsilon_is_greedy(tiny_temperature):
    assert SamplingParams(temperature=tiny_temperature).temperature == 0.0
    assert SamplingParams(temperature=GREEDY_TEMPERATURE).temperature == GREEDY_TEMPERATURE


@pytest.mark.slow
def test_a_tiny_temperature_gives_the_greedy_text_in_the_cli():
    texts = []
    for temperature in (0, 1e-40, 1e-300):
        result = nanokv(
            "generate", PROMPT, "--max-tokens", 8, "--temperature", temperature, "--json"
        )
        assert result.returncode == 0, result.stderr
        texts.append(json.loads(result.stdout)[0]["token_ids"])
    assert texts[1] == texts[0] and texts[2] == texts[0]


# -- findings 2 and 3: wrong types and ranges, named -----------------------------------------------

BAD_VALUES = [
    # (field, value, exception)
    ("seed", 2**64, ValueError),
    ("seed", -(2**63) - 1, ValueError),
    ("seed", "x", TypeError),
    ("seed", 1.5, TypeError),
    ("seed", True, TypeError),
    ("temperature", "1", TypeError),
    ("temperature", float("inf"), ValueError),
    ("temperature", float("nan"), ValueError),
    ("temperature", 10**400, ValueError),
    ("temperature", -0.5, ValueError),
    ("temperature", None, TypeError),
    ("top_k", True, TypeError),
    ("top_k", 2.0, TypeError),
    ("top_k", -1, ValueError),
    ("max_tokens", True, TypeError),
    ("max_tokens", 0, ValueError),
    ("max_tokens", "8", TypeError),
    ("top_p", 0, ValueError),
    ("top_p", 1.5, ValueError),
    ("top_p", float("nan"), ValueError),
    ("top_p", Decimal("0.5"), TypeError),
    ("ignore_eos", "yes", TypeError),
    ("ignore_eos", 1, TypeError),
]


@pytest.mark.parametrize(("field", "value", "error"), BAD_VALUES)
def test_a_bad_sampling_value_is_one_error_naming_its_field(field, value, error):
    with pytest.raises(error) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(f"{field} must be"), info.value


def test_the_seed_takes_torchs_whole_range():
    for seed in (SEED_MIN, -1, 0, SEED_MAX, np.uint64(SEED_MAX)):
        params = SamplingParams(seed=seed)
        assert type(params.seed) is int
        torch.Generator().manual_seed(params.seed)


def test_engine_switches_are_booleans():
    for name in ("enable_prefix_caching", "enforce_eager"):
        for value in ("yes", 1, None):
            with pytest.raises(TypeError, match=f"{name} must be True or False"):
                EngineConfig(**{name: value})
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        LLM(enable_prefix_caching="yes")  # refused before the model loads


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--seed", 2**64), ("--seed", -(2**63) - 1), ("--top-p", 0), ("--top-p", "nan")],
)
def test_the_cli_names_the_flag_of_a_bad_sampling_value(flag, value):
    result = nanokv("generate", PROMPT, "--max-tokens", 2, flag, value, bounded=True)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert flag in result.stderr, result.stderr


def test_a_prompt_file_line_with_a_bad_value_is_one_error_naming_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "seed": 18446744073709551616}\n')
    result = nanokv("replay", path, "--dry-run", bounded=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"nanokv: error: {path} line 2: seed must be an integer between {SEED_MIN} and "
        f"{SEED_MAX}, got 18446744073709551616"
    ]


# -- finding 14: an I/O error names its path -------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="Linux's /proc")
@pytest.mark.parametrize(
    "command",
    [["replay", "/proc/self/mem", "--dry-run"], ["inspect", "--prompts", "/proc/self/mem"]],
)
def test_a_read_error_names_the_path(command):
    result = nanokv(*command, bounded=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "nanokv: error: /proc/self/mem: Input/output error"
    ]


# -- the property: every value of every type is valid and runs, or is refused by name --------------

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and the infinities included
    st.floats(min_value=-2, max_value=2),
    st.floats(min_value=0, max_value=1e-3),
    st.fractions(),
    st.decimals(),
    st.complex_numbers(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.lists(st.integers(), max_size=3),
    st.builds(np.float32, st.floats(width=32)),
    st.builds(np.int64, st.integers(min_value=-(2**63), max_value=2**63 - 1)),
)
FIELDS = ["temperature", "max_tokens", "ignore_eos", "top_k", "top_p", "seed"]
VOCAB = 97


@pytest.fixture(scope="module")
def sampler_logits():
    return torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 4


def expected_valid(field: str, value) -> bool:
    """The documented domain of each field, written independently of SamplingParams."""
    if field == "ignore_eos":
        return isinstance(value, bool)
    if isinstance(value, bool | Decimal | complex):
        return False
    if field in ("max_tokens", "top_k", "seed"):
        if not isinstance(value, Integral):
            return False
        low, high = {"max_tokens": (1, None), "top_k": (0, None), "seed": (SEED_MIN, SEED_MAX)}[
            field
        ]
        return int(value) >= low and (high is None or int(value) <= high)
    if not isinstance(value, Real):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    if not isfinite(number):
        return False
    return number >= 0 if field == "temperature" else 0 < number <= 1


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(field=st.sampled_from(FIELDS), value=ANY_VALUE)
def test_any_value_is_valid_and_samples_or_is_refused_by_name(field, value, sampler_logits):
    if field == "seed" and value is None:
        value = 0  # None is the seed's "no seed", checked by the defaults
    try:
        params = SamplingParams(**{field: value})
    except (TypeError, ValueError) as e:
        assert not expected_valid(field, value), (field, value, e)
        assert str(e).startswith(f"{field} must be"), e
        return
    assert expected_valid(field, value), (field, value)
    # What passed cannot make a sampling step raise, alone or beside a greedy row.
    sequences = [
        Sequence([1, 2, 3], params, block_size=4),
        Sequence([4], SamplingParams(temperature=0)),
    ]
    tokens = Sampler()(sampler_logits, sequences)
    assert len(tokens) == 2 and all(0 <= t < VOCAB for t in tokens)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("models") / "llama")
    return LLM(str(folder), device="cpu", num_blocks=16, block_size=4)


@pytest.mark.parametrize(
    "fields",
    [
        dict(temperature=GREEDY_TEMPERATURE),
        dict(temperature=1e300),
        dict(temperature=1.0, top_p=1e-300),
        dict(temperature=1.0, top_k=2**62),
        dict(temperature=1.0, seed=SEED_MAX),
        dict(temperature=1.0, seed=SEED_MIN),
        dict(temperature=Fraction(1, 3), top_p=np.float32(0.5), top_k=np.int64(3)),
    ],
)
def test_extreme_valid_values_run_through_the_engine(tiny_llm, fields):
    [out] = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, **fields))
    assert len(out["token_ids"]) == 4
