"""Read Inkling weights for one contiguous layer range from a safetensors checkpoint.

Two layouts are understood: what `InklingForCausalLM.save_pretrained` writes (`model.layers.*`,
`lm_head`), and the published one (`model.llm.*`, gate/up fused as `w13` with interleaved rows).
Files are opened memory-mapped and only the tensors of the requested range are read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from cascadia.model.config import ModelShape, load_shape
from cascadia.model.formats import Weight


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
    """Name -> tensor lookup across the checkpoint's safetensors files, memory-mapped."""

    def __init__(self, model_dir: Path, stack: ExitStack) -> None:
        self._dir = Path(model_dir)
        index_path = self._dir / "model.safetensors.index.json"
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text())["weight_map"]
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
            handle = stack.enter_context(safe_open(str(path), framework="numpy"))
            self._files[name] = handle
            if weight_map is None:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    self._where[key] = name
        if weight_map is not None:
            self._where = dict(weight_map)

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> Iterator[str]:
        return iter(self._where)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self._dir}: missing tensor '{name}'")
        tensor = self._files[self._where[name]].get_tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{self._dir}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
            )
        return np.asarray(tensor, dtype=np.float32)

    def scalar(self, name: str) -> float:
        return float(self.get(name, (1,))[0])


def _conv(source: TensorSource, name: str, channels: int, kernel: int) -> np.ndarray:
    return source.get(name, (channels, 1, kernel))[:, 0, :]


def _read_layer(source: TensorSource, shape: ModelShape, i: int, prefix: str | None = None) -> LayerWeights:
    h = shape.hidden_size
    k = shape.conv_kernel_size
    a = shape.layer_attention(i)
    published = shape.layout == "published"
    p = prefix or (f"model.llm.layers.{i}." if published else f"model.layers.{i}.")
    attn = p + ("attn." if published else "self_attn.")

    def proj(short: str, long: str, rows: int, cols: int) -> np.ndarray:
        return source.get(attn + (f"{short}.weight" if published else f"{long}.weight"), (rows, cols))

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
        if published:
            gate, up = _deinterleave(source.get(m + "w13_dn.weight", (2 * width, h)), axis=0)
            down = source.get(m + "w2_md.weight", (h, width))
        else:
            gate = source.get(m + "gate_proj.weight", (width, h))
            up = source.get(m + "up_proj.weight", (width, h))
            down = source.get(m + "down_proj.weight", (h, width))
        piece = width // DENSE_SLICES
        experts = ExpertWeights(
            gate=gate.reshape(DENSE_SLICES, piece, h),
            up=up.reshape(DENSE_SLICES, piece, h),
            down=np.ascontiguousarray(down.reshape(h, DENSE_SLICES, piece).transpose(1, 0, 2)),
        )
        return LayerWeights(i, attention, post_norm, mlp_conv, experts, None, source.scalar(m + "global_scale"))

    e, s, w = shape.n_routed_experts, shape.n_shared_experts, shape.moe_intermediate_size
    if published:
        gate, up = _deinterleave(source.get(m + "experts.w13_weight", (e, 2 * w, h)), axis=1)
        down = source.get(m + "experts.w2_weight", (e, h, w))
        s_gate, s_up = _deinterleave(source.get(m + "shared_experts.shared_w13_weight", (s, 2 * w, h)), axis=1)
        s_down = source.get(m + "shared_experts.shared_w2_weight", (s, h, w))
        bias_name = m + "gate.bias"
    else:
        gate_up = source.get(m + "experts.gate_up_proj", (e, 2 * w, h))
        gate, up = gate_up[:, :w], gate_up[:, w:]
        down = source.get(m + "experts.down_proj", (e, h, w))
        s_gate = source.get(m + "shared_experts.gate_proj", (s, w, h))
        s_up = source.get(m + "shared_experts.up_proj", (s, w, h))
        s_down = source.get(m + "shared_experts.down_proj", (s, h, w))
        bias_name = m + "gate.e_score_correction_bias"
    experts = ExpertWeights(
        gate=np.concatenate([gate, s_gate]),
        up=np.concatenate([up, s_up]),
        down=np.concatenate([down, s_down]),
    )
    router = RouterWeights(
        weight=source.get(m + "gate.weight", (e + s, h)),
        correction_bias=source.get(bias_name, (e,)),
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
    source: TensorSource, shape: ModelShape, first: bool, last: bool
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """(embedding, embedding norm) when `first`, (final norm, head) when `last`."""
    h, v = shape.hidden_size, shape.vocab_size
    published = shape.layout == "published"
    embed = embed_norm = final_norm = head = None
    if first:
        embed = source.get("model.llm.embed.weight" if published else "model.embed_tokens.weight", (v, h))
        embed_norm = source.get(
            "model.llm.embed_norm.weight" if published else "model.embed_tokens.embed_norm.weight", (h,)
        )
    if last:
        final_norm = source.get("model.llm.norm.weight" if published else "model.norm.weight", (h,))
        head_name = "model.llm.unembed.weight" if published else "lm_head.weight"
        rows = v
        if published and source.has(head_name):
            # the published head may hold only the unpadded rows
            for candidate in (v, shape.unpadded_vocab_size):
                try:
                    head = source.get(head_name, (candidate, h))
                    rows = candidate
                    break
                except CheckpointError:
                    continue
        if head is None:
            head = source.get(head_name, (rows, h))
    return embed, embed_norm, final_norm, head


def load_stage(model_dir: Path, start_layer: int, end_layer: int) -> StageWeights:
    """Read layers [start_layer, end_layer), plus the embedding on the first stage and the head on the last."""
    shape = load_shape(model_dir)
    if not 0 <= start_layer < end_layer <= shape.num_layers:
        raise CheckpointError(f"layer range {start_layer}:{end_layer} is not inside the model's 0:{shape.num_layers}")
    with ExitStack() as stack:
        source = TensorSource(model_dir, stack)
        layers = tuple(_read_layer(source, shape, i) for i in range(start_layer, end_layer))
        first, last = start_layer == 0, end_layer == shape.num_layers
        embed, embed_norm, final_norm, head = load_stage_tensors(source, shape, first, last)
    return StageWeights(shape, start_layer, end_layer, layers, embed, embed_norm, final_norm, head)
