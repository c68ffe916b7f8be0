"""Weight-only quantized linear layers: quantization error, kernels, GGUF blocks, real weights.

Weights are GGUF's own formats with float16 scales (and zeros), whose unit roundoff is
u = 2**-11: ``int8`` is Q8_0 and ``int4`` is Q4_1, so GGUF Q8_0, Q4_0 and Q4_1 blocks convert
bit for bit and quantizing a float weight errs by half a step plus what rounding the scale (and
zero) to float16 moves the largest values of a group.

The kernel path (fewer than ``dense_min_rows`` rows) quantizes each input row to int8 per group
of 32, ``d = max|x| / 127``, ``q = round(x / d)``, and sums exact integer products. Against a
matmul with the same dequantized weight its only error is that input rounding, at most d/2 per
input element, so output ``o`` of row ``i`` is off by at most ``sum_k d_ik / 2 * |W_ok|`` (plus
float32 rounding). For Gaussian inputs that is a relative error of about
E[max of 32 |N(0,1)|] / (127 * sqrt(12)) ~ 2.3 / 440 ~ 0.5% (measured 0.48-0.60% on these
shapes), hence KERNEL_RTOL = 1e-2. The dense path is a float32 GEMM over dequantized rows
(measured ~1e-7 relative), held to 1e-5.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from nanokv_cli.engine.layers import quant
from nanokv_cli.engine.layers.quant import (
    MODES,
    QuantizationError,
    QuantizedEmbedding,
    QuantizedLinear,
    gguf_dequantize,
)
from nanokv_cli.engine.loader import (
    ModelLoadError,
    QuantizedTensor,
    default_model_path,
    load_gguf_quantized,
    load_model,
)

U = 2.0**-11  # float16 unit roundoff: the scales' and zeros' rounding
EPS32 = 2.0**-24  # float32 unit roundoff
KERNEL_RTOL = 1e-2  # int8 rounding of Gaussian inputs: ~0.5% of the output's norm (see above)
DENSE_RTOL = 1e-5  # float32 GEMM rounding only
Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
# 96 inputs = 3 groups: only the kernel's scalar tail (it takes 8 groups at a time with AVX2);
# 576 = 2 * 8 + 2 groups: both. 80 and 192 outputs are whole 4-row tiles.
SHAPES = [(80, 96), (192, 576)]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.05 * torch.randn(rows, cols, generator=g)


def inputs(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def group_max(values: torch.Tensor) -> torch.Tensor:
    """Each element's 32-wide group's largest magnitude (the scale of its GGUF block)."""
    groups = values.abs().view(values.shape[0], -1, 32)
    return groups.amax(dim=2, keepdim=True).expand_as(groups).reshape(values.shape)


def per_element(groups: torch.Tensor) -> torch.Tensor:
    """A per-group [N, K/32] tensor repeated over each group's 32 elements: [N, K]."""
    return groups.float().repeat_interleave(32, dim=1)


def round_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's int8 rounding of input rows, in float32 as it computes it: (d * q, d)."""
    groups = x.float().view(x.shape[0], -1, 32)
    d = groups.abs().amax(dim=2, keepdim=True) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse)  # round half to even, as nearbyintf
    return (q * d).view(x.shape), d.expand_as(groups).reshape(x.shape)


def check_kernel(layer: QuantizedLinear, x: torch.Tensor, y: torch.Tensor) -> None:
    """``y = layer(x)`` from the kernel path, element by element:

    1. it equals ``round_inputs(x) @ W^T + b`` (computed in float64) up to float32 rounding:
       each product sum of a group is an exact integer, then per group a scale product and an
       accumulation (and int4's zero term) round; at most ~groups + 16 roundings along any
       output's chain, each of terms no larger than 3 * group_max(W) * |x_q| (|s q| <= 2
       group_max and |zero| <= group_max for int4);
    2. it is within ``sum_k d_ik / 2 * |W_ok|`` of the float64 ``x @ W^T + b``: the input
       rounding bound (x * (1/d) rounds in float32 first, so d/2 grows by a few ulps).
    """
    w = layer.dequantize().double()
    bias = torch.zeros(layer.out_features) if layer.bias is None else layer.bias
    x_q, d = round_inputs(x)
    roundings = layer.in_features // 32 + 16
    tol = 3 * roundings * EPS32 * (x_q.abs().double() @ group_max(w).T + bias.abs().double())
    emulated = x_q.double() @ w.T + bias.double()
    assert ((y.double() - emulated).abs() <= tol).all()
    exact = x.double() @ w.T + bias.double()
    bound = (d.double() * (0.5 + 1e-5)) @ w.abs().T + tol
    assert ((y.double() - exact).abs() <= bound).all()


