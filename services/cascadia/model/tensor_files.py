"""safetensors files read through a file mapping, tensor by tensor, in the dtypes real checkpoints ship.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the data. Reading it through `np.memmap` gives views of the file: a tensor (or
one expert of a bank) costs memory only while it is decoded, and the pages it maps are the system's
to drop. The `safetensors` package's numpy reader has no bf16, the dtype real checkpoints ship in.

Decoding to f32 is exact for every dtype accepted here: bf16 is the top half of an f32, f16 and
FP8 E4M3 values are all representable in f32. FP8 weights carry their scales in companion tensors
(`<name>_scale_inv` per block, as DeepSeek-style FP8 checkpoints, or `<name>_scale` per output row,
as per-channel FP8 checkpoints); the dequantised value is the FP8 value times its scale, one f32
multiplication, which is what the format defines.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FLOAT_DTYPES = ("F32", "F16", "BF16")
FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIXES = ("_scale_inv", "_scale")
ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2, FP8_DTYPE: 1, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}
DEFAULT_FP8_BLOCK = (128, 128)


class TensorFileError(ValueError):
    """A file that is not a readable safetensors file, or a tensor it cannot give as f32."""


def _e4m3_table() -> np.ndarray:
    """The f32 value of each of the 256 FP8 E4M3 (fn: no infinities) bit patterns."""
    bits = np.arange(256, dtype=np.uint32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent.astype(np.float64) - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(bits & 0x7F) == 0x7F] = np.nan  # S.1111.111 is NaN in the fn variant
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets in the data section
    end: int


class TensorFile:
    """One safetensors file, mapped; `raw` gives a tensor's stored values as a view of the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise TensorFileError(f"{self.path}: not a safetensors file ({size} bytes, no header)")
            (length,) = struct.unpack("<Q", head)
            if 8 + length > size:
                raise TensorFileError(f"{self.path}: truncated: its header says {length} bytes, the file has {size}")
            try:
                header = json.loads(handle.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise TensorFileError(f"{self.path}: unreadable header ({exc})") from None
        self._data_start = 8 + length
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, TensorInfo] = {}
        data_size = size - self._data_start
        for name, entry in header.items():
            try:
                info = TensorInfo(str(entry["dtype"]), tuple(int(d) for d in entry["shape"]), *entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise TensorFileError(f"{self.path}: malformed header entry for '{name}'") from None
            if info.end > data_size:
                raise TensorFileError(
                    f"{self.path}: truncated: tensor '{name}' ends at byte {info.end} of the data, "
                    f"the file holds {data_size}"
                )
            item = ITEM_BYTES.get(info.dtype)
            if item is not None and info.end - info.start != item * math.prod(info.shape):
                raise TensorFileError(f"{self.path}: tensor '{name}' has {info.end - info.start} bytes for its shape")
            self.tensors[name] = info
        self._map: mmap.mmap | None = None
        self._bytes: np.ndarray | None = None

    def _mapped(self) -> np.ndarray:
        if self._bytes is None:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        return self._bytes

    def drop(self, view: np.ndarray) -> None:
        """Let the process's resident set forget the pages under `view` (a part of `raw`), once decoded:
        they stay in the page cache, but a bank read expert by expert no longer keeps every page it read
        mapped in the process until the file is closed."""
        if self._map is None or self._bytes is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = view.__array_interface__["data"][0] - self._bytes.__array_interface__["data"][0]
        end = start + view.nbytes if view.flags.c_contiguous else self._bytes.size
        first = start - start % mmap.PAGESIZE
        last = min(self._bytes.size, end + (-end % mmap.PAGESIZE))
        if 0 <= first < last:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored values, viewing the mapped file (no copy): bf16 as uint16, FP8 as uint8."""
        info = self.tensors[name]
        view = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, FP8_DTYPE: np.uint8}.get(info.dtype)
        if view is None:
            raise TensorFileError(
                f"{self.path}: tensor '{name}' is {info.dtype}; weights must be one of "
                f"{', '.join((*FLOAT_DTYPES, FP8_DTYPE))}"
            )
        data = self._mapped()[self._data_start + info.start : self._data_start + info.end]
        return data.view(view).reshape(info.shape)

    def close(self) -> None:
        self._bytes = None
        self._map = None  # closed when the last view of it goes


def to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values (as `TensorFile.raw` gives them) as f32, exactly; a fresh array, never a view of the file."""
    if dtype == "F32":
        return np.array(raw, dtype=np.float32)
    if dtype == "F16":
        return raw.astype(np.float32)
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == FP8_DTYPE:
        return E4M3_VALUES[raw]
    raise TensorFileError(f"cannot read dtype {dtype}")


def apply_fp8_scale(values: np.ndarray, scale: np.ndarray, block: tuple[int, int], name: str) -> np.ndarray:
    """FP8 values [..., N, K] times their scales: per row ([..., N] or [..., N, 1]) or per block
    ([..., ceil(N/bn), ceil(K/bk)]), in place."""
    n, k = values.shape[-2:]
    lead = values.shape[:-2]
    if scale.shape in ((*lead, n), (*lead, n, 1)):
        values *= scale.reshape(*lead, n, 1)
        return values
    bn, bk = block
    if scale.shape != (*lead, -(-n // bn), -(-k // bk)):
        raise TensorFileError(
            f"tensor '{name}': scale of shape {scale.shape} fits neither rows {(*lead, n)} nor blocks of "
            f"{bn}x{bk} ({(*lead, -(-n // bn), -(-k // bk))})"
        )
    expanded = np.repeat(np.repeat(scale, bn, axis=-2)[..., :n, :], bk, axis=-1)[..., :k]
    values *= expanded
    return values


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """f32 values rounded to the nearest bf16 (ties to even), as the uint16 a bf16 file stores."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    return (rounded >> 16).astype(np.uint16)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # F32, F16, BF16 or F8_E4M3
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return ITEM_BYTES[self.dtype] * math.prod(self.shape)


def stored_values(values: np.ndarray, dtype: str) -> np.ndarray:
    """f32 values (or FP8 codes as uint8) as the bytes a file of `dtype` stores."""
    if dtype == "F32":
        return np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "F16":
        return np.ascontiguousarray(values, dtype=np.float16)
    if dtype == "BF16":
        return bf16_bits(values)
    if dtype == FP8_DTYPE:
        return np.ascontiguousarray(values, dtype=np.uint8)
    raise TensorFileError(f"cannot write dtype {dtype}")


def write_streamed(path: Path, tensors: list[PlannedTensor], chunks, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file whose tensors are produced piece by piece: `chunks(tensor)` yields
    consecutive pieces of it along its first axis (f32 values, or FP8 codes), so no tensor need be
    whole in memory. The header is written first, from the planned shapes."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for t in tensors:
            written = 0
            for piece in chunks(t):
                data = stored_values(piece, t.dtype)
                out.write(data.tobytes())
                written += data.nbytes
            if written != t.nbytes:
                raise TensorFileError(f"{path}: tensor '{t.name}' got {written} bytes, planned {t.nbytes}")
