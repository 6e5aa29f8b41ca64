"""Weight formats: how a tensor is stored in the graph and what it dequantises to.

f32 and f16 are plain constants; int8 is symmetric per output channel; int4 is symmetric in groups
of 32 along the input dimension with f16 scales; u4 and u8 are GGUF's asymmetric blocks (a zero
point per group), kept as the file holds them. Each quantised weight becomes OpenVINO's
decompression pattern (low-precision Constant -> Convert -> Multiply by scale), which the plugins
turn into compressed-weight matmuls. `dequantize` reproduces the graph's arithmetic exactly, so the
oracle can run on the very weights the engine uses.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset16 as ops

from cascadia.model.formats import (
    INT4_GROUP,
    WEIGHT_FORMATS,
    Quantized,
    Weight,
    WeightFormat,
    dequantize,
    quantize,
    stored_bytes,
)

__all__ = [
    "INT4_GROUP",
    "WEIGHT_FORMATS",
    "Quantized",
    "Weight",
    "WeightFormat",
    "dequantize",
    "quantize",
    "stored_bytes",
]


def _nibble_constant(values: np.ndarray, kind: ov.Type, packed: bool = False) -> ov.Node:
    """A 4-bit constant (i4 or u4), two values a byte, the first in the low nibble; `values` one per
    element, or already packed (`packed`: [..., m] bytes for [..., 2m] values)."""
    if packed:
        shape = [*values.shape[:-1], values.shape[-1] * 2]
        owner = _owning_tensor(values)
        if owner is not None and owner.get_element_type() == kind and list(owner.shape) == shape:
            # bytes the reader wrote into this tensor (`packed_store`): the constant shares them
            return ops.constant(owner)
        tensor = ov.Tensor(kind, ov.Shape(shape))
        tensor.data[:] = np.ascontiguousarray(values, dtype=np.uint8).view(tensor.data.dtype).reshape(tensor.data.shape)
        return ops.constant(tensor)
    tensor = ov.Tensor(kind, ov.Shape(list(values.shape)))
    nibbles = (values.astype(np.uint8) & 0xF).reshape(-1)
    if nibbles.size % 2:
        nibbles = np.concatenate([nibbles, np.zeros(1, np.uint8)])
    packed_bytes = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
    tensor.data[:] = packed_bytes.view(tensor.data.dtype).reshape(tensor.data.shape)
    return ops.constant(tensor)


def packed_store(shape: tuple[int, ...]) -> np.ndarray:
    """Memory for packed int4 values [..., 2m values as m bytes], owned by an OpenVINO tensor of the
    values' shape: a constant made from it later shares it. (A constant made from a tensor that views
    numpy memory does not keep that memory alive, and one copied would double a bank while it is built.)"""
    tensor = ov.Tensor(ov.Type.i4, ov.Shape([*shape[:-1], shape[-1] * 2]))
    return tensor.data.view(np.uint8).reshape(shape)


def _owning_tensor(values: np.ndarray) -> ov.Tensor | None:
    """The OpenVINO tensor whose whole memory `values` is, if it is one (see `packed_store`)."""
    base = values
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if not isinstance(base, ov.Tensor) or not values.flags.c_contiguous or values.nbytes != base.byte_size:
        return None
    if values.__array_interface__["data"][0] != base.data.__array_interface__["data"][0]:
        return None
    return base


def _shared_constant(values: np.ndarray, name: str | None = None) -> ov.Node:
    """A constant viewing `values` (kept alive by the constant) rather than a copy of them."""
    return ops.constant(np.ascontiguousarray(values), shared_memory=True, name=name)


def weight_node(weight: Weight, fmt: WeightFormat, name: str) -> ov.Node:
    """An f32-valued graph node for `weight` stored in `fmt` (weights read already quantised keep theirs)."""
    return stored_node(weight if isinstance(weight, Quantized) else quantize(weight, fmt), name)


def stored_node(q: Quantized, name: str) -> ov.Node:
    if q.fmt == "f32":
        return _shared_constant(q.values, name)
    if q.fmt == "f16":
        return ops.convert(_shared_constant(q.values, name), "f32")
    if q.fmt == "int8":
        values = ops.convert(_shared_constant(q.values, name), "f32")
        return ops.multiply(values, ops.constant(q.scale))
    if q.fmt == "int4":
        values = ops.convert(_nibble_constant(q.values, ov.Type.i4, q.packed), "f16")
    elif q.fmt == "u4":
        zero = ops.convert(_nibble_constant(q.zero_point, ov.Type.u4), "f16")
        values = ops.subtract(ops.convert(_nibble_constant(q.values, ov.Type.u4, q.packed), "f16"), zero)
    else:
        zero = ops.convert(ops.constant(np.ascontiguousarray(q.zero_point, dtype=np.uint8)), "f16")
        values = ops.subtract(ops.convert(ops.constant(np.ascontiguousarray(q.values, dtype=np.uint8)), "f16"), zero)
    scaled = ops.multiply(values, ops.constant(np.ascontiguousarray(q.scale, dtype=np.float16)))
    shape = ops.constant(np.array(q.shape, dtype=np.int64))
    return ops.convert(ops.reshape(scaled, shape, special_zero=False), "f32")