def kernel_only(layer: QuantizedLinear) -> QuantizedLinear:
    layer.dense_min_rows = float("inf")
    return layer


def dense_only(layer: QuantizedLinear) -> QuantizedLinear:
    layer.dense_min_rows = 0
    return layer


# -- quantizing float weights -------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_rounds_each_weight_to_its_group_step(shape):
    w = weight(*shape)
    layer = QuantizedLinear.from_float(w, "int8")
    assert layer.scale.dtype == torch.float16 and layer.scale.shape == (shape[0], shape[1] // 32)
    assert layer.zero is None
    step = per_element(layer.scale)
    # The float16 step is within u of group max / 127.
    assert ((step - group_max(w) / 127).abs() <= U * group_max(w) / 127).all()
    # Half a step from rounding; where the step rounded down, the group's largest value clamps
    # to 127 steps, at most 127 * u of a step short of it.
    assert ((layer.dequantize() - w).abs() <= step * (0.5 + 127 * U)).all()
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() == 127


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_rounds_each_weight_to_its_group_step(shape):
    w = weight(*shape)
    layer = QuantizedLinear.from_float(w, "int4")
    groups = w.view(shape[0], -1, 32)
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (shape[0], shape[1] // 2)
    assert torch.equal(layer.zero, groups.amin(2).half())  # Q4_1's zero: the group minimum
    step = per_element(layer.scale)
    exact_step = per_element((groups.amax(2) - groups.amin(2)) / 15)
    assert ((step - exact_step).abs() <= U * exact_step).all()
    # Half a step from rounding against the float16 grid; a value that clamps to q = 0 or 15
    # is off by the zero's rounding (u * |min| <= u * group max) plus, at the top, 15 steps'
    # worth of the scale's rounding (15 * u of a step).
    assert ((layer.dequantize() - w).abs() <= step * (0.5 + 15 * U) + U * group_max(w)).all()
    assert rel_err(layer.dequantize(), w) < 0.1  # 4-bit: step / sqrt(12) of a ~4 sigma range


@pytest.mark.parametrize("mode", MODES)
def test_zero_and_constant_groups(mode):
    w = weight(4, 96)
    w[0, :32] = 0.0
    w[1, 32:64] = 0.3
    w[2, 64:] = -0.7
    deq = QuantizedLinear.from_float(w, mode).dequantize()
    assert (deq[0, :32] == 0).all()
    # A group of one value has a zero step: int8 keeps it to the scale's rounding, int4 to
    # the zero's (both u of the value).
    for row, cols, value in [(1, slice(32, 64), 0.3), (2, slice(64, 96), -0.7)]:
        assert ((deq[row, cols] - value).abs() <= U * abs(value)).all()


# -- the kernel path ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_kernel_matches_dequantized_matmul(mode, shape, rows):
    # One row has a kernel of its own (the decode of a single sequence).
    layer = kernel_only(QuantizedLinear.from_float(weight(*shape), mode))
    x = inputs(rows, shape[1])
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, shape[0])
    check_kernel(layer, x, y)
    assert rel_err(y, x @ layer.dequantize().T) < KERNEL_RTOL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("out_features", [1, 2, 3, 75, 77, 1001])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_kernel_odd_outputs_and_row_tiles(mode, out_features, rows):
    # The kernel works in tiles of 4 outputs (a short last tile for out % 4) and of 1-4 input
    # rows (specialised per count: 5 = 4 + 1, 9 = 4 + 4 + 1); 1001 outputs run multithreaded.
    # 608 inputs = 8 + 8 + 3 groups: two rounds of the vector loop, then the scalar tail.
    layer = kernel_only(
        QuantizedLinear.from_float(weight(out_features, 608, seed=out_features), mode)
    )
    x = inputs(rows, 608, seed=rows)
    y = layer(x)
    assert y.shape == (rows, out_features)
    check_kernel(layer, x, y)
    if out_features * rows >= 75:  # enough outputs for a stable relative norm
        assert rel_err(y, x @ layer.dequantize().T) < KERNEL_RTOL


@pytest.mark.parametrize("mode", MODES)
def test_kernel_reads_row_strided_inputs(mode):
    layer = kernel_only(QuantizedLinear.from_float(weight(77, 96), mode))
    wide = inputs(5, 160)
    x = wide[:, 32:128]  # rows 160 apart, columns packed: passed to the kernel as they are
    assert x.stride() == (160, 1)
    assert torch.equal(layer(x), layer(x.contiguous()))


@pytest.mark.parametrize("mode", MODES)
def test_dense_path_matches_dequantized_matmul_across_chunks(mode, monkeypatch):
    # Chunks of 64 rows: five for 275 rows, the last one 19 rows long.
    monkeypatch.setattr(quant, "_DENSE_CHUNK_ELEMENTS", 64 * 96)
    bias = torch.linspace(-1, 1, 275)
    layer = dense_only(QuantizedLinear.from_float(weight(275, 96), mode, bias=bias))
    x = inputs(5, 96)
    y = layer(x)
    assert y.shape == (5, 275)
    assert rel_err(y, x @ layer.dequantize().T + bias) < DENSE_RTOL
    monkeypatch.setattr(quant, "_DENSE_CHUNK_ELEMENTS", 1 << 20)
    assert torch.allclose(layer(x), y, rtol=1e-6, atol=1e-6)  # one chunk: the same GEMM


@pytest.mark.parametrize("mode", MODES)
def test_forward_picks_the_path_by_row_count(mode):
    layer = QuantizedLinear.from_float(weight(80, 96), mode)
    assert layer.dense_min_rows == quant.DENSE_MIN_ROWS[mode]
    reference = layer.dequantize()
    small = inputs(layer.dense_min_rows - 1, 96)
    large = inputs(layer.dense_min_rows, 96)
    # The kernel rounds its inputs to int8 (~0.5%), the dense path does not.
    assert 1e-3 < rel_err(layer(small), small @ reference.T) < KERNEL_RTOL
    check_kernel(layer, small, layer(small))
    assert rel_err(layer(large), large @ reference.T) < DENSE_RTOL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", [kernel_only, dense_only])
def test_bias_shapes_and_dtypes(mode, path):
    bias = torch.linspace(-1, 1, 80)
    layer = path(QuantizedLinear.from_float(weight(80, 96), mode, bias=bias))
    x = inputs(6, 96).view(2, 3, 96)
    expected = x @ layer.dequantize().T + bias
    y = layer(x)
    assert y.shape == (2, 3, 80) and y.dtype == torch.float32
    assert rel_err(y, expected) < (KERNEL_RTOL if path is kernel_only else DENSE_RTOL)
    if path is kernel_only:
        check_kernel(layer, x.view(6, 96), y.view(6, 80))
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        y_low = layer(low)
        # Computed in float32 on the widened input, rounded once on the way out.
        assert y_low.dtype == dtype and y_low.shape == (2, 3, 80)
        assert torch.equal(y_low, layer(low.float()).to(dtype))
    assert layer(torch.empty(0, 96)).shape == (0, 80)


@pytest.mark.parametrize("mode", MODES)
def test_embedding_gathers_dequantized_rows(mode):
    layer = QuantizedLinear.from_float(weight(275, 96), mode)
    table = layer.dequantize()
    ids = torch.tensor([[0, 274, 17, 17], [256, 263, 31, 32]])
    rows = QuantizedEmbedding(layer)(ids)
    assert rows.shape == (2, 4, 96) and rows.dtype == torch.float32
    assert torch.equal(rows, table[ids])
    assert torch.equal(layer.embedding(ids.int()), table[ids])
    assert torch.equal(layer.dequantize(100, 177), table[100:177])


@pytest.mark.parametrize("mode", MODES)
def test_from_parts_fuses_gguf_and_float_parts(mode):
    raw, _ = gguf_blocks(Q4_1, (64, 96))
    raw8, _ = gguf_blocks(Q8_0, (16, 96))
    parts = [
        QuantizedTensor(raw, int(Q4_1), (64, 96)),
        weight(32, 96),
        QuantizedTensor(raw8, 8, (16, 96)),
    ]
    bias = torch.arange(112.0)
    fused = kernel_only(QuantizedLinear.from_parts(parts, mode, bias=bias))
    separate = [
        QuantizedLinear.from_gguf(raw, Q4_1, (64, 96), mode),
        QuantizedLinear.from_float(weight(32, 96), mode),
        QuantizedLinear.from_gguf(raw8, Q8_0, (16, 96), mode),
    ]
    assert fused.out_features == 112 and fused.mode == mode
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in separate]))
    assert torch.equal(fused.bias, bias)
    # Each output is computed on its own row with the same rounded inputs: fusing changes
    # nothing, not even the float rounding.
    x = inputs(3, 96)
    expected = torch.cat([kernel_only(p)(x) for p in separate], dim=1) + bias
    assert torch.equal(fused(x), expected)
    with pytest.raises(QuantizationError, match="input size"):
        QuantizedLinear.from_parts([weight(32, 96), weight(32, 64)], mode)


