"""Llama-family decoders (RoPE, grouped-query attention, RMSNorm, SwiGLU, tied or untied head).

Read from a GGUF file or from a Hugging Face safetensors directory (`model_type` llama). The dense
FFN is cut into all-active expert slices so it runs through the same fused expert path as Inkling's
MoE layers. GGUF stores q/k rows permuted for interleaved rotary pairs; they are put back in the
Hugging Face order here, so one graph (rotate-half RoPE) serves both sources.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cascadia.model.checkpoint import DENSE_SLICES, CheckpointError, ExpertWeights, StageWeights, TensorSource
from cascadia.model.config import AttentionShape, ConfigError, ModelShape
from cascadia.model.formats import Weight, split_input_columns, split_output_rows
from cascadia.model.gguf_file import GgufFile


@dataclass(frozen=True)
class LlamaLayerWeights:
    index: int
    input_norm: np.ndarray  # [H]
    q_proj: Weight  # [Hq*D, H]
    k_proj: Weight  # [Hkv*D, H]
    v_proj: Weight  # [Hkv*D, H]
    o_proj: Weight  # [H, Hq*D]
    post_attention_norm: np.ndarray  # [H]
    experts: ExpertWeights  # the FFN as DENSE_SLICES all-active slices
    router: None = None
    dense_scale: float = 1.0
    mlp_conv: None = None  # no short convolution on the FFN output


def llama_shape(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    rms_norm_eps: float,
    rope_theta: float,
    max_position_embeddings: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
    tie_word_embeddings: bool,
    layout: str,
) -> ModelShape:
    for name, value in (
        ("vocab_size", vocab_size),
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("intermediate_size", intermediate_size),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"llama config: '{name}' must be a positive integer, got {value!r}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"llama config: {num_heads} heads not divisible by {num_kv_heads} kv heads")
    if head_dim % 2:
        raise ConfigError(f"llama config: rotary head_dim {head_dim} must be even")
    attention = AttentionShape("global", num_heads, num_kv_heads, head_dim, None, 0)
    return ModelShape(
        vocab_size=vocab_size,
        unpadded_vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        attention=(attention,) * num_layers,
        mlp_kinds=("dense",) * num_layers,
        intermediate_size=intermediate_size,
        moe_intermediate_size=intermediate_size,
        n_routed_experts=0,
        num_experts_per_tok=0,
        n_shared_experts=0,
        route_scale=1.0,
        d_rel=0,
        conv_kernel_size=0,
        rms_norm_eps=rms_norm_eps,
        log_scaling_n_floor=None,
        log_scaling_alpha=0.0,
        logits_mup_width_multiplier=1.0,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        layout=layout,  # type: ignore[arg-type]
        family="llama",
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
    )


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def shape_from_hf_config(cfg: dict[str, Any]) -> ModelShape:
    if cfg.get("model_type") != "llama":
        raise ConfigError(f"config.json: model_type '{cfg.get('model_type')}' is not a Llama model")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act '{cfg.get('hidden_act')}' is not supported (only 'silu')")
    if cfg.get("rope_scaling") not in (None, {}) or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ConfigError("config.json: rope_scaling, attention_bias and mlp_bias are not supported")
    heads = cfg.get("num_attention_heads")
    hidden = cfg.get("hidden_size")
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return llama_shape(
        vocab_size=cfg.get("vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.get("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or (hidden // heads if hidden and heads else 0),
        intermediate_size=cfg.get("intermediate_size"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        bos_token_id=_first_id(cfg.get("bos_token_id")),
        eos_token_id=_first_id(cfg.get("eos_token_id")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layout="llama",
    )


def shape_from_gguf(gguf: GgufFile) -> ModelShape:
    arch = gguf.architecture
    meta = gguf.metadata

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ConfigError(f"{gguf.path}: metadata '{arch}.{name}' is missing")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    return llama_shape(
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        intermediate_size=int(key("feed_forward_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 2048)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        tie_word_embeddings=not gguf.has("output.weight"),
        layout="gguf",
    )


def _unpermute_rotary(weight: Weight, heads: int) -> Weight:
    """GGUF's q/k rows (interleaved rotary pairs) back to Hugging Face's (rotate-half) order."""

    def fix(a: np.ndarray) -> np.ndarray:
        rows = a.shape[0]
        return np.ascontiguousarray(a.reshape(heads, rows // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2)).reshape(
            a.shape
        )

    return fix(weight) if isinstance(weight, np.ndarray) else weight.map_blocks(fix)


def _experts(gate: Weight, up: Weight, down: Weight, width: int) -> ExpertWeights:
    if width % DENSE_SLICES:
        raise CheckpointError(f"FFN width {width} is not divisible into {DENSE_SLICES} expert slices")
    return ExpertWeights(
        gate=split_output_rows(gate, DENSE_SLICES),
        up=split_output_rows(up, DENSE_SLICES),
        down=split_input_columns(down, DENSE_SLICES),
    )


# Each layer tensor's name in the two sources, by role
GGUF_LAYER = {
    "input_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "post_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
}
HF_LAYER = {
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}


def _read_layer(
    get: Callable[[str, tuple[int, ...]], Weight], names: dict[str, str], shape: ModelShape, i: int, gguf: bool
) -> LlamaLayerWeights:
    a = shape.attention[0]
    h, w = shape.hidden_size, shape.intermediate_size

    def read(role: str, dims: tuple[int, ...]) -> Weight:
        return get(names[role].format(i=i), dims)

    q, k = read("q", (a.q_width, h)), read("k", (a.kv_width, h))
    if gguf:
        q, k = _unpermute_rotary(q, a.num_heads), _unpermute_rotary(k, a.num_kv_heads)
    return LlamaLayerWeights(
        index=i,
        input_norm=read("input_norm", (h,)),  # type: ignore[arg-type]
        q_proj=q,
        k_proj=k,
        v_proj=read("v", (a.kv_width, h)),
        o_proj=read("o", (h, a.q_width)),
        post_attention_norm=read("post_norm", (h,)),  # type: ignore[arg-type]
        experts=_experts(read("gate", (w, h)), read("up", (w, h)), read("down", (h, w)), w),
    )


def load_gguf_stage(path: Path, start: int, end: int) -> StageWeights:
    gguf = GgufFile(path)
    shape = shape_from_gguf(gguf)
    _check_range(shape, start, end)
    h = shape.hidden_size
    layers = tuple(_read_layer(gguf.weight, GGUF_LAYER, shape, i, gguf=True) for i in range(start, end))
    embed = final_norm = head = None
    needs_table = start == 0 or (end == shape.num_layers and shape.tie_word_embeddings)
    table = gguf.weight("token_embd.weight", (shape.vocab_size, h)) if needs_table else None
    if start == 0:
        embed = table
    if end == shape.num_layers:
        final_norm = gguf.weight("output_norm.weight", (h,))
        head = table if shape.tie_word_embeddings else gguf.weight("output.weight", (shape.vocab_size, h))
    return StageWeights(shape, start, end, layers, embed, None, final_norm, head)  # type: ignore[arg-type]


def load_hf_stage(model_dir: Path, start: int, end: int) -> StageWeights:
    shape = shape_from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    _check_range(shape, start, end)
    h = shape.hidden_size
    with ExitStack() as stack:
        source = TensorSource(model_dir, stack)
        layers = tuple(_read_layer(source.get, HF_LAYER, shape, i, gguf=False) for i in range(start, end))
        embed = final_norm = head = None
        if start == 0:
            embed = source.get("model.embed_tokens.weight", (shape.vocab_size, h))
        if end == shape.num_layers:
            final_norm = source.get("model.norm.weight", (h,))
            if shape.tie_word_embeddings or not source.has("lm_head.weight"):
                head = source.get("model.embed_tokens.weight", (shape.vocab_size, h))
            else:
                head = source.get("lm_head.weight", (shape.vocab_size, h))
    return StageWeights(shape, start, end, layers, embed, None, final_norm, head)  # type: ignore[arg-type]


def _check_range(shape: ModelShape, start: int, end: int) -> None:
    if not 0 <= start < end <= shape.num_layers:
        raise CheckpointError(f"layer range {start}:{end} is not inside the model's 0:{shape.num_layers}")
