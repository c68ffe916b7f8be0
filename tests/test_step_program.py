"""The recorded decode step's contract (``engine/cpu/contract.py``, ``program.py``): the C side
is built from the one table and refuses to load against another, a recording refuses what a
replay would drop, and a program holds what it points at and refuses to run once it moved."""

import dataclasses
import gc
import json
import subprocess
import sys
import weakref

import pytest
import torch
from safetensors.torch import load_file
from support.models import make_tiny_model

from nanokv_cli.engine.config import EngineConfig, ModelConfig
from nanokv_cli.engine.cpu import build, contract
from nanokv_cli.engine.cpu import kernels as cpu_kernels
from nanokv_cli.engine.cpu import program as cpu_program
from nanokv_cli.engine.cpu.program import RecordingError, StaleProgramError, StepProgram
from nanokv_cli.engine.runner.model_runner import ModelRunner
from nanokv_cli.engine.runner.run_plan import resolve_plan
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.engine.sequence import Sequence

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")

SYMBOLS = tuple(contract.signatures())


def retyped(entries, name: str, old: str, new: str) -> tuple:
    """``entries`` with ``old`` replaced by ``new`` in ``name``'s declaration."""
    changed = []
    for e in entries:
        if e.name == name:
            assert old in e.declaration
            e = dataclasses.replace(e, declaration=e.declaration.replace(old, new))
        changed.append(e)
    return tuple(changed)


# -- one table --------------------------------------------------------------------------------


def test_ctypes_and_the_program_layout_are_read_off_the_table():
    assert cpu_kernels._SIGNATURES == contract.signatures()
    argtypes, restype = cpu_kernels._SIGNATURES["paged_decode_f32"]
    assert len(argtypes) == 17 and restype is not None  # it returns a failure flag
    # the replayed kernels are numbered in the table's order, with their outputs' positions
    header = contract.header()
    kernels = contract.program_kernels()
    assert list(kernels)[:2] == ["rms_norm_f32", "rotary_f32"] and kernels["linear_f32"] == (4,)
    assert "PROGRAM_RMS_NORM_F32 = 0, PROGRAM_ROTARY_F32 = 1" in header
    assert f"#define PROGRAM_ARGS {contract.PROGRAM_ARGS}" in header
    assert contract.PROGRAM_ARGS == max(len(a) for a, _ in map(contract.signatures().get, kernels))


@pytest.mark.parametrize(
    "name, old, new",
    [
        ("rms_norm_f32", "int64_t dim", "int dim"),  # a type
        ("silu_mul_f32", ", int threads", ""),  # an argument fewer
        ("linear_f32", "int linear_f32", "void linear_f32"),  # the result
    ],
)
def test_a_c_definition_that_disagrees_with_the_table_does_not_build(tmp_path, name, old, new):
    # The header generated from the table declares every entry point: the compiler checks
    # each definition in csrc/ against it, so ctypes and the C code cannot drift apart.
    entries = retyped(contract.ENTRY_POINTS, name, old, new)
    generic = build.VARIANTS[-1]
    with pytest.raises(build.KernelBuildError, match=f"conflicting types for .{name}"):
        build.build_library(generic, build.find_compiler(), tmp_path / "x.so", SYMBOLS, entries)
    assert not (tmp_path / "x.so").exists()


def test_a_library_built_from_another_table_is_rebuilt_not_called(tmp_path, monkeypatch):
    # Swapping two replayed kernels compiles (each keeps its own signature) but renumbers
    # them: a program of this process's ids would run store_kv where it recorded rotary.
    entries = list(contract.ENTRY_POINTS)
    entries[1], entries[2] = entries[2], entries[1]
    assert contract.contract_id(entries) != contract.contract_id()
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path))
    variant, compiler = build.active_variant(), build.find_compiler()
    path = build.library_path(variant, compiler)
    build.build_library(variant, compiler, path, SYMBOLS, tuple(entries))
    lib, lacking = build.open_library(path, SYMBOLS, contract.contract_id())
    assert lib is None and f"contract {contract.contract_id()}" in lacking[0]
    assert contract.contract_id(entries) in lacking[0]  # what it was built from
    # Found in the cache where this table's library belongs: rebuilt from this table.
    loaded = build.kernels(SYMBOLS)
    assert loaded.built and loaded.path == path
    reported = loaded.lib.nanokv_contract
    reported.restype = contract.signatures()["nanokv_contract"][1]
    assert reported() == contract.contract_id().encode()


# -- recording refuses what a replay would drop ----------------------------------------------


def test_recording_refuses_a_torch_op_that_computes():
    x, weight = torch.randn(2, 64), torch.ones(64)
    for stray in (
        lambda h: h + 1,
        lambda h: h.mul_(2),
        lambda h: torch.zeros(2, 64),  # contents a replay would not write
        lambda h: h.t().reshape(-1),  # a reshape that has to copy
        lambda h: h.to(torch.float64),
    ):
        with pytest.raises(RecordingError, match="a replay runs only the C kernel calls"):
            with cpu_program.recording():
                stray(cpu_kernels.rms_norm(x, weight, 1e-5))
    with pytest.raises(RecordingError, match="aten.add.Tensor computes"):
        with cpu_program.recording():
            cpu_kernels.rms_norm(x, weight, 1e-5) + 1