def test_rejects_shapes_and_modes_it_cannot_run():
    for mode in MODES:
        with pytest.raises(QuantizationError, match="in_features"):
            QuantizedLinear.from_float(weight(64, 40), mode)
        with pytest.raises(QuantizationError, match="2-D"):
            QuantizedLinear.from_float(torch.zeros(2, 4, 32), mode)
    with pytest.raises(QuantizationError, match="mode"):
        QuantizedLinear.from_float(weight(64, 64), "int3")
    with pytest.raises(QuantizationError, match="mode"):
        QuantizedLinear.from_float(weight(64, 64), "int4x2")  # an old mode, gone
    w = weight(72, 40).half().numpy()
    with pytest.raises(QuantizationError, match="in_features"):
        QuantizedLinear.from_gguf(w, GGMLQuantizationType.F16, (72, 40), "int8")
    for mode in MODES:  # any number of outputs
        assert QuantizedLinear.from_float(weight(75, 64), mode).out_features == 75


def test_resident_bytes_follow_the_mode():
    rows, cols = 192, 576
    sizes = {mode: QuantizedLinear.from_float(weight(rows, cols), mode).nbytes for mode in MODES}
    groups = rows * cols // 32
    assert sizes["int8"] == rows * cols + 2 * groups  # int8 weights, a float16 scale per group
    assert sizes["int4"] == rows * cols // 2 + 2 * 2 * groups  # nibbles, float16 scale and zero
    with_bias = QuantizedLinear.from_float(weight(rows, cols), "int4", bias=torch.ones(rows))
    assert with_bias.nbytes == sizes["int4"] + 4 * rows  # a float32 bias


