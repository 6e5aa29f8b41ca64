"""Weight formats: how a tensor is stored in the graph and what it dequantises to.

f32 and f16 are plain constants; int8 is symmetric per output channel; int4 is symmetric in groups
of 32 along the input dimension with f16 scales. Each quantised weight becomes OpenVINO's
decompression pattern (low-precision Constant -> Convert -> Multiply by scale), which the plugins
turn into compressed-weight matmuls. `dequantize` reproduces the graph's arithmetic exactly, so the
oracle can run on the very weights the engine uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset16 as ops

from cascadia.model.formats import INT4_GROUP, WEIGHT_FORMATS, WeightFormat, stored_bytes

__all__ = ["INT4_GROUP", "WEIGHT_FORMATS", "Quantized", "WeightFormat", "dequantize", "quantize", "stored_bytes"]


@dataclass(frozen=True)
class Quantized:
    """A weight [..., N, K] in one of the formats; `values` holds the stored integers or floats."""

    fmt: WeightFormat
    values: np.ndarray
    scale: np.ndarray | None  # int8: [..., N, 1] f32; int4: [..., N, K/32, 1] f16

    @property
    def nbytes(self) -> int:
        bits = {"f32": 32, "f16": 16, "int8": 8, "int4": 4}[self.fmt]
        scale_bytes = 0 if self.scale is None else self.scale.nbytes
        return self.values.size * bits // 8 + scale_bytes


def quantize(weight: np.ndarray, fmt: WeightFormat) -> Quantized:
    weight = np.asarray(weight, dtype=np.float32)
    if fmt == "f32":
        return Quantized(fmt, weight, None)
    if fmt == "f16":
        return Quantized(fmt, weight.astype(np.float16), None)
    if fmt == "int8":
        scale = np.abs(weight).max(axis=-1, keepdims=True) / 127.0
        scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
        q = np.clip(np.rint(weight / scale), -127, 127).astype(np.int8)
        return Quantized(fmt, q, scale)
    if fmt == "int4":
        k = weight.shape[-1]
        if k % INT4_GROUP:
            raise ValueError(f"int4 needs an input dimension divisible by {INT4_GROUP}, got {k}")
        grouped = weight.reshape(*weight.shape[:-1], k // INT4_GROUP, INT4_GROUP)
        scale = (np.abs(grouped).max(axis=-1, keepdims=True) / 7.0).astype(np.float16)
        scale = np.where(scale == 0, np.float16(1.0), scale).astype(np.float16)
        q = np.clip(np.rint(grouped / scale.astype(np.float32)), -8, 7).astype(np.int8)
        return Quantized(fmt, q, scale)
    raise ValueError(f"unknown weight format '{fmt}' (choose from {', '.join(WEIGHT_FORMATS)})")


def dequantize(q: Quantized) -> np.ndarray:
    """The f32 values the graph computes with."""
    if q.fmt == "f32":
        return q.values
    if q.fmt == "f16":
        return q.values.astype(np.float32)
    if q.fmt == "int8":
        return q.values.astype(np.float32) * q.scale
    product = q.values.astype(np.float16) * q.scale  # the graph multiplies in f16
    return product.reshape(*product.shape[:-2], -1).astype(np.float32)


def _int4_constant(values: np.ndarray) -> ov.Node:
    tensor = ov.Tensor(ov.Type.i4, ov.Shape(list(values.shape)))
    nibbles = (values.astype(np.uint8) & 0xF).reshape(-1)
    if nibbles.size % 2:
        nibbles = np.concatenate([nibbles, np.zeros(1, np.uint8)])
    tensor.data[:] = (nibbles[0::2] | (nibbles[1::2] << 4)).view(np.int8).reshape(tensor.data.shape)
    return ops.constant(tensor)


def weight_node(weight: np.ndarray, fmt: WeightFormat, name: str) -> ov.Node:
    """An f32-valued graph node for `weight` stored in `fmt`."""
    q = quantize(weight, fmt)
    if q.fmt == "f32":
        return ops.constant(q.values, name=name)
    if q.fmt == "f16":
        return ops.convert(ops.constant(q.values, name=name), "f32")
    if q.fmt == "int8":
        values = ops.convert(ops.constant(q.values, name=name), "f32")
        return ops.multiply(values, ops.constant(q.scale))
    values = ops.convert(_int4_constant(q.values), "f16")
    scaled = ops.multiply(values, ops.constant(q.scale))
    shape = ops.constant(np.array([*weight.shape], dtype=np.int64))
    return ops.convert(ops.reshape(scaled, shape, special_zero=False), "f32")
