"""Weight-only quantized linear layers: quantization error, kernels, GGUF blocks, real weights.

Error bounds come from bf16, the format of the kernels' activations, scales and zeros: its unit
roundoff is u = 2**-8. The kernel path rounds the input and the output to bf16, so it matches a
float32 matmul with the same dequantized weight to about 2u in relative norm; scales rounded to
bf16 move a GGUF weight by at most u of its group's largest magnitude per rounded term.
"""

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

U = 2.0**-8  # bf16 unit roundoff
KERNEL_RTOL = 2 * U  # input and output rounded to bf16
Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
# 80 rows = 64 + 16 = 2 * 32 + 16: a short last packing block on AVX2 and AVX-512 builds.
SHAPES = [(80, 96), (192, 576)]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


def weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.05 * torch.randn(rows, cols, generator=g)


def inputs(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def group_max(values: torch.Tensor) -> torch.Tensor:
    """Each element's 32-wide group's largest magnitude (the scale of its GGUF block)."""
    groups = values.abs().view(values.shape[0], -1, 32)
    return groups.amax(dim=2, keepdim=True).expand_as(groups).reshape(values.shape)


def kernel_only(layer: QuantizedLinear) -> QuantizedLinear:
    layer.dense_min_rows = float("inf")
    return layer


def dense_only(layer: QuantizedLinear) -> QuantizedLinear:
    layer.dense_min_rows = 0
    return layer


# -- quantizing float weights -------------------------------------------------------------------


def test_pack_layout_is_recognised():
    # Without it the dense path and embedding lookups fall back to a slow kernel-based unpack.
    assert quant._pack_layout() is not None


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_rounds_each_weight_to_its_row_step(shape):
    w = weight(*shape)
    layer = QuantizedLinear.from_float(w, "int8")
    step = layer.scales.float()[:, None]
    # Half a step from rounding, plus up to 127 * u of a step because the scale is rounded
    # to bf16 before the weights (values past 127 clamp).
    assert ((layer.dequantize() - w).abs() <= step * (0.5 + 127 * U)).all()
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() <= 127


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_rounds_each_weight_to_its_group_step(shape):
    w = weight(*shape)
    layer = QuantizedLinear.from_float(w, "int4")
    groups = w.view(shape[0], -1, 32)
    step = (groups.amax(2) - groups.amin(2)) / 15
    step = step[..., None].expand_as(groups).reshape(shape)
    # Rounding against the bf16 scale and zero: half a step, plus the zero's and scale's bf16
    # error (|zero| <= group max, 8 steps of scale error), all below one step here.
    assert ((layer.dequantize() - w).abs() <= step * (0.5 + 8 * U) + U * group_max(w)).all()
    assert rel_err(layer.dequantize(), w) < 0.1  # 4-bit: step / sqrt(12) of a ~4 sigma range


@pytest.mark.parametrize("shape", SHAPES)
def test_int4x2_is_q8_0_like(shape):
    w = weight(*shape)
    layer = QuantizedLinear.from_float(w, "int4x2")
    step = group_max(w) / 127
    assert ((layer.dequantize() - w).abs() <= step * (0.5 + 127 * U)).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_dequantized_matmul(mode, shape):
    layer = kernel_only(QuantizedLinear.from_float(weight(*shape), mode))
    x = inputs(3, shape[1])
    expected = x @ layer.dequantize().T
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (3, shape[0])
    assert rel_err(y, expected) < KERNEL_RTOL


@pytest.mark.parametrize("mode", MODES)
def test_dense_path_matches_dequantized_matmul_across_chunks(mode, monkeypatch):
    # Chunks of 64 rows: several per layer, the last one holding the short packing block.
    monkeypatch.setattr(quant, "_DENSE_CHUNK_ELEMENTS", 64 * 96 * 2)
    layer = dense_only(QuantizedLinear.from_float(weight(272, 96), mode))
    x = inputs(5, 96)
    assert rel_err(layer(x), x @ layer.dequantize().T) < 1e-5  # float32 GEMM rounding only


@pytest.mark.parametrize("mode", MODES)
def test_forward_picks_the_path_by_row_count(mode):
    layer = QuantizedLinear.from_float(weight(80, 96), mode)
    reference = layer.dequantize()
    small = inputs(layer.dense_min_rows - 1, 96)
    large = inputs(layer.dense_min_rows, 96)
    # The kernel rounds through bf16, the dense path does not.
    assert 1e-5 < rel_err(layer(small), small @ reference.T) < KERNEL_RTOL
    assert rel_err(layer(large), large @ reference.T) < 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_bias_shapes_and_dtypes(mode):
    bias = torch.linspace(-1, 1, 80)
    layer = kernel_only(QuantizedLinear.from_float(weight(80, 96), mode, bias=bias))
    x = inputs(6, 96).view(2, 3, 96)
    expected = x @ layer.dequantize().T + bias
    y = layer(x)
    assert y.shape == (2, 3, 80) and y.dtype == torch.float32
    assert rel_err(y, expected) < KERNEL_RTOL
    y16 = layer(x.bfloat16())
    assert y16.dtype == torch.bfloat16 and rel_err(y16, expected) < KERNEL_RTOL
    assert layer(torch.empty(0, 96)).shape == (0, 80)


@pytest.mark.parametrize("mode", MODES)
def test_embedding_gathers_dequantized_rows(mode):
    layer = QuantizedLinear.from_float(weight(272, 96), mode)
    table = layer.dequantize()
    ids = torch.tensor([[0, 271, 17, 17], [256, 263, 31, 32]])  # last rows: the short block
    rows = QuantizedEmbedding(layer)(ids)
    assert rows.shape == (2, 4, 96)
    assert torch.equal(rows, table[ids])


@pytest.mark.parametrize("mode", MODES)
def test_cat_fuses_along_outputs(mode):
    parts = [QuantizedLinear.from_float(weight(n, 96, seed=n), mode) for n in (64, 16, 16)]
    parts[1] = QuantizedLinear.from_float(weight(16, 96, seed=7), mode, bias=torch.ones(16))
    fused = kernel_only(QuantizedLinear.cat(parts))
    assert fused.out_features == 96 and fused.mode == mode
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = inputs(2, 96)
    expected = torch.cat([kernel_only(p)(x) for p in parts], dim=1)
    assert torch.allclose(fused(x), expected, rtol=0, atol=1e-6)


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
    fused = QuantizedLinear.from_parts(parts, mode, bias=bias)
    separate = [
        QuantizedLinear.from_gguf(raw, Q4_1, (64, 96), mode),
        QuantizedLinear.from_float(weight(32, 96), mode),
        QuantizedLinear.from_gguf(raw8, Q8_0, (16, 96), mode),
    ]
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in separate]))
    assert torch.equal(fused.bias, bias)
    with pytest.raises(QuantizationError, match="input size"):
        QuantizedLinear.from_parts([weight(32, 96), weight(32, 64)], mode)


