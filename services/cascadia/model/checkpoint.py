"""Read Inkling weights for one contiguous layer range from a safetensors checkpoint.

Two layouts are understood: what `InklingForCausalLM.save_pretrained` writes (`model.layers.*`,
`lm_head`), and the published one (`model.llm.*`, gate/up fused as `w13` with interleaved rows).
Files are opened memory-mapped and only the tensors of the requested range are read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cascadia.model.config import ModelShape, load_shape
from cascadia.model.formats import (
    INT4_GROUP,
    Quantized,
    Weight,
    WeightFormat,
    join_input_columns,
    pack_nibbles,
    quantize,
)
from cascadia.model.tensor_files import (
    DEFAULT_FP8_BLOCK,
    FP8_DTYPE,
    SCALE_SUFFIXES,
    TensorFile,
    TensorFileError,
    TensorInfo,
    apply_fp8_scale,
    to_f32,
)


class CheckpointError(ValueError):
    """A checkpoint that lacks a tensor, holds one of the wrong shape, or cannot be read."""


@dataclass(frozen=True)
class AttentionWeights:
    input_norm: np.ndarray  # [H]
    q_proj: np.ndarray  # [Hq*D, H]
    k_proj: np.ndarray  # [Hkv*D, H]
    v_proj: np.ndarray  # [Hkv*D, H]
    r_proj: np.ndarray  # [Hq*d_rel, H]
    o_proj: np.ndarray  # [H, Hq*D]
    q_norm: np.ndarray  # [D]
    k_norm: np.ndarray  # [D]
    k_conv: np.ndarray  # [Hkv*D, K]
    v_conv: np.ndarray  # [Hkv*D, K]
    rel_proj: np.ndarray  # [d_rel, rel_extent]
    attn_conv: np.ndarray  # [H, K]


@dataclass(frozen=True)
class ExpertWeights:
    """Every expert a layer can run, routed first, shared last (dense MLPs as slices).

    E = experts in the bank, I = width of one expert, H = hidden size. Weights read from a GGUF
    file stay in their quantised blocks.
    """

    gate: Weight  # [E, I, H]
    up: Weight  # [E, I, H]
    down: Weight  # [E, H, I]


@dataclass(frozen=True)
class RouterWeights:
    weight: np.ndarray  # [routed + shared, H]
    correction_bias: np.ndarray  # [routed]
    global_scale: float


@dataclass(frozen=True)
class LayerWeights:
    index: int
    attention: AttentionWeights
    post_attention_norm: np.ndarray  # [H]
    mlp_conv: np.ndarray  # [H, K]
    experts: ExpertWeights
    router: RouterWeights | None  # None for dense layers
    dense_scale: float  # dense layers' global_scale; 1.0 for MoE layers


@dataclass(frozen=True)
class StageWeights:
    shape: ModelShape
    start_layer: int
    end_layer: int  # half-open
    layers: tuple[LayerWeights, ...]
    embed: Weight | None  # [V, H] on the first stage
    embed_norm: np.ndarray | None  # None where the model does not norm its embeddings
    final_norm: np.ndarray | None  # on the last stage
    head: Weight | None  # [V, H]


DENSE_SLICES = 8


def _deinterleave(tensor: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows g0, u0, g1, u1, ... along `axis` -> (gate rows, up rows)."""
    index = [slice(None)] * tensor.ndim
    index[axis] = slice(0, None, 2)
    gate = tensor[tuple(index)]
    index[axis] = slice(1, None, 2)
    return np.ascontiguousarray(gate), np.ascontiguousarray(tensor[tuple(index)])


