"""The GGUF file format: its header parsed, its tensors mapped, their blocks decoded.

`read_gguf` is a parser of the format's header written here rather than gguf-py's
`GGUFReader`: on the default model reading the metadata (tokenizer included) and tensor index
takes ~50 ms here against ~2.1 s for `GGUFReader` (~0.7 s with its memmap slicing bypassed),
which builds a numpy array per value of the ~100k tokenizer strings. gguf-py still provides the
type table (`GGML_QUANT_SIZES`) and dequantizes the types `dequantize` does not decode itself.
Nothing here knows model architectures or Hugging Face names (gguf_model.py does).
"""

from __future__ import annotations

import math
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .model_errors import ModelLoadError

# torch is imported only where tensors are decoded, so tokenizer-only users stay light.
if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class QuantizedTensor:
    """One GGUF tensor as its raw blocks.

    `data` is uint8 [..., bytes per row] (a weight: [out_features, bytes per row]): a read-only
    view of the file mapping, or a copy for Llama's Q/K weights whose rows were reordered.
    `qtype` is the GGML type number (`gguf.GGMLQuantizationType`), `shape` the tensor's shape
    slowest dimension first (a weight: (out_features, in_features)).
    """

    data: np.ndarray
    qtype: int
    shape: tuple[int, ...]

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.qtype).name


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata, as plain Python values (arrays as lists), and its tensors by
    GGUF name in file order, each a view of one read-only memory map of the file."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, QuantizedTensor]


