"""The CPU weight formats (``engine/cpu/formats.py``): rounding, GGUF blocks, packed layers.

Weights are GGUF's own formats with float16 scales (and zeros), whose unit roundoff is
u = 2**-11: ``q8`` is Q8_0 and ``q4`` is Q4_1, so GGUF Q8_0, Q4_0 and Q4_1 blocks convert bit
for bit and quantizing a float weight errs by half a step plus what rounding the scale (and
zero) to float16 moves the largest values of a group.

The kernels round each input row per group of 32 (both formats: int16, ``d = max|x| / 32767``)
and sum exact integer products. Against a matmul with the same dequantized weight their only
error is that rounding, at most d/2 per input element, so output ``o`` of row ``i`` is off by
at most ``sum_k d_ik / 2 * |W_ok|`` (plus float32 rounding). For Gaussian inputs that is ~2e-5
of the output's norm, hence RTOL = 1e-4 (int8 inputs, as llama.cpp rounds them, would be off
by ~0.5%). The kernels' own edge cases (row tiles, padded
outputs, threads, ISA variants) are tests/test_cpu_formats.py's.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from nanokv_cli.engine.cpu import kernels
from nanokv_cli.engine.cpu.formats import (
    FORMATS,
    Q4,
    Q8,
    PackedEmbedding,
    PackedLinear,
    QuantizationError,
    exact_format,
)
from nanokv_cli.engine.cpu.formats import quantize as quantize_groups
from nanokv_cli.engine.model.gguf_file import dequantize as loader_dequantize
from nanokv_cli.engine.model.loader import (
    ModelLoadError,
    QuantizedTensor,
    default_model_path,
    load_gguf_quantized,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler")

U = 2.0**-11  # float16 unit roundoff: the scales' and zeros' rounding
EPS32 = 2.0**-24  # float32 unit roundoff
RTOL = {"q4": 1e-4, "q8": 1e-4}  # input rounding of Gaussian rows (see above)
INPUT_LEVELS = {"q4": 32767.0, "q8": 32767.0}
Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
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


def round_inputs(x: torch.Tensor, levels: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' rounding of input rows per 32 values, as they compute it: (d * q, d)."""
    groups = x.float().view(x.shape[0], -1, 32)
    d = groups.abs().amax(dim=2, keepdim=True) / levels
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse)  # round half to even, as nearbyintf
    return (q * d).view(x.shape), d.expand_as(groups).reshape(x.shape)


def check_kernel(layer: PackedLinear, x: torch.Tensor, y: torch.Tensor) -> None:
    """``y = layer(x)`` element by element:

    1. it is within float32 rounding of ``round_inputs(x) @ W^T + b`` (computed in float64):
       each group's product sum is an exact integer, then per group a scale product and an
       accumulation (and q4's zero term) round; at most ~groups + 16 roundings along any
       output's chain, each of terms no larger than 3 * group_max(W) * |x_q|;
    2. it is within ``sum_k d_ik / 2 * |W_ok|`` of the float64 ``x @ W^T + b``: the input
       rounding bound (x * (1/d) rounds in float32 first, so d/2 grows by a few ulps).
    """
    w = layer.dequantize().double()
    bias = torch.zeros(layer.out_features) if layer.bias is None else layer.bias
    x_q, d = round_inputs(x, INPUT_LEVELS[layer.format.name])
    roundings = layer.in_features // 32 + 16
    tol = 3 * roundings * EPS32 * (x_q.abs().double() @ group_max(w).T + bias.abs().double())
    emulated = x_q.double() @ w.T + bias.double()
    assert ((y.double() - emulated).abs() <= tol).all()
    exact = x.double() @ w.T + bias.double()
    bound = (d.double() * (0.5 + 1e-5)) @ w.abs().T + tol
    assert ((y.double() - exact).abs() <= bound).all()


def packed(w: torch.Tensor, fmt, bias=None) -> PackedLinear:
    return PackedLinear.from_parts(fmt, [w], bias)


def gguf_blocks(qtype: GGMLQuantizationType, shape=(80, 96)) -> tuple[np.ndarray, torch.Tensor]:
    w = weight(*shape).numpy()
    raw = quantize(w, qtype)
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(shape).astype(np.float32))


