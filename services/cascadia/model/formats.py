"""Weight storage formats, their sizes and arithmetic: pure numpy, shared by engine, readers and planner."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

WeightFormat = Literal["f32", "f16", "int8", "int4"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("f32", "f16", "int8", "int4")
# Asymmetric blocks as GGUF files hold them: unsigned values, an f16 scale and an unsigned zero
# point per group of 32 along the input dimension; weight = (value - zero point) * scale.
BlockFormat = Literal["u4", "u8"]
StoredFormat = WeightFormat | BlockFormat
INT4_GROUP = 32


def stored_bytes(weight_shape: tuple[int, ...], fmt: WeightFormat) -> int:
    """Bytes a weight of this shape occupies in `fmt` (values plus scales)."""
    n = math.prod(weight_shape)
    if fmt == "f32":
        return 4 * n
    if fmt == "f16":
        return 2 * n
    if fmt == "int8":
        return n + 4 * n // weight_shape[-1]
    return n // 2 + 2 * (n // INT4_GROUP)


@dataclass(frozen=True)
class Quantized:
    """A weight [..., N, K] in one of the formats; `values` holds the stored integers or floats.

    Grouped formats (int4, u4, u8) keep values as [..., N, K/32, 32] and scales as [..., N, K/32, 1].
    """

    fmt: StoredFormat
    values: np.ndarray
    scale: np.ndarray | None  # int8: [..., N, 1] f32; int4, u4, u8: [..., N, K/32, 1] f16
    zero_point: np.ndarray | None = None  # u4, u8: like the scale, unsigned
    # 4-bit values two to a byte ([..., N, K/32, 16] uint8, the first value in the low nibble), as
    # the graph's constants hold them, instead of one int8 per value
    packed: bool = False

    @property
    def nbytes(self) -> int:
        bits = {"f32": 32, "f16": 16, "int8": 8, "int4": 4, "u4": 4, "u8": 8}[self.fmt]
        scale_bytes = 0 if self.scale is None else self.scale.nbytes
        zero_bytes = 0 if self.zero_point is None else self.zero_point.size * bits // 8
        value_bytes = self.values.nbytes if self.packed else self.values.size * bits // 8
        return value_bytes + scale_bytes + zero_bytes

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., N, K] shape of the weight."""
        if self.fmt in ("int4", "u4", "u8"):
            per_group = self.values.shape[-1] * (2 if self.packed else 1)
            return (*self.values.shape[:-2], self.values.shape[-2] * per_group)
        return tuple(self.values.shape)

    def map_blocks(self, fn) -> Quantized:
        """Apply an index operation on the leading axes (all but the last) to values, scales and zero points."""
        scale = None if self.scale is None else fn(self.scale)
        zero = None if self.zero_point is None else fn(self.zero_point)
        return Quantized(self.fmt, fn(self.values), scale, zero, self.packed)

    def unpacked_values(self) -> np.ndarray:
        """The stored values one per element (4-bit ones as int8 for int4, uint8 for u4)."""
        if not self.packed:
            return self.values
        return unpack_nibbles(self.values, signed=self.fmt == "int4")


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """4-bit values [..., 2m] (signed or not) -> [..., m] uint8, the first of each pair in the low nibble."""
    nibbles = values.astype(np.uint8) & 0xF
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, signed: bool) -> np.ndarray:
    """Undo `pack_nibbles`: [..., m] uint8 -> [..., 2m], int8 in -8..7 when `signed`, else uint8 in 0..15."""
    low, high = packed & 0xF, packed >> 4
    both = np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)
    if not signed:
        return both
    return (both.astype(np.int8) ^ 8) - 8


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
    if q.packed:
        q = Quantized(q.fmt, q.unpacked_values(), q.scale, q.zero_point)
    if q.fmt == "f32":
        return q.values
    if q.fmt == "f16":
        return q.values.astype(np.float32)
    if q.fmt == "int8":
        return q.values.astype(np.float32) * q.scale
    if q.fmt in ("u4", "u8"):
        # small integers times an f16 scale are exact in f32, which is how the plugins decompress
        steps = q.values.astype(np.float32) - q.zero_point.astype(np.float32)
        product = steps * q.scale.astype(np.float32)
    else:
        product = q.values.astype(np.float16) * q.scale  # the graph multiplies in f16
    return product.reshape(*product.shape[:-2], -1).astype(np.float32)


Weight = np.ndarray | Quantized


