"""The packed weight formats (cpu/kernels.py; csrc/q4.c, csrc/q8.c) against float64 references.

Each kernel's result is compared with the float64 product of the dequantized weights and the
input rounded exactly as the kernel rounds it (int16 per 32, both formats, every row), so the
only difference left is float32 accumulation, bounded here per output. Run it under every instruction-set variant the CPU has:

    for isa in generic avx2 avx512; do NANOKV_CPU_ISA=$isa python -m pytest -q tests/test_cpu_formats.py; done
"""

import ctypes

import pytest
import torch
import torch.nn.functional as F
from support.kernels import Layer

from nanokv_cli.engine.cpu import build, kernels
from nanokv_cli.engine.cpu.kernels import LINEAR_Q4P, LINEAR_Q8P

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler")

ROW_COUNTS = [*range(1, 14), 64, 300]
# (out, in): padded panels (out % 16 != 0), an odd number of 32-blocks, and one big enough that
# a single row runs on two threads.
SHAPES = [(40, 96), (200, 256), (1000, 288)]
EPS32 = 2.0**-24
# every product the kernels compute, on int16 inputs
KINDS = [LINEAR_Q4P, LINEAR_Q8P]
KIND_IDS = ["q4p", "q8p"]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def rounded_inputs(x: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """x as the kernels see it, in float64: rounded per 32 to int16 (d = max|x| / 32767), in
    float32 as the C code does; ``bits=8``: to int8 (d = max|x| / 127) as llama.cpp rounds."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    # tensors divide tensors: torch may take a scalar division as a multiply by the reciprocal,
    # which rounds differently from the C division (and moves ties)
    ones = torch.ones_like(amax)
    if bits == 8:
        d = amax / (127.0 * ones)
        inv = torch.where(d > 0, ones / torch.where(d > 0, d, ones), 0.0)
    else:
        d = amax / (32767.0 * ones)
        inv = torch.where(amax > 0, 32767.0 * ones / torch.where(amax > 0, amax, ones), 0.0)
    q = torch.round(blocks * inv)
    return (q.double() * d.double()).reshape(x.shape)


def check_product(layer: Layer, x: torch.Tensor, bias=None) -> None:
    y = layer.linear(x, bias)
    assert y.shape == (x.shape[0], layer.out_features) and y.dtype == torch.float32
    xr = rounded_inputs(x)
    reference = xr @ layer.weight64.T
    if bias is not None:
        reference += bias.double()
    # a few float32 roundings per 32-block, each at most the size of the terms summed so far
    bound = (4 * layer.in_features // 32 + 8) * EPS32 * (xr.abs() @ layer.magnitude64.T)
    if bias is not None:
        bound += EPS32 * bias.double().abs()
    error = (y.double() - reference).abs()
    assert bool((error <= bound + 1e-30).all()), f"max error / bound {float((error / bound).max())}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_every_row_count_matches_the_float64_product(kind, shape, threads):
    layer = Layer(kind, *shape)
    g = torch.Generator().manual_seed(1)
    for n in ROW_COUNTS:
        check_product(layer, torch.randn(n, shape[1], generator=g))


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_bias_and_strided_rows(kind, threads):
    layer = Layer(kind, 200, 256, seed=2)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(200, generator=g)
    wide = torch.randn(13, 300, generator=g)
    for n in (1, 5, 13):
        check_product(layer, wide[:n, 7:263], bias)  # row stride 300, not 256


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_a_rows_result_does_not_depend_on_its_batch(kind, threads):
    """Row i's output is the same bits alone, in any tile of a batch, on any thread count."""
    layer = Layer(kind, 1000, 288, seed=4)
    x = torch.randn(300, 288, generator=torch.Generator().manual_seed(5))
    full = layer.linear(x)
    for i in (0, 5, 6, 7, 150, 299):
        assert torch.equal(layer.linear(x[i : i + 1]), full[i : i + 1])
    for start in (0, 1, 3, 6, 11, 287):
        for n in (*range(2, 14), 64):
            if start + n <= 300:
                assert torch.equal(layer.linear(x[start : start + n]), full[start : start + n])


@pytest.mark.parametrize("kind", [LINEAR_Q4P, LINEAR_Q8P], ids=["q4p", "q8p"])
def test_dequantized_rows_are_the_weights_the_kernels_use(kind, threads):
    layer = Layer(kind, 40, 96, seed=6)
    rows = torch.tensor([0, 39, 7, 16, 15, 7, 33])
    assert torch.equal(layer.dequantize_rows(rows), layer.float32_weight()[rows])
    if kind == LINEAR_Q8P:  # scale * q is one rounding of the exact product
        assert torch.equal(layer.dequantize_rows(torch.arange(40)), layer.weight64.float())
    with pytest.raises(IndexError):
        layer.dequantize_rows(torch.tensor([40]))


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_int16_inputs_keep_the_float_product_within_1e4_per_row(kind):
    """LINEAR_Q8P serves the LM head, LINEAR_Q4P the projections: against the unrounded float
    product, an output row is off by at most 1e-4 of its norm, also for inputs with outlier
    channels (as hidden states have), where int8 inputs (llama.cpp's rounding) are off by
    ~1e-2."""
    layer = Layer(kind, 2048, 576, seed=7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(16, 576, generator=g)
    x[:, [3, 100, 257, 400]] *= 30.0
    exact_product = x.double() @ layer.weight64.T

    def relative(y):
        return (y.double() - exact_product).norm(dim=1) / exact_product.norm(dim=1)

    assert float(relative(layer.linear(x)).max()) <= 1e-4
    # so the bound is one that int8 inputs would not meet:
    assert float(relative(rounded_inputs(x, bits=8) @ layer.weight64.T).min()) > 1e-3


def _runs_here(variant: str) -> bool:
    try:
        build.choose_variant(build.cpu_features(), variant)
    except build.KernelBuildError:
        return False
    return True


def _linear_in(variant: str, layer: Layer, x: torch.Tensor) -> torch.Tensor:
    """layer(x) computed by one instruction-set build's library, loaded beside this process's."""
    function = build.load(variant)["linear_f32"]  # a fresh function object: argtypes are ours
    argtypes, function.restype = kernels._SIGNATURES["linear_f32"]
    function.argtypes = argtypes
    spec = layer.spec()
    y = torch.empty(x.shape[0], layer.out_features)
    failed = function(
        ctypes.byref(spec),
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        y.data_ptr(),
        y.stride(0),
        1,
    )
    assert not failed
    return y


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_avx2_and_avx512_builds_give_the_same_bits(kind):
    """Exact integer sums and the same float steps per block: the vector builds agree bit for
    bit (plain C too where it has a hardware FMA, which x86-64's baseline has not)."""
    if not all(_runs_here(v) for v in ("avx2", "avx512")):
        pytest.skip("needs a CPU that runs both the AVX2 and the AVX-512 build")
    layer = Layer(kind, 200, 288, seed=13)
    x = torch.randn(20, 288, generator=torch.Generator().manual_seed(14))
    x[:, 5] *= 40.0
    assert torch.equal(_linear_in("avx2", layer, x), _linear_in("avx512", layer, x))


def test_packed_sizes_and_shape_checks():
    assert kernels.packed_bytes(LINEAR_Q4P, 40, 96) == 3 * 3 * 320  # 0.625 bytes per weight
    assert kernels.packed_bytes(LINEAR_Q8P, 40, 96) == 3 * 3 * 544  # 1.0625 bytes per weight
    layer = Layer(LINEAR_Q4P, 40, 96)
    with pytest.raises(ValueError):
        kernels.linear_spec(LINEAR_Q8P, layer.packed, 96, out_features=40)  # wrong size
    with pytest.raises(ValueError):
        layer.linear(torch.randn(1, 64))
    with pytest.raises(ValueError):
        kernels.pack(LINEAR_Q8P, torch.zeros(4, 48, dtype=torch.int8), torch.zeros(4, 1).half())
    assert torch.equal(layer.linear(torch.randn(0, 96)), torch.empty(0, 40))


def test_q4_panels_agree_with_torch_linear_on_the_dequantized_weight(threads):
    """A plain cross-check of the whole path: packing order, nibble halves, Q4_0 zeros."""
    layer = Layer(LINEAR_Q4P, 200, 256, seed=9)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(10))
    weight = layer.dequantize_rows(torch.arange(200))
    expected = F.linear(rounded_inputs(x).float(), weight)
    assert torch.allclose(layer.linear(x), expected, rtol=1e-4, atol=1e-4)