# -- the table -----------------------------------------------------------------------------------


def test_each_gguf_block_type_has_one_exact_format():
    assert exact_format(Q4_0) is Q4 and exact_format(Q4_1) is Q4 and exact_format(Q8_0) is Q8
    assert exact_format(GGMLQuantizationType.F16) is None
    assert exact_format(int(Q8_0)) is Q8  # a plain GGML type number
    assert set(FORMATS) == {"q4", "q8"}


@pytest.mark.parametrize("fmt", [Q4, Q8])
def test_resident_bytes_match_the_table(fmt):
    rows, cols = 192, 576
    layer = packed(weight(rows, cols), fmt)
    assert layer.nbytes == pytest.approx(fmt.bytes_per_weight * rows * cols, rel=0.01)
    with_bias = packed(weight(rows, cols), fmt, bias=torch.ones(rows))
    assert with_bias.nbytes == layer.nbytes + 4 * rows  # a float32 bias


# -- quantizing float weights --------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_q8_rounds_each_weight_to_its_group_step(shape):
    w = weight(*shape)
    groups = quantize_groups(w, Q8)
    assert groups.scale.dtype == torch.float16 and groups.scale.shape == (shape[0], shape[1] // 32)
    assert groups.zero is None and groups.q.dtype == torch.int8 and groups.q.abs().max() == 127
    step = per_element(groups.scale)
    # The float16 step is within u of group max / 127.
    assert ((step - group_max(w) / 127).abs() <= U * group_max(w) / 127).all()
    # Half a step from rounding; where the step rounded down, the group's largest value clamps
    # to 127 steps, at most 127 * u of a step short of it.
    assert ((packed(w, Q8).dequantize() - w).abs() <= step * (0.5 + 127 * U)).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_q4_rounds_each_weight_to_its_group_step(shape):
    w = weight(*shape)
    groups = quantize_groups(w, Q4)
    w_groups = w.view(shape[0], -1, 32)
    assert groups.q.dtype == torch.uint8 and groups.q.shape == (shape[0], shape[1] // 2)
    assert torch.equal(groups.zero, w_groups.amin(2).half())  # Q4_1's zero: the group minimum
    step = per_element(groups.scale)
    exact_step = per_element((w_groups.amax(2) - w_groups.amin(2)) / 15)
    assert ((step - exact_step).abs() <= U * exact_step).all()
    # Half a step against the float16 grid; a value that clamps to q = 0 or 15 is off by the
    # zero's rounding (u * |min|) plus, at the top, 15 steps' worth of the scale's rounding.
    deq = packed(w, Q4).dequantize()
    assert ((deq - w).abs() <= step * (0.5 + 15 * U) + U * group_max(w)).all()
    assert rel_err(deq, w) < 0.1  # 4-bit: step / sqrt(12) of a ~4 sigma range


@pytest.mark.parametrize("fmt", [Q4, Q8])
def test_zero_and_constant_groups(fmt):
    w = weight(4, 96)
    w[0, :32] = 0.0
    w[1, 32:64] = 0.3
    w[2, 64:] = -0.7
    deq = packed(w, fmt).dequantize()
    assert (deq[0, :32] == 0).all()
    # A group of one value has a zero step: q8 keeps it to the scale's rounding, q4 to the
    # zero's (both u of the value).
    for row, cols, value in [(1, slice(32, 64), 0.3), (2, slice(64, 96), -0.7)]:
        assert ((deq[row, cols] - value).abs() <= U * abs(value)).all()


# -- packed layers -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [Q4, Q8])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 7, 64])
def test_kernels_match_the_dequantized_matmul(fmt, shape, rows):
    layer = packed(weight(*shape), fmt)
    x = inputs(rows, shape[1])
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, shape[0])
    check_kernel(layer, x, y)
    assert rel_err(y, x @ layer.dequantize().T) < RTOL[fmt.name]


@pytest.mark.parametrize("fmt", [Q4, Q8])
def test_a_row_computes_the_same_in_any_batch(fmt):
    # One layout for every row count: a decode step, a batch and a prefill agree bit for bit.
    layer = packed(weight(77, 576), fmt)
    x = inputs(13, 576)
    whole = layer(x)
    for i in (0, 5, 12):
        assert torch.equal(layer(x[i : i + 1]), whole[i : i + 1])
    assert torch.equal(layer(x[3:10]), whole[3:10])


@pytest.mark.parametrize("fmt", [Q4, Q8])
def test_kernels_read_row_strided_inputs(fmt):
    layer = packed(weight(77, 96), fmt)
    wide = inputs(5, 160)
    x = wide[:, 32:128]  # rows 160 apart, columns packed: passed to the kernel as they are
    assert x.stride() == (160, 1)
    assert torch.equal(layer(x), layer(x.contiguous()))


@pytest.mark.parametrize("fmt", [Q4, Q8])
def test_bias_shapes_and_dtypes(fmt):
    bias = torch.linspace(-1, 1, 80)
    layer = packed(weight(80, 96), fmt, bias=bias)
    x = inputs(6, 96).view(2, 3, 96)
    y = layer(x)
    assert y.shape == (2, 3, 80) and y.dtype == torch.float32
    assert rel_err(y, x @ layer.dequantize().T + bias) < RTOL[fmt.name]
    check_kernel(layer, x.view(6, 96), y.view(6, 80))
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        y_low = layer(low)
        # Computed in float32 on the widened input, rounded once on the way out.
        assert y_low.dtype == dtype and y_low.shape == (2, 3, 80)
        assert torch.equal(y_low, layer(low.float()).to(dtype))
    assert layer(torch.empty(0, 96)).shape == (0, 80)


@pytest.mark.parametrize("fmt", [Q4, Q8])
def test_embedding_gathers_dequantized_rows(fmt):
    layer = packed(weight(275, 96), fmt)
    table = layer.dequantize()
    ids = torch.tensor([[0, 274, 17, 17], [256, 263, 31, 32]])
    rows = PackedEmbedding(layer, torch.float32)(ids)
    assert rows.shape == (2, 4, 96) and rows.dtype == torch.float32
    assert torch.equal(rows, table[ids])
    assert torch.equal(PackedEmbedding(layer, torch.bfloat16)(ids), table[ids].bfloat16())
    with pytest.raises(IndexError, match="out of range"):
        layer.embedding(torch.tensor([275]))


@pytest.mark.parametrize("fmt", [Q4, Q8])
def test_from_parts_fuses_gguf_and_float_parts(fmt):
    raw, _ = gguf_blocks(Q4_1, (64, 96))
    raw8, _ = gguf_blocks(Q8_0, (16, 96))
    parts = [
        QuantizedTensor(raw, int(Q4_1), (64, 96)),
        weight(32, 96),
        QuantizedTensor(raw8, 8, (16, 96)),
    ]
    bias = torch.arange(112.0)
    fused = PackedLinear.from_parts(fmt, parts, bias=bias)
    separate = [PackedLinear.from_parts(fmt, [p]) for p in parts]
    assert fused.out_features == 112 and fused.format is fmt
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in separate]))
    assert torch.equal(fused.bias, bias)
    # Each output is computed on its own row with the same rounded inputs: fusing changes
    # nothing, not even the float rounding.
    x = inputs(3, 96)
    expected = torch.cat([p(x) for p in separate], dim=1) + bias
    assert torch.equal(fused(x), expected)
    with pytest.raises(QuantizationError, match="input size"):
        PackedLinear.from_parts(fmt, [weight(32, 96), weight(32, 64)])