# -- fixed-point batches (FixedPointLinear, LINEAR_I16) --------------------------------------------


def simulate_fixed_point(w: torch.Tensor, x: torch.Tensor, bias=None) -> torch.Tensor:
    """What LINEAR_I16 computes, in float64 from the same float32 roundings: weights to
    integers in -8191..8191 per output row, inputs to -4095..4095 per 64 values. (numpy:
    torch divides a scalar by a tensor through a reciprocal, off by an ulp from C's division.)"""

    def rounded(v: np.ndarray, limit: float) -> tuple[np.ndarray, np.ndarray]:
        peak = np.abs(v).max(-1, keepdims=True)
        with np.errstate(divide="ignore"):
            inv = np.where(peak > 0, np.float32(limit) / peak, np.float32(0))
        return np.rint(v * inv).astype(np.float64), (peak / np.float32(limit)).astype(np.float64)

    w_q, w_scale = rounded(w.numpy(), 8191.0)  # [out, in], [out, 1]
    x_q, x_scale = rounded(x.numpy().reshape(x.shape[0], -1, 64), 4095.0)  # [n, b, 64], [n, b, 1]
    # Integer sums per 64-block are exact in float64; then scaled as the kernel does.
    sums = np.einsum("ibk,obk->iob", x_q, w_q.reshape(w.shape[0], -1, 64))
    y = (sums * x_scale[:, None, :, 0]).sum(2) * w_scale[:, 0]
    y = torch.from_numpy(y)
    return y if bias is None else y + bias.double()