def split_output_rows(weight: Weight, slices: int) -> Weight:
    """[N, K] -> [slices, N/slices, K]: a dense projection's output rows cut into expert slices."""
    if isinstance(weight, np.ndarray):
        return weight.reshape(slices, weight.shape[0] // slices, *weight.shape[1:])
    return weight.map_blocks(lambda a: a.reshape(slices, a.shape[0] // slices, *a.shape[1:]))


def split_input_columns(weight: Weight, slices: int) -> Weight:
    """[N, K] -> [slices, N, K/slices]: a down projection cut along its input, one piece per slice."""
    if isinstance(weight, np.ndarray):
        n, k = weight.shape
        return np.ascontiguousarray(weight.reshape(n, slices, k // slices).transpose(1, 0, 2))
    if weight.fmt not in ("int4", "u4", "u8"):
        raise ValueError(f"cannot cut {weight.fmt} weights along their input")
    groups = weight.values.shape[-2]
    if groups % slices:
        raise ValueError(f"{groups} groups of {INT4_GROUP} inputs do not split into {slices} slices")

    def cut(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(a.shape[0], slices, groups // slices, a.shape[-1]).transpose(1, 0, 2, 3))

    return weight.map_blocks(cut)


def expert_slice(weight: Weight, expert: int) -> Weight:
    """[E, N, K] -> [N, K]: one expert's weight out of its bank, stored as the bank is."""
    if isinstance(weight, np.ndarray):
        return weight[expert]
    return weight.map_blocks(lambda a: a[expert])


def join_output_rows(weight: Weight) -> Weight:
    """[slices, N/slices, K] -> [N, K]: undo `split_output_rows`."""
    if isinstance(weight, np.ndarray):
        return weight.reshape(-1, *weight.shape[2:])
    return weight.map_blocks(lambda a: a.reshape(-1, *a.shape[2:]))


def stack_output_rows(weights: list[Weight]) -> Weight | None:
    """[N1, K], [N2, K], ... -> [N1 + N2 + ..., K], when every weight is stored alike (else None).

    One matmul over the stacked rows computes what the separate matmuls would, row for row.
    """
    first = weights[0]
    if len(weights) == 1:
        return first
    if all(isinstance(w, np.ndarray) for w in weights):
        if len({(w.dtype, w.shape[1:]) for w in weights}) != 1:  # type: ignore[union-attr]
            return None
        return np.concatenate(weights, axis=0)  # type: ignore[arg-type]
    if not all(
        isinstance(w, Quantized) and (w.fmt, w.packed, w.values.ndim) == (first.fmt, first.packed, first.values.ndim)
        for w in weights
    ):
        return None
    quantized: list[Quantized] = weights  # type: ignore[assignment]
    if len({w.values.shape[1:] for w in quantized}) != 1:
        return None

    def stacked(arrays: list[np.ndarray | None]) -> np.ndarray | None:
        return None if arrays[0] is None else np.concatenate(arrays, axis=0)  # type: ignore[arg-type]

    return Quantized(
        first.fmt,
        np.concatenate([w.values for w in quantized], axis=0),
        stacked([w.scale for w in quantized]),
        stacked([w.zero_point for w in quantized]),
        first.packed,
    )


def join_input_columns(weight: Weight) -> Weight:
    """[slices, N, K/slices] -> [N, K]: undo `split_input_columns`.

    int8 slices join only when each row has one scale across them (else a ValueError)."""

    def join(a: np.ndarray) -> np.ndarray:
        moved = np.ascontiguousarray(np.moveaxis(a, 0, 1))  # [N, slices, ...]
        if isinstance(weight, np.ndarray) or weight.fmt in ("f32", "f16", "int8"):
            return moved.reshape(moved.shape[0], -1)
        return moved.reshape(moved.shape[0], -1, moved.shape[-1])

    if isinstance(weight, np.ndarray):
        return join(weight)
    if weight.fmt in ("f32", "f16"):
        return Quantized(weight.fmt, join(weight.values), None)
    if weight.fmt == "int8":
        scale = weight.scale
        if scale is None or not np.array_equal(scale, np.broadcast_to(scale[:1], scale.shape)):
            raise ValueError("int8 slices with scales of their own cannot run as one joined projection")
        return Quantized("int8", join(weight.values), scale[0])
    return weight.map_blocks(join)


def expert_range(weight: Weight, start: int, stop: int | None) -> Weight:
    """[E, N, K] -> experts [start, stop) of the bank, stored as the bank is."""
    if isinstance(weight, np.ndarray):
        return weight[start:stop]
    return weight.map_blocks(lambda a: a[start:stop])


def scaled_by_power_of_two(weight: Weight, factor: float) -> Weight:
    """`weight` times a power of two, stored as it is (a quantised weight's scales carry the factor,
    which is exact for them as it is for the values the graph would otherwise quantise)."""
    if isinstance(weight, np.ndarray):
        return as_float(weight) * np.float32(factor)
    if weight.fmt in ("f32", "f16"):
        return Quantized(weight.fmt, (weight.values * weight.values.dtype.type(factor)), None)
    assert weight.scale is not None
    return Quantized(
        weight.fmt, weight.values, weight.scale * weight.scale.dtype.type(factor), weight.zero_point, weight.packed
    )


def as_float(weight: Weight) -> np.ndarray:
    return weight if isinstance(weight, np.ndarray) else dequantize(weight)