def test_rejects_shapes_it_cannot_hold():
    for fmt in (Q4, Q8):
        with pytest.raises(QuantizationError, match="in_features"):
            packed(weight(64, 40), fmt)
        with pytest.raises(QuantizationError, match="2-D"):
            packed(torch.zeros(2, 4, 32), fmt)
        assert packed(weight(75, 64), fmt).out_features == 75  # any number of outputs
    w = weight(72, 40).half().numpy()
    with pytest.raises(QuantizationError, match="in_features"):
        PackedLinear.from_parts(Q8, [QuantizedTensor(w, int(GGMLQuantizationType.F16), (72, 40))])


def test_a_packed_layer_refuses_to_leave_the_cpu_formats():
    layer = packed(weight(16, 64), Q8, bias=torch.ones(16))
    with pytest.raises(TypeError, match="float32 bias"):
        layer.to(torch.float16)


# -- GGUF blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qtype", "fmt", "shape"),
    [
        (Q4_0, Q4, (80, 96)),
        (Q4_1, Q4, (80, 96)),
        (Q8_0, Q8, (80, 96)),
        (Q4_0, Q4, (77, 576)),
        (Q4_1, Q4, (77, 576)),
        (Q8_0, Q8, (77, 576)),
    ],
)
def test_gguf_blocks_convert_exactly(qtype, fmt, shape):
    raw, reference = gguf_blocks(qtype, shape)
    layer = PackedLinear.from_parts(fmt, [QuantizedTensor(raw, int(qtype), shape)])
    # Bit for bit gguf's own dequantization: float16 d (and m) kept, d * q (+ m) rounded once
    # in float32 as gguf-py does; Q4_0's d * (q - 8) = d * q + (-8 d) is exact.
    assert torch.equal(layer.dequantize(), reference)
    x = inputs(4, shape[1])
    y = layer(x)
    check_kernel(layer, x, y)
    assert rel_err(y, x @ reference.T) < RTOL[fmt.name]