FIXED_POINT_SHAPES = [(1, 192), (3, 192), (5, 192), (6, 192), (7, 192), (17, 192), (64, 192)]


@pytest.mark.parametrize("out_features", [1, 16, 37, 960])
@pytest.mark.parametrize("rows,in_features", [*FIXED_POINT_SHAPES, (300, 192), (97, 1536)])
def test_fixed_point_matches_its_rounding_exactly(out_features, rows, in_features):
    # Tiles of 6 rows x 16 outputs (short last ones), grouped into work items that fit a
    # core's L2: 300 rows x 192 inputs make two chunks of rows, 97 x 1536 four.
    w = weight(out_features, in_features, seed=out_features)
    bias = torch.linspace(-1, 1, out_features)
    layer = quant.FixedPointLinear(w, bias)
    x = inputs(rows, in_features, seed=rows)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    expected = simulate_fixed_point(w, x, bias)
    assert (y.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    # And the rounding itself costs ~1e-4 of the output: 14-bit weights, 13-bit inputs.
    if out_features * rows >= 64:
        assert rel_err(y, x @ w.T + bias) < 5e-4


def test_fixed_point_outliers_stay_in_their_block():
    # An outlier coarsens only its own 64-input block's rounding (one scale per block).
    w = weight(128, 256)
    x = inputs(8, 256)
    clean = rel_err(quant.FixedPointLinear(w)(x), x @ w.T)
    x[:, 5] *= 100
    noisy = quant.FixedPointLinear(w)(x)
    assert rel_err(noisy, x @ w.T) < 2e-3
    assert rel_err(noisy, simulate_fixed_point(w, x)) < 1e-6
    assert clean < 3e-4


def test_fixed_point_reads_row_strided_inputs_and_keeps_dtypes():
    layer = quant.FixedPointLinear(weight(40, 128))
    wide = inputs(6, 200)
    x = wide[:, 36:164]
    assert x.stride() == (200, 1)
    assert torch.equal(layer(x), layer(x.contiguous()))
    y = layer(x.to(torch.bfloat16).view(2, 3, 128))  # any leading shape, the caller's dtype
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 40)


def test_fixed_point_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="multiple of 64"):
        quant.FixedPointLinear(weight(16, 96))
    layer = quant.FixedPointLinear(weight(16, 64))
    assert layer.nbytes == 16 * 64 * 2 + 16 * 4  # two bytes per weight, a scale per row
    with pytest.raises(TypeError, match="float32 scales"):
        layer.to(torch.float16)


# -- int4 panels for batches (PanelInt4Linear, LINEAR_Q4_PANELS) ----------------------------------


@pytest.mark.parametrize("out_features", [1, 16, 37, 960])
@pytest.mark.parametrize(
    "rows,in_features",
    [(1, 64), (5, 96), (6, 96), (7, 32), (17, 96), (64, 192), (300, 192), (97, 1536)],
)
def test_int4_panels_compute_what_the_int4_kernel_does(out_features, rows, in_features):
    # Tiles of 6 rows x 16 outputs (short last ones) in work items (300 x 192 and 97 x 1536
    # make several chunks of rows): the row kernel's input rounding and integer products,
    # summed in another order, so check_kernel's bounds hold and the two agree to float32.
    bias = torch.linspace(-1, 1, out_features)
    layer = QuantizedLinear.from_float(
        weight(out_features, in_features, seed=out_features), "int4", bias
    )
    panels = quant.PanelInt4Linear(layer)
    x = inputs(rows, in_features, seed=rows)
    x[rows // 2, : in_features // 2] = 0.0  # all-zero groups: a zero scale
    y = panels(x)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    check_kernel(layer, x, y)
    assert rel_err(y, kernel_only(layer)(x)) < 1e-6


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1])
def test_int4_panels_take_gguf_blocks_as_they_are(qtype):
    raw, values = gguf_blocks(qtype, shape=(77, 576))
    layer = QuantizedLinear.from_gguf(raw, qtype, values.shape, "int4")
    x = inputs(40, 576)
    y = quant.PanelInt4Linear(layer)(x)
    check_kernel(layer, x, y)
    assert rel_err(y, x @ values.T) < 1e-2  # the int8 rounding of the inputs