def test_recording_lets_views_and_allocations_through():
    x, weight = torch.randn(2, 4, 16), torch.randn(16)
    with cpu_program.recording() as tape:
        rows = x.view(8, 16)[:, :].reshape(2, 4, 16).to(torch.float32).contiguous()
        out = torch.empty(2, 4, 16)
        cpu_kernels.rms_norm(rows, weight, 1e-5, out=out)
    program = StepProgram(tape, [x], out, {weight.untyped_storage().data_ptr()})
    replayed = program.run(torch.empty(program.arena_bytes, dtype=torch.uint8), [x], 2, 0)
    assert torch.equal(replayed, out)


def test_recording_refuses_a_kernel_no_program_replays():
    values, scale = torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, 1, dtype=torch.float16)
    with pytest.raises(RecordingError, match="q8p_pack ran inside a recorded step"):
        with cpu_program.recording():
            cpu_kernels.pack(cpu_kernels.LINEAR_Q8P, values, scale)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return config, load_file(str(folder / "model.safetensors"))


def test_a_torch_op_in_the_decoder_fails_the_recorded_step(tiny_llama):
    # Before, the extra op ran on the recorded step and was missing from every replay after:
    # a model whose replayed steps silently computed something else.
    config, weights = tiny_llama
    settings = EngineConfig(
        block_size=8, num_blocks=16, dtype="float32", device="cpu", quantization="none"
    )
    runner = ModelRunner(config, weights, resolve_plan(config, settings))
    mlp = runner.model.model.layers[0].mlp
    forward = mlp.forward
    mlp.forward = lambda x: forward(x) * 0.5
    seq = Sequence([5, 6, 7], SamplingParams(temperature=0.0), block_size=8)
    seq.block_table, seq.num_scheduled_tokens = [0, 1], 3
    token = runner.run_logits([seq]).argmax(-1).item()  # the prompt: not recorded
    seq.num_cached_tokens += 3
    seq.append_token(token)
    seq.num_scheduled_tokens = 1
    with pytest.raises(RecordingError, match="aten.mul.Tensor computes"):
        runner.run_logits([seq])  # the first decode step: recorded
    assert runner.program is None


# -- a program holds what it points at --------------------------------------------------------


def recorded_norm(x: torch.Tensor, weight: torch.Tensor) -> tuple[StepProgram, torch.Tensor]:
    with cpu_program.recording() as tape:
        out = cpu_kernels.rms_norm(x, weight, 1e-5)
    return StepProgram(tape, [x], out, {weight.untyped_storage().data_ptr()}), out.clone()


def replay(program: StepProgram, *inputs: torch.Tensor) -> torch.Tensor:
    arena = torch.empty(program.arena_bytes, dtype=torch.uint8)
    return program.run(arena, list(inputs), inputs[0].shape[0], 0)


def test_a_program_keeps_the_weights_and_specs_it_points_at_alive():
    g = torch.Generator().manual_seed(3)
    x, norm, w = (torch.randn(*s, generator=g) for s in ((2, 64), (64,), (48, 64)))
    spec = cpu_kernels.linear_spec(cpu_kernels.LINEAR_F32, w, 64, bias=torch.randn(48))
    persistent = {t.untyped_storage().data_ptr() for t in (norm, w, spec.tensors[1])}
    with cpu_program.recording() as tape:
        out = cpu_kernels.linear(spec, cpu_kernels.rms_norm(x, norm, 1e-5))
    program, expected = StepProgram(tape, [x], out, persistent), out.clone()
    held = [weakref.ref(t) for t in (norm, w, *spec.tensors)]
    del tape, out, norm, w, spec
    gc.collect()
    assert all(ref() is not None for ref in held)
    _ = torch.randn(48, 64), torch.randn(64)  # memory a freed weight would have lent
    assert torch.equal(replay(program, x), expected)


def test_a_program_refuses_a_spec_it_cannot_hold():
    w = torch.randn(8, 32)
    bare = cpu_kernels.LinearSpec(cpu_kernels.LINEAR_F32, 8, 32, w.data_ptr(), None)
    x = torch.randn(1, 32)
    with cpu_program.recording() as tape:
        out = cpu_kernels.linear(bare, x)
    with pytest.raises(ValueError, match="must come from kernels.linear_spec"):
        StepProgram(tape, [x], out, {w.untyped_storage().data_ptr()})


@pytest.mark.parametrize(
    "move",
    [
        lambda t: setattr(t, "data", torch.randn(64)),
        lambda t: t.set_(torch.randn(64)),
        lambda t: t.resize_(1 << 20),  # grown past its storage: reallocated
    ],
    ids=["data", "set_", "resize_"],
)
def test_a_stale_program_is_refused_after_a_pointed_at_tensor_moved(move):
    x, weight = torch.randn(2, 64), torch.randn(64)
    program, expected = recorded_norm(x, weight)
    assert torch.equal(replay(program, x), expected)
    weight.add_(1.0)  # new values in place: read afresh, so the program still holds
    assert not torch.equal(replay(program, x), expected)
    with torch.no_grad():
        move(weight)
    with pytest.raises(StaleProgramError, match="moved since it was recorded"):
        replay(program, x)


def test_a_recording_costs_no_compiler_import(tmp_path):
    # The guard is a torch dispatch mode, which torch would wrap to keep torch.compile out,
    # importing torch._dynamo and sympy (~1.2 s) on a process's first recorded decode step.
    folder = make_tiny_model("llama", tmp_path / "m")
    script = (
        "import sys\n"
        "from nanokv_cli import LLM, SamplingParams\n"
        f"llm = LLM({str(folder)!r}, device='cpu', num_blocks=16, block_size=8)\n"
        "llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))\n"
        "assert llm.model_runner.program is not None, 'no decode step was recorded'\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
