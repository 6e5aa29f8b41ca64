"""Read a GGUF file: Llama-family metadata, tensors kept in their quantised blocks, tokenizer, chat template.

The header is parsed here (with the `gguf` package's type tables) and tensors stay memory-mapped. A
Q4_1 or Q8_0 tensor becomes an asymmetric block weight (u4 or u8 values, f16 scales, unsigned zero
points, groups of 32) that OpenVINO's compressed-weight kernels run directly, so a shard's resident
memory stays near the file's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from cascadia.model.formats import INT4_GROUP, Quantized, Weight

SUPPORTED_ARCHITECTURES = ("llama",)
# BPE pre-tokenizers we can express with the `tokenizers` library, by GGUF's `tokenizer.ggml.pre`
_DIGIT_SPLITTING_PRE = ("smollm",)
_PLAIN_BYTE_LEVEL_PRE = ("gpt2", "default")


class GgufError(ValueError):
    """A GGUF file that cannot be read, or holds an architecture, tensor type or tokenizer we do not serve."""


def _round_half_away(x: np.ndarray) -> np.ndarray:
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def q4_1_blocks(raw: np.ndarray, rows: int, cols: int) -> Quantized:
    """Q4_1: per 32 weights an f16 scale d, an f16 minimum m and 32 nibbles; weight = d * q + m.

    OpenVINO's compressed-weight kernels take an unsigned zero point, so the minimum becomes the
    integer round(-m / d) (rounded half away from zero, as OpenVINO GenAI's reader does); the
    weight served is d * (q - round(-m / d)).
    """
    blocks = raw.reshape(rows, cols // INT4_GROUP, 20)
    scale = blocks[..., 0:2].copy().view(np.float16)
    minimum = blocks[..., 2:4].copy().view(np.float16)
    packed = blocks[..., 4:20]
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.uint8)
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = _round_half_away(-minimum.astype(np.float32) / scale.astype(np.float32))
    zero = (np.nan_to_num(zero, nan=0.0, posinf=0.0, neginf=0.0).astype(np.int64) & 0x0F).astype(np.uint8)
    return Quantized("u4", values, scale, zero)


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> Quantized:
    """Q8_0: per 32 weights an f16 scale d and 32 signed bytes; stored as u8 with zero point 128."""
    blocks = raw.reshape(rows, cols // INT4_GROUP, 34)
    scale = blocks[..., 0:2].copy().view(np.float16)
    values = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Quantized("u8", values, scale, np.full(scale.shape, 128, dtype=np.uint8))


@dataclass(frozen=True)
class GgufTensor:
    name: str
    kind: str  # F32, F16, Q4_1, Q8_0, ...
    shape: tuple[int, ...]  # rows first, as numpy and PyTorch order it
    raw: np.ndarray  # the tensor's bytes, memory-mapped


_SCALARS = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


class _Cursor:
    """Sequential reads over the memory-mapped header.

    The `gguf` package's reader builds a numpy view per array element, which takes seconds for a
    tokenizer's hundred thousand strings; this reads the same layout in one pass.
    """

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.at = 0

    def scalar(self, dtype: str) -> Any:
        size = np.dtype(dtype).itemsize
        value = self.data[self.at : self.at + size].view(dtype)[0]
        self.at += size
        return value.item()

    def string(self) -> str:
        n = self.scalar("<u8")
        text = bytes(self.data[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int) -> Any:
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            inner, count = GGUFValueType(self.scalar("<u4")), self.scalar("<u8")
            if inner in _SCALARS:
                size = np.dtype(_SCALARS[inner]).itemsize
                values = self.data[self.at : self.at + size * count].view(_SCALARS[inner]).tolist()
                self.at += size * count
                return [bool(v) for v in values] if inner == GGUFValueType.BOOL else values
            return [self.value(inner) for _ in range(count)]
        value = self.scalar(_SCALARS[kind])
        return bool(value) if kind == GGUFValueType.BOOL else value


class GgufFile:
    """Metadata and tensors of one GGUF file (memory-mapped; tensors decoded on request)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GgufError(f"{self.path}: no such GGUF file")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            self.metadata, self._tensors = self._read_header()
        except (ValueError, OSError, IndexError, UnicodeDecodeError) as exc:
            raise GgufError(f"{self.path}: not a readable GGUF file ({exc})") from exc

    def _read_header(self) -> tuple[dict[str, Any], dict[str, GgufTensor]]:
        cur = _Cursor(self._map)
        if bytes(self._map[:4]) != b"GGUF":
            raise ValueError("bad magic")
        cur.at = 4
        version = cur.scalar("<u4")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = cur.scalar("<u8"), cur.scalar("<u8")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<u4"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<u8") for _ in range(cur.scalar("<u4"))]
            infos.append((name, dims, GGMLQuantizationType(cur.scalar("<u4")), cur.scalar("<u8")))
        alignment = int(meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        start = -(-cur.at // alignment) * alignment
        tensors = {}
        for name, dims, kind, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            nbytes = int(np.prod(dims)) // block * block_bytes
            raw = self._map[start + offset : start + offset + nbytes]
            # GGUF lists dimensions innermost first
            shape = tuple(int(d) for d in reversed(dims))
            tensors[name] = GgufTensor(name, kind.name, shape, raw)
        return meta, tensors

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GgufError(
                f"{self.path}: architecture '{arch}' is not served (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return arch

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> GgufTensor:
        if name not in self._tensors:
            raise GgufError(f"{self.path}: missing tensor '{name}'")
        return self._tensors[name]

    def weight(self, name: str, shape: tuple[int, ...]) -> Weight:
        """A tensor of the expected [rows, cols] shape: f32 for float types, blocks for Q4_1 / Q8_0."""
        t = self.tensor(name)
        if t.shape != tuple(shape):
            raise GgufError(f"{self.path}: tensor '{name}' has shape {t.shape}, expected {tuple(shape)}")
        if t.kind in ("F32", "F16", "BF16"):
            if t.kind == "BF16":
                bits = t.raw.view(np.uint16).astype(np.uint32) << 16
                return bits.view(np.float32).reshape(shape)
            return t.raw.view(np.float32 if t.kind == "F32" else np.float16).astype(np.float32).reshape(shape)
        if len(shape) != 2 or shape[1] % INT4_GROUP:
            raise GgufError(f"{self.path}: tensor '{name}' of type {t.kind} needs rows of whole 32-blocks")
        if t.kind == "Q4_1":
            return q4_1_blocks(np.asarray(t.raw), *shape)
        if t.kind == "Q8_0":
            return q8_0_blocks(np.asarray(t.raw), *shape)
        raise GgufError(f"{self.path}: tensor '{name}' has type {t.kind}; served types are F32, F16, BF16, Q4_1, Q8_0")

    # -- text ------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    def token(self, key: str) -> str | None:
        index = self.metadata.get(f"tokenizer.ggml.{key}_token_id")
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    def tokenizer_json(self) -> str:
        """The file's tokenizer as a `tokenizers` JSON document (byte-level BPE)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from tokenizers.tokenizers import AddedToken

        meta = self.metadata
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GgufError(f"{self.path}: tokenizer model '{kind}' is not served (only byte-level BPE, 'gpt2')")
        pre = meta.get("tokenizer.ggml.pre", "default")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _DIGIT_SPLITTING_PRE:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif pre in _PLAIN_BYTE_LEVEL_PRE:
            tokenizer.pre_tokenizer = byte_level
        else:
            raise GgufError(f"{self.path}: pre-tokenizer '{pre}' is not served")
        tokenizer.decoder = decoders.ByteLevel()
        types = list(meta.get("tokenizer.ggml.token_type", []))
        control = [tokens[i] for i, t in enumerate(types) if t in (3, 4)]  # control and user-defined tokens
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        return tokenizer.to_str()

    def tokenizer_config(self) -> dict[str, Any]:
        """What a tokenizer_config.json would say: special tokens, whether BOS is added, the template."""
        meta = self.metadata
        return {
            "bos_token": self.token("bos"),
            "eos_token": self.token("eos"),
            "pad_token": self.token("padding"),
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "chat_template": self.chat_template,
        }