def test_int4_panels_read_row_strided_inputs_and_keep_dtypes():
    panels = quant.PanelInt4Linear(QuantizedLinear.from_float(weight(40, 128), "int4"))
    wide = inputs(6, 200)
    x = wide[:, 36:164]
    assert x.stride() == (200, 1)
    assert torch.equal(panels(x), panels(x.contiguous()))
    y = panels(x.to(torch.bfloat16).view(2, 3, 128))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 40)


def test_int4_panels_refuse_int8_layers_and_hold_a_byte_per_weight():
    with pytest.raises(quant.QuantizationError, match="int4 layer"):
        quant.PanelInt4Linear(QuantizedLinear.from_float(weight(16, 64), "int8"))
    panels = quant.PanelInt4Linear(QuantizedLinear.from_float(weight(20, 64), "int4"))
    # Two panels of 16 outputs; per 32 inputs 512 weight bytes and 16 float scales and zeros.
    assert panels.nbytes == 2 * 2 * (512 + 2 * 16 * 4)


# -- GGUF blocks --------------------------------------------------------------------------------


def gguf_blocks(qtype: GGMLQuantizationType, shape=(80, 96)) -> tuple[np.ndarray, torch.Tensor]:
    w = weight(*shape).numpy()
    raw = quantize(w, qtype)
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(shape).astype(np.float32))


@pytest.mark.parametrize(
    ("qtype", "mode", "shape"),
    [
        (Q4_0, "int4", (80, 96)),
        (Q4_1, "int4", (80, 96)),
        (Q8_0, "int8", (80, 96)),
        (Q4_0, "int4", (77, 576)),
        (Q4_1, "int4", (77, 576)),
        (Q8_0, "int8", (77, 576)),
    ],
)
def test_gguf_blocks_convert_exactly(qtype, mode, shape):
    raw, reference = gguf_blocks(qtype, shape)
    layer = QuantizedLinear.from_gguf(raw, qtype, shape, mode)
    # Bit for bit gguf's own dequantization: float16 d (and m) kept, d * q (+ m) rounded once
    # in float32 as gguf-py does; Q4_0's d * (q - 8) = d * q + (-8 d) is exact.
    assert torch.equal(layer.dequantize(), reference)
    x = inputs(4, shape[1])
    y = kernel_only(layer)(x)
    check_kernel(layer, x, y)
    assert rel_err(y, x @ reference.T) < KERNEL_RTOL
    assert rel_err(dense_only(layer)(x), x @ reference.T) < DENSE_RTOL


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1])
def test_gguf_blocks_requantize_to_int8_per_group(qtype):
    raw, reference = gguf_blocks(qtype)
    layer = QuantizedLinear.from_gguf(raw, qtype, reference.shape, "int8")
    # Quantized as a float weight would be: a float16 step of group max / 127 per group.
    assert torch.equal(
        layer.dequantize(), QuantizedLinear.from_float(reference, "int8").dequantize()
    )
    step = per_element(layer.scale)
    assert ((step - group_max(reference) / 127).abs() <= U * group_max(reference) / 127).all()
    assert ((layer.dequantize() - reference).abs() <= step * (0.5 + 127 * U)).all()


def test_gguf_q8_0_requantizes_to_int4_from_its_values():
    raw, reference = gguf_blocks(Q8_0)
    layer = QuantizedLinear.from_gguf(raw, Q8_0, reference.shape, "int4")
    assert torch.equal(
        layer.dequantize(), QuantizedLinear.from_float(reference, "int4").dequantize()
    )


def test_gguf_float_and_other_types_go_through_dequantization():
    w = weight(80, 96)
    f16 = w.half().numpy()
    layer = QuantizedLinear.from_gguf(f16, GGMLQuantizationType.F16, w.shape, "int4")
    assert torch.equal(
        layer.dequantize(), QuantizedLinear.from_float(w.half(), "int4").dequantize()
    )
    # gguf_dequantize decodes Q8_0 and float types itself, the rest through gguf-py: all
    # bit for bit what gguf-py gives.
    for qtype in (Q8_0, Q4_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.F16):
        data = quantize(w.numpy(), qtype)
        assert torch.equal(
            gguf_dequantize(data, qtype, 80, 96),
            torch.from_numpy(dequantize(data, qtype).reshape(80, 96).astype(np.float32)),
        ), qtype.name