class TensorSource:
    """Name -> f32 tensor across the checkpoint's safetensors files, read through file mappings.

    Files are listed by `model.safetensors.index.json` when there is one, else every `*.safetensors`
    in the directory. `get` decodes a whole tensor, `get_one` one entry along its first axis (an
    expert of a bank), so a bank is never all in f32 at once.
    """

    def __init__(self, model_dir: Path, stack: ExitStack | None = None) -> None:
        self._dir = Path(model_dir)
        index_path = self._dir / "model.safetensors.index.json"
        self._files: dict[str, TensorFile] = {}
        self._where: dict[str, str] = {}
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_path}: not a safetensors index ({exc})") from None
            file_names = sorted(set(weight_map.values()))
        else:
            file_names = sorted(p.name for p in self._dir.glob("*.safetensors"))
            weight_map = None
        if not file_names:
            raise CheckpointError(f"{self._dir}: no .safetensors files")
        for name in file_names:
            path = self._dir / name
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in the index but missing")
            try:
                handle = TensorFile(path)
            except TensorFileError as exc:
                raise CheckpointError(str(exc)) from None
            self._files[name] = handle
            if weight_map is None:
                for key in handle.tensors:
                    self._where[key] = name
        if weight_map is not None:
            for key, file_name in weight_map.items():
                if key not in self._files[file_name].tensors:
                    raise CheckpointError(f"{self._dir}: the index puts '{key}' in {file_name}, which does not hold it")
            self._where = dict(weight_map)
        self._fp8_block = _fp8_block(self._dir)
        if stack is not None:
            stack.callback(self.close)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> Iterator[str]:
        return iter(self._where)

    def dtype(self, name: str) -> str:
        return self._info(name).dtype

    def _info(self, name: str) -> TensorInfo:
        if name not in self._where:
            raise CheckpointError(f"{self._dir}: missing tensor '{name}'")
        return self._files[self._where[name]].tensors[name]

    def _raw(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
        info = self._info(name)
        if tuple(info.shape) != tuple(shape):
            raise CheckpointError(
                f"{self._dir}: tensor '{name}' has shape {tuple(info.shape)}, expected {tuple(shape)}"
            )
        try:
            return self._files[self._where[name]].raw(name), info.dtype
        except TensorFileError as exc:
            raise CheckpointError(str(exc)) from None

    def _scale_of(self, name: str) -> str:
        base = name[: -len("weight")] + "weight" if name.endswith(".weight") else name
        for suffix in SCALE_SUFFIXES:
            if base + suffix in self._where:
                return base + suffix
        raise CheckpointError(
            f"{self._dir}: FP8 tensor '{name}' has no scale ({' or '.join(base + s for s in SCALE_SUFFIXES)})"
        )

    def _decode(self, name: str, raw: np.ndarray, dtype: str, entry: int | None) -> np.ndarray:
        values = to_f32(raw, dtype)
        if dtype == FP8_DTYPE:
            scale_name = self._scale_of(name)
            scale_info = self._info(scale_name)
            scale_raw, scale_dtype = self._raw(scale_name, scale_info.shape)
            if scale_dtype == FP8_DTYPE:
                raise CheckpointError(f"{self._dir}: scale '{scale_name}' is FP8; scales must be f32, bf16 or f16")
            scale = to_f32(scale_raw if entry is None else scale_raw[entry], scale_dtype)
            try:
                apply_fp8_scale(values, scale, self._fp8_block, name)
            except TensorFileError as exc:
                raise CheckpointError(f"{self._dir}: {exc}") from None
        return values

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The whole tensor in f32, exactly as the checkpoint defines it."""
        raw, dtype = self._raw(name, shape)
        values = self._decode(name, raw, dtype, None)
        self._files[self._where[name]].drop(raw)
        return values

    def get_one(self, name: str, shape: tuple[int, ...], entry: int) -> np.ndarray:
        """Entry `entry` along the first axis of a tensor of `shape` (one expert of a bank) in f32."""
        raw, dtype = self._raw(name, shape)
        values = self._decode(name, raw[entry], dtype, entry)
        self._files[self._where[name]].drop(raw[entry])
        return values

    def get_block(self, name: str, shape: tuple[int, int], rows: slice, cols: slice = slice(None)) -> np.ndarray:
        """Rows and columns of a 2-D tensor in f32 (a dense projection's slice, or a chunk of rows)."""
        raw, dtype = self._raw(name, shape)
        part = raw[rows, cols]
        values = to_f32(part, dtype)
        if cols == slice(None):
            self._files[self._where[name]].drop(part)
        if dtype != FP8_DTYPE:
            return values
        scale_name = self._scale_of(name)
        scale_raw, scale_dtype = self._raw(scale_name, self._info(scale_name).shape)
        scale = to_f32(scale_raw, scale_dtype)
        r0, r1, _ = rows.indices(shape[0])
        c0, c1, _ = cols.indices(shape[1])
        if scale.shape in ((shape[0],), (shape[0], 1)):
            scale = scale.reshape(shape[0], 1)[r0:r1]
        else:
            bn, bk = self._fp8_block
            if r0 % bn or c0 % bk:
                raise CheckpointError(
                    f"{self._dir}: '{name}' read from row {r0}, column {c0}: not on its {bn}x{bk} scale blocks"
                )
            scale = scale[r0 // bn : -(-r1 // bn), c0 // bk : -(-c1 // bk)]
        try:
            return apply_fp8_scale(values, scale, self._fp8_block, name)
        except TensorFileError as exc:
            raise CheckpointError(f"{self._dir}: {exc}") from None

    def source_digest(self, names: Iterator[str] | list[str]) -> str:
        """A digest of the named tensors' headers (name, dtype, shape, file, size and mtime of the file)."""
        hasher = hashlib.sha256()
        for name in sorted(names):
            info = self._info(name)
            stat = self._files[self._where[name]].path.stat()
            hasher.update(
                f"{name}|{info.dtype}|{info.shape}|{self._where[name]}|{stat.st_size}|{stat.st_mtime_ns}\n".encode()
            )
        return hasher.hexdigest()

    def nbytes(self, name: str) -> int:
        info = self._info(name)
        return info.end - info.start

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name).shape)

    def scalar(self, name: str) -> float:
        return float(self.get(name, (1,))[0])


def _fp8_block(model_dir: Path) -> tuple[int, int]:
    """The FP8 scale blocks the config names (`quantization_config.weight_block_size`), else 128x128."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return DEFAULT_FP8_BLOCK
    for holder in (config, config.get("text_config") or {}):
        block = (holder.get("quantization_config") or {}).get("weight_block_size")
        if block:
            return int(block[0]), int(block[1])
    return DEFAULT_FP8_BLOCK


def _conv(source: TensorSource, name: str, channels: int, kernel: int) -> np.ndarray:
    return source.get(name, (channels, 1, kernel))[:, 0, :]


@dataclass(frozen=True)
class StoredForms:
    """The formats a stage's graphs store their weights in, so that weights are quantised as they
    are read, one tensor (one expert, one slice) at a time, to exactly what the graph would hold.

    `joined_down`: dense FFNs and shared experts run as plain matmuls over their joined slices, so
    an int8 down projection has one scale per row of the whole projection, not one per slice.
    """

    experts: WeightFormat = "f32"
    attention: WeightFormat = "f32"
    head: WeightFormat = "f32"
    joined_down: bool = True


F32_FORMS = StoredForms()
ROW_CHUNK = 4096  # rows of an embedding or head read at a time
PROGRESS_EXPERTS = 32  # a line of progress every this many experts of a bank


PackedAllocator = Callable[[tuple[int, ...]], np.ndarray]


class _Store:
    """A weight of [entries, N, K] (or [N, K] with entries None) filled entry by entry in `fmt`.

    `allocate` gives the memory of packed int4 values (so that the graph's constant can share it)."""

    def __init__(
        self, fmt: WeightFormat, entries: int | None, n: int, k: int, allocate: PackedAllocator | None = None
    ) -> None:
        self.fmt = fmt
        lead = () if entries is None else (entries,)
        self.scale: np.ndarray | None = None
        if fmt == "f32":
            self.values = np.empty((*lead, n, k), np.float32)
        elif fmt == "f16":
            self.values = np.empty((*lead, n, k), np.float16)
        elif fmt == "int8":
            self.values = np.empty((*lead, n, k), np.int8)
            self.scale = np.empty((*lead, n, 1), np.float32)
        else:
            if k % INT4_GROUP:
                raise CheckpointError(f"int4 needs an input dimension divisible by {INT4_GROUP}, got {k}")
            packed_shape = (*lead, n, k // INT4_GROUP, INT4_GROUP // 2)
            self.values = allocate(packed_shape) if allocate else np.empty(packed_shape, np.uint8)
            self.scale = np.empty((*lead, n, k // INT4_GROUP, 1), np.float16)

    def put(self, where: int | slice | tuple, weight: np.ndarray) -> None:
        """Quantise `weight` (f32) into entry or rows `where`."""
        self.put_quantized(where, quantize(weight, self.fmt))

    def put_quantized(self, where: int | slice | tuple, q: Quantized) -> None:
        self.values[where] = pack_nibbles(q.values) if self.fmt == "int4" else q.values
        if self.scale is not None:
            self.scale[where] = q.scale

    def result(self) -> Weight:
        if self.fmt == "f32":
            return self.values
        return Quantized(self.fmt, self.values, self.scale, packed=self.fmt == "int4")


def _stored_whole(
    source: TensorSource, name: str, shape: tuple[int, int], fmt: WeightFormat, allocate: PackedAllocator | None = None
) -> Weight:
    """A 2-D weight read in chunks of rows and stored in `fmt` (rows quantise independently)."""
    if fmt == "f32":
        return source.get(name, shape)
    store = _Store(fmt, None, *shape, allocate)
    for start in range(0, shape[0], ROW_CHUNK):
        rows = slice(start, min(start + ROW_CHUNK, shape[0]))
        store.put(rows, source.get_block(name, shape, rows))
    return store.result()


def _dense_bank(
    source: TensorSource,
    names: tuple[str, ...],
    published: bool,
    width: int,
    h: int,
    forms: StoredForms,
    allocate: PackedAllocator | None = None,
) -> ExpertWeights:
    """A dense MLP as DENSE_SLICES all-active expert slices, read slice by slice."""
    piece = width // DENSE_SLICES
    fmt = forms.experts
    gate, up, down = (_Store(fmt, DENSE_SLICES, *dims, allocate) for dims in ((piece, h), (piece, h), (h, piece)))
    for j in range(DENSE_SLICES):
        rows = slice(j * piece, (j + 1) * piece)
        if published:
            pair = source.get_block(names[0], (2 * width, h), slice(2 * j * piece, 2 * (j + 1) * piece))
            g, u = _deinterleave(pair, axis=0)
        else:
            g = source.get_block(names[0], (width, h), rows)
            u = source.get_block(names[1], (width, h), rows)
        gate.put(j, g)
        up.put(j, u)
        del g, u
    down_name = names[-1]
    if fmt == "int8" and forms.joined_down:
        # one scale per row of the whole projection, as the joined matmul quantises it
        for start in range(0, h, ROW_CHUNK // 4):
            rows = slice(start, min(start + ROW_CHUNK // 4, h))
            q = quantize(source.get_block(down_name, (h, width), rows), fmt)
            for j in range(DENSE_SLICES):
                down.values[j, rows] = q.values[:, j * piece : (j + 1) * piece]
                down.scale[j, rows] = q.scale  # type: ignore[index]
    else:
        for j in range(DENSE_SLICES):
            down.put(j, source.get_block(down_name, (h, width), slice(None), slice(j * piece, (j + 1) * piece)))
    return ExpertWeights(gate.result(), up.result(), down.result())


def _moe_bank(
    source: TensorSource,
    m: str,
    shape: ModelShape,
    published: bool,
    forms: StoredForms,
    allocate: PackedAllocator | None = None,
    progress: Callable[[str], None] | None = None,
) -> ExpertWeights:
    """Routed experts then shared ones, read one expert at a time."""
    e, s, w, h = shape.n_routed_experts, shape.n_shared_experts, shape.moe_intermediate_size, shape.hidden_size
    fmt = forms.experts
    gate, up, down = (_Store(fmt, e + s, *dims, allocate) for dims in ((w, h), (w, h), (h, w)))
    if published:
        gate_up_name, down_name = m + "experts.w13_weight", m + "experts.w2_weight"
    else:
        gate_up_name, down_name = m + "experts.gate_up_proj", m + "experts.down_proj"
    for j in range(e):
        pair = source.get_one(gate_up_name, (e, 2 * w, h), j)
        g, u = _deinterleave(pair, axis=0) if published else (pair[:w], pair[w:])
        gate.put(j, g)
        up.put(j, u)
        down.put(j, source.get_one(down_name, (e, h, w), j))
        del pair, g, u
        if progress is not None and (j + 1) % PROGRESS_EXPERTS == 0 and j + 1 < e:
            progress(f"{m}experts: {j + 1}/{e} read")
    for j in range(s):
        if published:
            pair = source.get_one(m + "shared_experts.shared_w13_weight", (s, 2 * w, h), j)
            g, u = _deinterleave(pair, axis=0)
        else:
            g = source.get_one(m + "shared_experts.gate_proj", (s, w, h), j)
            u = source.get_one(m + "shared_experts.up_proj", (s, w, h), j)
        gate.put(e + j, g)
        up.put(e + j, u)
    shared_down = m + ("shared_experts.shared_w2_weight" if published else "shared_experts.down_proj")
    if s and fmt == "int8" and forms.joined_down:
        # the shared experts' down projections run joined: one scale per row across all of them
        q = quantize(join_input_columns(source.get(shared_down, (s, h, w))), fmt)
        for j in range(s):
            down.values[e + j] = q.values[:, j * w : (j + 1) * w]
            down.scale[e + j] = q.scale  # type: ignore[index]
    else:
        for j in range(s):
            down.put(e + j, source.get_one(shared_down, (s, h, w), j))
    return ExpertWeights(gate.result(), up.result(), down.result())


def _read_layer(
    source: TensorSource,
    shape: ModelShape,
    i: int,
    prefix: str | None = None,
    forms: StoredForms = F32_FORMS,
    allocate: PackedAllocator | None = None,
    progress: Callable[[str], None] | None = None,
) -> LayerWeights:
    h = shape.hidden_size
    k = shape.conv_kernel_size
    a = shape.layer_attention(i)
    published = shape.layout == "published"
    p = prefix or (f"model.llm.layers.{i}." if published else f"model.layers.{i}.")
    attn = p + ("attn." if published else "self_attn.")

    def proj(short: str, long: str, rows: int, cols: int) -> Weight:
        name = attn + (f"{short}.weight" if published else f"{long}.weight")
        return _stored_whole(source, name, (rows, cols), forms.attention, allocate)

    attention = AttentionWeights(
        input_norm=source.get(p + ("attn_norm.weight" if published else "input_layernorm.weight"), (h,)),
        q_proj=proj("wq_du", "q_proj", a.q_width, h),
        k_proj=proj("wk_dv", "k_proj", a.kv_width, h),
        v_proj=proj("wv_dv", "v_proj", a.kv_width, h),
        r_proj=proj("wr_du", "r_proj", a.num_heads * shape.d_rel, h),
        o_proj=proj("wo_ud", "o_proj", h, a.q_width),
        q_norm=source.get(attn + "q_norm.weight", (a.head_dim,)),
        k_norm=source.get(attn + "k_norm.weight", (a.head_dim,)),
        k_conv=_conv(source, attn + ("k_sconv.weight" if published else "k_sconv.conv1d.weight"), a.kv_width, k),
        v_conv=_conv(source, attn + ("v_sconv.weight" if published else "v_sconv.conv1d.weight"), a.kv_width, k),
        rel_proj=source.get(attn + "rel_logits_proj.proj", (shape.d_rel, a.rel_extent)),
        attn_conv=_conv(source, p + ("attn_sconv.weight" if published else "attn_sconv.conv1d.weight"), h, k),
    )
    post_norm = source.get(p + ("mlp_norm.weight" if published else "post_attention_layernorm.weight"), (h,))
    mlp_conv = _conv(source, p + ("mlp_sconv.weight" if published else "mlp_sconv.conv1d.weight"), h, k)
    m = p + "mlp."
    if shape.is_dense(i):
        width = shape.intermediate_size
        if width % DENSE_SLICES:
            raise CheckpointError(f"layer {i}: dense width {width} is not divisible into {DENSE_SLICES} expert slices")
        names = (
            (m + "w13_dn.weight", m + "w2_md.weight")
            if published
            else (m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight")
        )
        experts = _dense_bank(source, names, published, width, h, forms, allocate)
        return LayerWeights(i, attention, post_norm, mlp_conv, experts, None, source.scalar(m + "global_scale"))

    e, s = shape.n_routed_experts, shape.n_shared_experts
    experts = _moe_bank(source, m, shape, published, forms, allocate, progress)
    router = RouterWeights(
        weight=source.get(m + "gate.weight", (e + s, h)),
        correction_bias=source.get(m + ("gate.bias" if published else "gate.e_score_correction_bias"), (e,)),
        global_scale=source.scalar(m + "gate.global_scale"),
    )
    return LayerWeights(i, attention, post_norm, mlp_conv, experts, router, 1.0)


@dataclass(frozen=True)
class MtpDepthWeights:
    hidden_norm: np.ndarray  # [H]
    embed_norm: np.ndarray  # [H]
    input_proj: np.ndarray  # [H, 2H]: columns of the previous hidden state first (or the embedding first)
    block: LayerWeights  # a dense decoder layer, index = depth


@dataclass(frozen=True)
class MtpWeights:
    """The multi-token-prediction head and what it shares with the trunk: embedding, final norm, head."""

    shape: ModelShape  # the depths as a decoder of their own (`ModelShape.mtp_block_shape`)
    depths: tuple[MtpDepthWeights, ...]
    embed: np.ndarray  # [V, H]
    embed_norm: np.ndarray  # the trunk's embedding norm
    final_norm: np.ndarray  # the trunk's final norm: depth 0 reads the normed trunk state
    head: np.ndarray  # [V or unpadded V, H]


def load_mtp(model_dir: Path, depths: int | None = None) -> MtpWeights:
    """Read the first `depths` MTP depths (default: all) with the tensors they share with the trunk."""
    shape = load_shape(model_dir)
    if not shape.mtp_depths:
        raise CheckpointError(f"{model_dir}: the checkpoint has no MTP head (no mtp_config.num_nextn_predict_layers)")
    depths = shape.mtp_depths if depths is None else depths
    if not 1 <= depths <= shape.mtp_depths:
        raise CheckpointError(f"{model_dir}: asked for {depths} MTP depths, the head has {shape.mtp_depths}")
    block_shape = shape.mtp_block_shape()
    h = shape.hidden_size
    with ExitStack() as stack:
        source = TensorSource(model_dir, stack)
        read = []
        for k in range(depths):
            p = f"model.mtp.layers.{k}."
            read.append(
                MtpDepthWeights(
                    hidden_norm=source.get(p + "hidden_norm.weight", (h,)),
                    embed_norm=source.get(p + "embed_norm.weight", (h,)),
                    input_proj=source.get(p + "input_proj.weight", (h, 2 * h)),
                    block=_read_layer(source, block_shape, k, p + "transformer_block."),
                )
            )
        trunk = load_stage_tensors(source, shape, first=True, last=True)
    return MtpWeights(block_shape, tuple(read), trunk[0], trunk[1], trunk[2], trunk[3])


def load_stage_tensors(
    source: TensorSource,
    shape: ModelShape,
    first: bool,
    last: bool,
    forms: StoredForms = F32_FORMS,
    allocate: PackedAllocator | None = None,
) -> tuple[Weight | None, np.ndarray | None, np.ndarray | None, Weight | None]:
    """(embedding, embedding norm) when `first`, (final norm, head) when `last`; the embedding and the
    head stored in the head's format, read in chunks of rows."""
    h, v = shape.hidden_size, shape.vocab_size
    published = shape.layout == "published"
    embed = embed_norm = final_norm = head = None
    if first:
        embed_name = "model.llm.embed.weight" if published else "model.embed_tokens.weight"
        embed = _stored_whole(source, embed_name, (v, h), forms.head, allocate)
        embed_norm = source.get(
            "model.llm.embed_norm.weight" if published else "model.embed_tokens.embed_norm.weight", (h,)
        )
    if last:
        final_norm = source.get("model.llm.norm.weight" if published else "model.norm.weight", (h,))
        head_name = "model.llm.unembed.weight" if published else "lm_head.weight"
        rows = v
        if published and source.has(head_name):
            # the published head may hold only the unpadded rows
            held = source.shape_of(head_name)
            if held == (shape.unpadded_vocab_size, h):
                rows = shape.unpadded_vocab_size
        head = _stored_whole(source, head_name, (rows, h), forms.head, allocate)
    return embed, embed_norm, final_norm, head


class StageReader:
    """The weights of layers [start, end) read when asked, one layer at a time, stored in `forms`.

    A stage is never all in memory in f32: each layer is read expert by expert into its stored
    formats when the engine builds its graph, and dropped once the graph holds it.
    """

    def __init__(
        self,
        model_dir: Path,
        start_layer: int,
        end_layer: int,
        forms: StoredForms = F32_FORMS,
        allocate: PackedAllocator | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """`allocate` gives the memory packed int4 weights are read into (see `_Store`); `progress` is told
        of an expert bank's reading every few experts."""
        self.model_dir = Path(model_dir)
        self._allocate, self._progress = allocate, progress
        self.shape = load_shape(model_dir)
        if not 0 <= start_layer < end_layer <= self.shape.num_layers:
            raise CheckpointError(
                f"layer range {start_layer}:{end_layer} is not inside the model's 0:{self.shape.num_layers}"
            )
        self.start_layer, self.end_layer, self.forms = start_layer, end_layer, forms
        self.is_first, self.is_last = start_layer == 0, end_layer == self.shape.num_layers
        self._last: LayerWeights | None = None
        TensorSource(self.model_dir).close()  # the files and the index are checked now, not at the first layer

    def layer(self, i: int) -> LayerWeights:
        """Layer `i`, read now; the layer read last is kept until another is asked for (or `release`)."""
        if self._last is not None and self._last.index == i:
            return self._last
        self._last = None
        source = TensorSource(self.model_dir)
        try:
            self._last = _read_layer(
                source, self.shape, i, forms=self.forms, allocate=self._allocate, progress=self._progress
            )
        finally:
            source.close()
        return self._last

    def release(self) -> None:
        self._last = None

    def ends(self) -> tuple[Weight | None, np.ndarray | None, np.ndarray | None, Weight | None]:
        """(embedding, embedding norm, final norm, head), each None where the stage does not hold it."""
        source = TensorSource(self.model_dir)
        try:
            return load_stage_tensors(source, self.shape, self.is_first, self.is_last, self.forms, self._allocate)
        finally:
            source.close()

    def weights(self) -> StageWeights:
        """Every layer of the range at once (for tests and tools that want them all)."""
        layers = tuple(self.layer(i) for i in range(self.start_layer, self.end_layer))
        embed, embed_norm, final_norm, head = self.ends()
        return StageWeights(self.shape, self.start_layer, self.end_layer, layers, embed, embed_norm, final_norm, head)


class HeldStage:
    """Weights already in memory, behind the interface of `StageReader`."""

    def __init__(self, weights: StageWeights) -> None:
        self._weights = weights
        self.shape, self.start_layer, self.end_layer = weights.shape, weights.start_layer, weights.end_layer
        # a stage embeds when it holds the embedding and runs the head when it holds the head, so a
        # one-layer stage without either serves as a middle stage (the MTP head's depths are)
        self.is_first, self.is_last = weights.embed is not None, weights.head is not None

    def layer(self, i: int) -> LayerWeights:
        return self._weights.layers[i - self.start_layer]

    def ends(self) -> tuple[Weight | None, np.ndarray | None, np.ndarray | None, Weight | None]:
        w = self._weights
        return w.embed, w.embed_norm, w.final_norm, w.head

    def weights(self) -> StageWeights:
        return self._weights

    def release(self) -> None:
        pass


def load_stage(model_dir: Path, start_layer: int, end_layer: int, forms: StoredForms = F32_FORMS) -> StageWeights:
    """Read layers [start_layer, end_layer), plus the embedding on the first stage and the head on the last."""
    return StageReader(model_dir, start_layer, end_layer, forms).weights()
