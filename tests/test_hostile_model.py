"""Hostile or careless model metadata, cache sizes and devices, met where a user meets them:
``nanokv generate`` in a subprocess under an address-space limit and a time limit (issue 17,
findings 4 and 10). Each run ends with exit 1 and one ``nanokv: error:`` line naming the bad
value or what to lower, or, where the run can go ahead, with its text; never a traceback.

The runs are independent, so one fixture starts them all (two at a time) and each test checks
its own; the file takes ~40 s, most of it importing torch 25 times.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.models import make_tiny_model, write_gguf

from nanokv_cli.engine.config import EngineConfig, ModelConfig
from nanokv_cli.engine.model.loader import load_model
from nanokv_cli.engine.runner.kv_cache import check_memory_fits, default_cpu_kv_cache_memory
from nanokv_cli.engine.runner.memory import InsufficientMemoryError, memory_limit
from nanokv_cli.engine.runner.run_plan import resolve_plan

REPO = Path(__file__).resolve().parents[1]
# Address space each run may take: importing torch and running a tiny model (or the default
# one) takes ~1.3 GiB here; a run that sized an allocation from a hostile value would need far
# more.
ADDRESS_SPACE = 4 << 30
TIMEOUT_S = 60
RUNS_AT_ONCE = 2  # importing torch is CPU-bound: more at once only queue


@dataclass(frozen=True)
class Case:
    model: str  # a key of the `models` fixture
    args: tuple[str, ...] = ()
    expect: str | None = None  # in the one error line; None: the run succeeds
    limit: int = ADDRESS_SPACE


# Values from the adversarial probe (issue 17). Config fields are edited into a copy of a tiny
# Llama folder; GGUF keys are written by converting such a copy.
CONFIGS: dict[str, dict] = {
    "layers_1e9": {"num_hidden_layers": 10**9},
    "layers_0": {"num_hidden_layers": 0},
    "layers_negative": {"num_hidden_layers": -2},
    "heads_0": {"num_attention_heads": 0},
    "layers_string": {"num_hidden_layers": "2"},
    "layers_float": {"num_hidden_layers": 2.5},
    "positions_negative": {"max_position_embeddings": -5},
    "positions_0": {"max_position_embeddings": 0},
    "positions_1e12": {"max_position_embeddings": 10**12},
    "eps_string": {"rms_norm_eps": "abc"},
    "rope_scaling_string": {"rope_scaling": "linear"},
    "rope_theta_negative": {"rope_parameters": None, "rope_theta": -1},
    # Within bounds, but its RoPE table (~6 GiB to build) does not fit under ADDRESS_SPACE.
    "positions_2e24": {"max_position_embeddings": 1 << 24},
}
GGUF_CONFIGS: dict[str, dict] = {
    "gguf_block_count": {"num_hidden_layers": 2**32 - 1},
    "gguf_context_length": {"max_position_embeddings": 2**32 - 1},
}

CASES: dict[str, Case] = {
    # -- finding 4: model metadata
    "layers_1e9": Case("layers_1e9", expect="num_hidden_layers is 1000000000"),
    "layers_0": Case("layers_0", expect="num_hidden_layers is 0"),
    "layers_negative": Case("layers_negative", expect="num_hidden_layers is -2"),
    "heads_0": Case("heads_0", expect="num_attention_heads is 0"),
    "layers_string": Case("layers_string", expect="num_hidden_layers is '2'"),
    "layers_float": Case("layers_float", expect="num_hidden_layers is 2.5"),
    "positions_negative": Case("positions_negative", expect="max_position_embeddings is -5"),
    "positions_0": Case("positions_0", expect="max_position_embeddings is 0"),
    "positions_1e12": Case("positions_1e12", expect="max_position_embeddings is 1000000000000"),
    "eps_string": Case("eps_string", expect="rms_norm_eps is 'abc'"),
    "rope_scaling_string": Case("rope_scaling_string", expect="rope_scaling is 'linear'"),
    "rope_theta_negative": Case("rope_theta_negative", expect="rope_theta is -1"),
    "gguf_block_count": Case(
        "gguf_block_count", expect="llama.block_count (num_hidden_layers) is 4294967295"
    ),
    "gguf_context_length": Case(
        "gguf_context_length",
        expect="llama.context_length (max_position_embeddings) is 4294967295",
    ),
    "nan_weights": Case("nan_weights", expect="non-finite logits"),
    "nan_weights_sampled": Case(
        "nan_weights", ("--temperature", "0.8", "--seed", "1"), expect="non-finite logits"
    ),
    "positions_2e24": Case("positions_2e24", expect="lower --max-model-len"),
    "positions_2e24_capped": Case("positions_2e24", ("--max-model-len", "512")),
    # -- finding 10: cache sizes and devices
    "block_size_1e12": Case("tiny", ("--block-size", str(10**12)), expect="lower --block-size"),
    "num_blocks_1e12": Case("tiny", ("--num-blocks", str(10**12)), expect="lower --num-blocks"),
    "kv_cache_memory_1000TB": Case(
        "default", ("--kv-cache-memory", "1000TB"), expect="lower --kv-cache-memory"
    ),
    # Where CUDA runs, a bare cuda is fine; else the message says why not (CPU build, no GPU).
    "device_cuda": Case(
        "tiny", ("--device", "cuda"), expect=None if torch.cuda.is_available() else "--device cuda:"
    ),
    "device_cuda_99": Case("tiny", ("--device", "cuda:99"), expect="--device cuda:99"),
    "device_mps": Case("tiny", ("--device", "mps"), expect="--device mps: nanokv runs on cpu"),
    # The default cache was 4 GiB (a quarter of MemAvailable) whatever `ulimit -v` said.
    "default_under_3GiB": Case("default", limit=3 << 30),
}


def _variant(base: Path, folder: Path, overrides: dict) -> Path:
    shutil.copytree(base, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in overrides.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _nan_weights(base: Path, folder: Path) -> Path:
    shutil.copytree(base, folder)
    weights = load_file(str(folder / "model.safetensors"))
    nan = {name: torch.full_like(w, float("nan")) for name, w in weights.items()}
    save_file(nan, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str | None]:
    root = tmp_path_factory.mktemp("hostile")
    base = make_tiny_model("llama", root / "tiny")
    paths: dict[str, str | None] = {"tiny": str(base), "default": None}
    for name, overrides in CONFIGS.items():
        paths[name] = str(_variant(base, root / name, overrides))
    for name, overrides in GGUF_CONFIGS.items():
        source = _variant(base, root / f"{name}-src", overrides)
        paths[name] = str(write_gguf(source, root / f"{name}.gguf"))
    paths["nan_weights"] = str(_nan_weights(base, root / "nan"))
    return paths


@dataclass(frozen=True)
class Run:
    returncode: int | None  # None: killed at TIMEOUT_S
    stdout: str
    stderr: str


def _generate(model: str | None, case: Case) -> Run:
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (case.limit, case.limit))

    command = [sys.executable, "-m", "nanokv_cli.cli", "generate", "The capital of France is"]
    command += ["--max-tokens", "4", "--no-live", *case.args]
    if model is not None:
        command += ["--model", model]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    try:
        proc = subprocess.run(
            command,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            preexec_fn=limit_memory,
        )
    except subprocess.TimeoutExpired as e:
        return Run(None, str(e.stdout or ""), str(e.stderr or ""))
    return Run(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="module")
def runs(models) -> dict[str, Run]:
    with ThreadPoolExecutor(RUNS_AT_ONCE) as pool:
        futures = {
            name: pool.submit(_generate, models[case.model], case) for name, case in CASES.items()
        }
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_cli_run(runs, name):
    case, run = CASES[name], runs[name]
    assert run.returncode is not None, f"still running after {TIMEOUT_S} s"
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    if case.expect is None:
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip()
        return
    # Besides the start-up line that says what the KV cache took, the error alone.
    said = run.stderr.strip().splitlines()
    lines = [line for line in said if not line.startswith("nanokv: KV cache ")]
    assert run.returncode == 1, run.stderr
    assert len(lines) == 1 and lines[0].startswith("nanokv: error: "), run.stderr
    assert case.expect in lines[0]


# -- the checks themselves, in process ------------------------------------------------------------


def test_config_bounds_name_the_field_and_the_range(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "tiny")
    raw = json.loads((folder / "config.json").read_text())
    assert ModelConfig.from_hf(raw).num_hidden_layers == 2
    for key, value, message in [
        ("num_key_value_heads", 3, "must divide num_attention_heads (4)"),
        ("head_dim", 15, "rotary embeddings need it even"),
        ("rms_norm_eps", float("nan"), "finite number above 0 and below 1"),
        ("rope_theta", float("inf"), "finite number above 0"),
        ("vocab_size", True, "an integer from 1 to 4,194,304"),
        ("tie_word_embeddings", "false", "true or false"),
        ("eos_token_id", ["2"], "token ids are integers >= 0"),
        # Past the embedding: it could never be sampled, so never stop generation (issue #49).
        ("eos_token_id", 320, "outside the vocabulary (320 ids: 0 to 319)"),
        ("bos_token_id", -1, "outside the vocabulary (320 ids"),
    ]:
        with pytest.raises(ValueError, match=f"{key}.*{re.escape(message)}"):
            ModelConfig.from_hf({**raw, key: value})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_hf({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0}
    llama3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="must exceed low_freq_factor"):
        ModelConfig.from_hf({**raw, "rope_scaling": llama3})


def test_parameter_count_matches_the_weights(tmp_path):
    for arch, overrides in [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {})]:
        loaded = load_model(make_tiny_model(arch, tmp_path / arch, **overrides))
        # Tied: lm_head.weight is not among the weights, the embedding is counted once.
        assert loaded.config.parameter_count() == sum(
            loaded.weights[name].numel() for name in loaded.weights
        )


class _AddressSpace:
    """This process's RLIMIT_AS lowered to ``headroom`` bytes past what it uses now, for
    checks that only read limits (nothing is allocated while it holds)."""

    def __init__(self, headroom: int) -> None:
        self.headroom = headroom

    def __enter__(self) -> None:
        self.saved = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (used + self.headroom, self.saved[1]))

    def __exit__(self, *exc_info: object) -> None:
        resource.setrlimit(resource.RLIMIT_AS, self.saved)


def test_memory_checks_follow_the_address_space_limit():
    config = load_model().config  # SmolLM2-135M: ~540 MB of float32 weights
    long = ModelConfig(**{**config.__dict__, "max_position_embeddings": 1 << 24})

    def plan(model: ModelConfig, quantization: str | None, **settings):
        settings = EngineConfig(device="cpu", dtype="float32", **settings)
        return replace(resolve_plan(model, settings), quantization=quantization)

    # Planned before the limits below: a plan allocates nothing, but torch may on first use.
    auto, auto_big_cache = plan(config, "auto"), plan(config, "auto", num_blocks=10**6)
    float32, float32_long = plan(config, None), plan(long, None)
    with _AddressSpace(256 << 20):
        limit = memory_limit(torch.device("cpu"))
        assert limit.counts_reserved and "ulimit -v" in limit.source
        assert limit.free <= 256 << 20
        assert default_cpu_kv_cache_memory() <= 128 << 20  # half of the headroom at most
        with pytest.raises(InsufficientMemoryError, match="weights .* raise the limit"):
            check_memory_fits(config, auto)
        with pytest.raises(InsufficientMemoryError, match="lower --num-blocks"):
            check_memory_fits(config, auto_big_cache)
    with _AddressSpace(4 << 30):
        check_memory_fits(config, float32)
        with pytest.raises(InsufficientMemoryError, match=r"lower --max-model-len \(16777216\)"):
            check_memory_fits(long, float32_long)