@pytest.mark.parametrize(("qtype", "mode"), [(Q4_0, "int4"), (Q4_1, "int4"), (Q8_0, "int8")])
def test_gguf_bytes_must_fit_the_shape(qtype, mode):
    raw, _ = gguf_blocks(qtype)
    with pytest.raises(QuantizationError, match="bytes per row"):
        QuantizedLinear.from_gguf(raw, qtype, (80, 64), mode)


# -- loader -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_q8_gguf(tmp_path_factory):
    from tiny_models import make_tiny_model, write_gguf

    root = tmp_path_factory.mktemp("quant")
    folder = make_tiny_model("llama", root / "llama")
    return write_gguf(folder, root / "llama.gguf", quantization="Q8_0")


def test_load_gguf_quantized_matches_load_model(tiny_q8_gguf):
    weights = load_model(tiny_q8_gguf, use_cache=False).weights
    raw = load_gguf_quantized(tiny_q8_gguf)
    assert set(raw) == {name for name, w in weights.items() if w.dim() == 2}
    for name, tensor in raw.items():
        # Q/K rows un-permuted as load_model does, names mapped the same way.
        values = gguf_dequantize(tensor.data, tensor.qtype, *tensor.shape)
        assert torch.equal(values, weights[name]), name
    assert raw["model.layers.0.self_attn.q_proj.weight"].type_name == "Q8_0"


def test_load_gguf_quantized_refuses_other_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_gguf_quantized(tmp_path)


def test_load_gguf_quantized_refuses_a_truncated_file(tmp_path):
    # Cut inside the tokenizer's strings: the index reader must fail cleanly, not read on.
    truncated = tmp_path / "cut.gguf"
    whole = Path(default_model_path()).read_bytes()
    for cut in (300_000, len(whole) - 1000):  # in the metadata; in the last tensor
        truncated.write_bytes(whole[:cut])
        with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
            load_gguf_quantized(truncated)


# -- the default model's real blocks ------------------------------------------------------------


@pytest.fixture(scope="module")
def default_blocks():
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    raw = load_gguf_quantized(default_model_path())
    return {name: raw[name] for name in [*names, "model.embed_tokens.weight"]}


def gguf_values(tensor: QuantizedTensor) -> torch.Tensor:
    """gguf-py's own float32 values of a tensor's blocks."""
    values = dequantize(tensor.data, GGMLQuantizationType(tensor.qtype))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(tensor.shape))


@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]
)
def test_default_model_q4_1_layer_converts_exactly(default_blocks, name):
    tensor = default_blocks[name]
    assert tensor.type_name == "Q4_1"
    reference = gguf_values(tensor)
    layer = QuantizedLinear.from_gguf(tensor.data, tensor.qtype, tensor.shape, "int4")
    assert torch.equal(layer.dequantize(), reference)
    x = inputs(4, tensor.shape[1])
    y = kernel_only(layer)(x)
    check_kernel(layer, x, y)
    assert rel_err(y, x @ reference.T) < KERNEL_RTOL


def test_default_model_q8_0_embedding_table_is_exact_in_int8(default_blocks):
    tensor = default_blocks["model.embed_tokens.weight"]
    assert tensor.type_name == "Q8_0" and tensor.shape == (49152, 576)
    reference = gguf_values(tensor)
    table = QuantizedLinear.from_gguf(tensor.data, tensor.qtype, tensor.shape, "int8")
    assert torch.equal(table.dequantize(), reference)
    ids = torch.tensor([0, 2, 1234, 49151])
    assert torch.equal(QuantizedEmbedding(table)(ids), reference[ids])
    # The tied LM head reads the same table through the kernel.
    hidden = inputs(2, 576)
    logits = kernel_only(table)(hidden)
    check_kernel(table, hidden, logits)
    assert rel_err(logits, hidden @ reference.T) < KERNEL_RTOL