# GGUF metadata value types (gguf.GGUFValueType) with a fixed size, as struct formats.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_GGUF_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file (format versions 2 and 3): parse its header, map its tensors."""
    path = Path(path)
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        # A plain ndarray view: np.memmap runs Python hooks on every slice taken of it.
        data = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
        header = _GGUFHeader(memoryview(data))
        version = header.scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_fields = header.scalar("<Q"), header.scalar("<Q")
        metadata = {}
        for _ in range(num_fields):
            key = header.string()
            metadata[key] = header.value(header.scalar("<I"))
        infos = [header.tensor_info() for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", 32))
        if alignment < 1:
            raise ValueError(f"general.alignment is {alignment}")
        start = -(-header.pos // alignment) * alignment
        tensors = {info[0]: _tensor_view(data, start, *info) for info in infos}
    except (struct.error, ValueError, IndexError, KeyError, OSError, RecursionError) as exc:
        # UnicodeDecodeError (a damaged string) is a ValueError; RecursionError, arrays of
        # arrays nested past Python's stack.
        raise ModelLoadError(f"{path} is a truncated or corrupt GGUF file ({exc})") from exc
    return GGUFFile(path, metadata, tensors)


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (token lists included)."""
    return read_gguf(path).metadata


class _GGUFHeader:
    """A cursor over a GGUF file's little-endian header, just past the magic."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.pos = 4

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        return self._text(self.pos, self.pos + size)

    def value(self, kind: int) -> Any:
        if kind in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind != _GGUF_ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item in _GGUF_SCALARS:
            dtype = np.dtype(_GGUF_SCALARS[item])
            values = np.frombuffer(self.buffer, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        if item == _GGUF_STRING:
            return self._strings(count)
        return [self.value(item) for _ in range(count)]

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        """(name, shape slowest dimension first, GGML type, offset from the data start)."""
        name = self.string()
        num_dims = self.scalar("<I")
        if num_dims > _GGUF_MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {num_dims} dimensions (GGUF allows 4)")
        dims = [self.scalar("<Q") for _ in range(num_dims)]
        return name, tuple(reversed(dims)), self.scalar("<I"), self.scalar("<Q")

    def _strings(self, count: int) -> list[str]:
        # The tokenizer's ~100k strings: one tight loop, not a method call per string.
        unpack, buffer, pos = struct.Struct("<Q").unpack_from, self.buffer, self.pos
        strings = []
        for _ in range(count):
            (size,) = unpack(buffer, pos)
            strings.append(self._text(pos + 8, pos + 8 + size))
            pos = self.pos
        return strings

    def _text(self, begin: int, end: int) -> str:
        if end > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        self.pos = end
        return str(self.buffer[begin:end], "utf-8")


def _tensor_view(
    data: np.ndarray, start: int, name: str, shape: tuple[int, ...], qtype: int, offset: int
) -> QuantizedTensor:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown GGML type {qtype}") from None
    if not shape or shape[-1] % block:
        raise ValueError(f"tensor {name!r} of shape {shape} is not whole blocks of {block}")
    row_bytes = shape[-1] // block * block_bytes
    begin = start + offset
    end = begin + math.prod(shape[:-1]) * row_bytes
    if end > len(data):
        raise ValueError(f"tensor {name!r} runs past the end of the file")
    return QuantizedTensor(data[begin:end].reshape(*shape[:-1], row_bytes), qtype, shape)


# -- dequantization ----------------------------------------------------------------------------

# gguf.GGMLQuantizationType numbers of the types `dequantize` decodes itself.
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30
# The rest go through gguf-py (`check_dequantizable` tries one block at load).
DECODED_HERE = (_F32, _F16, _BF16, _Q4_0, _Q4_1, _Q8_0)


def dequantize(tensor: QuantizedTensor) -> torch.Tensor:
    """The float32 values of a GGUF tensor, shaped `tensor.shape`; always a new tensor.

    F32, F16, BF16, Q4_0, Q4_1 and Q8_0 are decoded by torch ops on a view of the bytes, bit
    for bit as gguf-py does and faster (the default model's Q4_1 weights, one thread: 0.19 s
    against 0.5 s); other types go through `gguf.quants.dequantize`. `data` may also be a
    torch tensor or an array of another dtype: its bytes are what counts. Raises ValueError
    when `data` does not hold `shape`'s values, NotImplementedError for a type gguf-py cannot
    decode.
    """
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    kind = GGMLQuantizationType(tensor.qtype)
    block, block_bytes = GGML_QUANT_SIZES[kind]
    shape = tuple(tensor.shape)
    raw = byte_view(tensor.data)
    if not shape or shape[-1] % block or raw.numel() != math.prod(shape) // block * block_bytes:
        raise ValueError(
            f"{raw.numel()} bytes of {kind.name} data do not hold a tensor of shape {shape}"
        )
    floats = {_F32: torch.float32, _F16: torch.float16, _BF16: torch.bfloat16}
    if kind in floats:
        return raw.view(floats[kind]).to(torch.float32, copy=True).view(shape)
    if kind not in (_Q4_0, _Q4_1, _Q8_0):
        values = gguf_dequantize(raw.numpy().reshape(-1, block_bytes), kind)
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))
    # Each block: a float16 scale (Q4_1: then a float16 minimum), then its 32 quants; Q4_0/Q4_1
    # hold quants 0-15 in the low nibbles of 16 bytes and 16-31 in the high ones.
    blocks = raw.view(-1, block_bytes)
    values = torch.empty(blocks.shape[0], block, dtype=torch.float32)
    scale = blocks[:, :2].view(torch.float16)
    if kind == _Q8_0:
        values.copy_(blocks[:, 2:].view(torch.int8)).mul_(scale)
    else:
        quants = blocks[:, 2:] if kind == _Q4_0 else blocks[:, 4:]
        values[:, :16], values[:, 16:] = quants & 0x0F, quants >> 4
        if kind == _Q4_0:
            values.sub_(8).mul_(scale)
        else:
            values.mul_(scale).add_(blocks[:, 2:4].view(torch.float16))
    return values.view(shape)


def byte_view(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor's data (a numpy view of the file mapping, or a tensor), flat."""
    import torch

    if isinstance(data, torch.Tensor):
        return data.contiguous().view(torch.uint8).reshape(-1)
    with warnings.catch_warnings():
        # A view of the read-only file mapping: torch warns, but it is only read here.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1))


def check_dequantizable(tensor: QuantizedTensor, name: str, path: Path) -> None:
    """Fail at load, not at the first lookup, on a type gguf-py cannot decode."""
    if tensor.qtype in DECODED_HERE:
        return
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    kind = GGMLQuantizationType(tensor.qtype)
    try:
        gguf_dequantize(tensor.data.reshape(-1)[: GGML_QUANT_SIZES[kind][1]], kind)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: tensor {name} uses {kind.name}, which cannot be dequantized"
        ) from exc


def is_gguf(path: Path) -> bool:
    """A .gguf name, or a file that starts with the GGUF magic."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