@pytest.mark.parametrize(
    ("qtype", "fmt"), [(Q4_0, Q8), (Q4_1, Q8), (Q8_0, Q4), (GGMLQuantizationType.Q5_0, Q8)]
)
def test_other_gguf_blocks_requantize_from_their_values(qtype, fmt):
    raw, reference = gguf_blocks(qtype)
    layer = PackedLinear.from_parts(fmt, [QuantizedTensor(raw, int(qtype), reference.shape)])
    # Quantized as the float weight would be.
    assert torch.equal(layer.dequantize(), packed(reference, fmt).dequantize())


def test_gguf_float_types_go_through_dequantization():
    w = weight(80, 96)
    f16 = QuantizedTensor(w.half().numpy(), int(GGMLQuantizationType.F16), (80, 96))
    assert torch.equal(
        PackedLinear.from_parts(Q4, [f16]).dequantize(), packed(w.half(), Q4).dequantize()
    )
    # The loader's one dequantizer gives gguf-py's values bit for bit.
    for qtype in (Q8_0, Q4_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.F16):
        data = quantize(w.numpy(), qtype)
        assert torch.equal(
            loader_dequantize(QuantizedTensor(data, int(qtype), (80, 96))),
            torch.from_numpy(dequantize(data, qtype).reshape(80, 96).astype(np.float32)),
        ), qtype.name


@pytest.mark.parametrize(("qtype", "fmt"), [(Q4_0, Q4), (Q4_1, Q4), (Q8_0, Q8)])
def test_gguf_bytes_must_fit_the_shape(qtype, fmt):
    raw, _ = gguf_blocks(qtype)
    with pytest.raises(QuantizationError, match="bytes per row"):
        PackedLinear.from_parts(fmt, [QuantizedTensor(raw, int(qtype), (80, 64))])


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
        with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF file"):
            load_gguf_quantized(truncated)


# -- the default model's real blocks -------------------------------------------------------------


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
    layer = PackedLinear.from_parts(Q4, [tensor])
    assert torch.equal(layer.dequantize(), reference)
    x = inputs(4, tensor.shape[1])
    y = layer(x)
    check_kernel(layer, x, y)
    assert rel_err(y, x @ reference.T) < RTOL["q4"]


def test_default_model_q8_0_table_serves_embedding_and_head(default_blocks):
    tensor = default_blocks["model.embed_tokens.weight"]
    assert tensor.type_name == "Q8_0" and tensor.shape == (49152, 576)
    reference = gguf_values(tensor)
    table = PackedLinear.from_parts(Q8, [tensor])
    ids = torch.tensor([0, 2, 1234, 49151])
    assert torch.equal(PackedEmbedding(table, torch.float32)(ids), reference[ids])
    # The tied LM head reads the same table through the kernel, on 16-bit inputs.
    hidden = inputs(2, 576)
    logits = table(hidden)
    check_kernel(table, hidden, logits)
    assert rel_err(logits, hidden @ reference.T) < RTOL["q8"]