def test_rejects_shapes_the_int4_kernel_cannot_run():
    with pytest.raises(QuantizationError, match="in_features"):
        QuantizedLinear.from_float(weight(64, 40), "int4")
    with pytest.raises(QuantizationError, match="out_features"):
        QuantizedLinear.from_float(weight(72, 64), "int4x2")
    with pytest.raises(QuantizationError, match="mode"):
        QuantizedLinear.from_float(weight(64, 64), "int3")
    assert QuantizedLinear.from_float(weight(72, 40), "int8").out_features == 72


def test_resident_bytes_follow_the_mode():
    rows, cols = 192, 576
    sizes = {mode: QuantizedLinear.from_float(weight(rows, cols), mode).nbytes for mode in MODES}
    assert sizes["int8"] == rows * cols + 2 * rows  # int8 weights, bf16 scale per row
    assert sizes["int4"] == rows * cols // 2 + rows * cols // 32 * 4  # + bf16 scale, zero
    assert sizes["int4x2"] == 2 * sizes["int4"]


# -- GGUF blocks --------------------------------------------------------------------------------


def gguf_blocks(qtype: GGMLQuantizationType, shape=(80, 96)) -> tuple[np.ndarray, torch.Tensor]:
    w = weight(*shape).numpy()
    raw = quantize(w, qtype)
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(shape).astype(np.float32))


@pytest.mark.parametrize(
    ("qtype", "mode", "terms"),
    [(Q4_0, "int4", 1), (Q4_1, "int4", 2), (Q8_0, "int4x2", 1)],
)
def test_gguf_blocks_convert_exactly_up_to_bf16_scales(qtype, mode, terms):
    raw, reference = gguf_blocks(qtype)
    layer = QuantizedLinear.from_gguf(raw, qtype, reference.shape, mode)
    # d (and Q4_1's zero m + 8d, at most about the group's largest magnitude away from 0)
    # rounded to bf16: each rounded term moves a weight by <= u of the group's largest value.
    bound = terms * U * group_max(reference) * 1.01
    assert ((layer.dequantize() - reference).abs() <= bound).all()
    x = inputs(4, reference.shape[1])
    expected = x @ reference.T
    assert rel_err(kernel_only(layer)(x), expected) < KERNEL_RTOL + terms * U
    assert rel_err(dense_only(layer)(x), expected) < terms * U


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
def test_gguf_blocks_requantize_to_int8_per_channel(qtype):
    raw, reference = gguf_blocks(qtype)
    layer = QuantizedLinear.from_gguf(raw, qtype, reference.shape, "int8")
    step = reference.abs().amax(dim=1, keepdim=True) / 127
    assert ((layer.dequantize() - reference).abs() <= step * (0.5 + 127 * U)).all()


def test_gguf_float_and_other_types_go_through_dequantization():
    w = weight(80, 96)
    f16 = w.half().numpy()
    layer = QuantizedLinear.from_gguf(f16, GGMLQuantizationType.F16, w.shape, "int4")
    assert torch.equal(
        layer.dequantize(), QuantizedLinear.from_float(w.half(), "int4").dequantize()
    )
    q5 = quantize(w.numpy(), GGMLQuantizationType.Q5_0)
    assert torch.equal(
        gguf_dequantize(q5, GGMLQuantizationType.Q5_0, 80, 96),
        torch.from_numpy(dequantize(q5, GGMLQuantizationType.Q5_0).reshape(80, 96)),
    )


def test_gguf_bytes_must_fit_the_shape():
    raw, _ = gguf_blocks(Q4_1)
    with pytest.raises(QuantizationError, match="bytes per row"):
        QuantizedLinear.from_gguf(raw, Q4_1, (80, 64), "int4")


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


# -- the default model's real blocks ------------------------------------------------------------


@pytest.fixture(scope="module")
def default_blocks():
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    raw = load_gguf_quantized(default_model_path())
    return {name: raw[name] for name in [*names, "model.embed_tokens.weight"]}


@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]
)
def test_default_model_q4_1_layer_converts_exactly(default_blocks, name):
    tensor = default_blocks[name]
    assert tensor.type_name == "Q4_1"
    reference = gguf_dequantize(tensor.data, tensor.qtype, *tensor.shape)
    layer = QuantizedLinear.from_gguf(tensor.data, tensor.qtype, tensor.shape, "int4")
    assert ((layer.dequantize() - reference).abs() <= 2 * U * group_max(reference) * 1.01).all()
    x = inputs(4, tensor.shape[1])
    assert rel_err(kernel_only(layer)(x), x @ reference.T) < KERNEL_RTOL + 2 * U


def test_default_model_q8_0_embedding_table(default_blocks):
    tensor = default_blocks["model.embed_tokens.weight"]
    assert tensor.type_name == "Q8_0" and tensor.shape == (49152, 576)
    reference = gguf_dequantize(tensor.data, tensor.qtype, *tensor.shape)
    ids = torch.tensor([0, 2, 1234, 49151])
    exact = QuantizedLinear.from_gguf(tensor.data, tensor.qtype, tensor.shape, "int4x2")
    assert ((exact.embedding(ids) - reference[ids]).abs() <= U * group_max(reference[ids])).all()
    # Per-channel int8 requantizes Q8_0's per-32 scales to one per row: about 1% error
    # (measured 1.2%); that is what the LM head costs in exchange for the fastest kernel.
    head = QuantizedLinear.from_gguf(tensor.data, tensor.qtype, tensor.shape, "int8")
    assert rel_err(head.dequantize(), reference) < 0.015
    hidden = inputs(2, 576)
    assert rel_err(kernel_only(head)(hidden), hidden @ reference.T) < 0.015 + KERNEL_RTOL
