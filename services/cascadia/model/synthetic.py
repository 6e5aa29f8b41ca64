"""Synthetic Inkling checkpoints: random weights in either layout, plus a byte-level tokenizer.

Weights cannot be downloaded on our build machines, so every path of the engine is tested on these.
Scales are chosen so that activations stay near unit RMS and greedy choices are far from ties.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from safetensors.numpy import save_file

from cascadia.model.config import shape_from_config

Layout = Literal["inkling_text", "published"]

PRESETS: dict[str, dict[str, Any]] = {
    # A few MB; every branch: dense and MoE layers, sliding and global layers with different head
    # counts and head sizes, window and rel_extent far shorter than test sequences, log scaling.
    "tiny": {
        "vocab_size": 512,
        "unpadded_vocab_size": 500,
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "local_layer_ids": [0, 1, 3],
        "dense_mlp_idx": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "swa_num_attention_heads": 2,
        "swa_num_key_value_heads": 1,
        "swa_head_dim": 8,
        "sliding_window_size": 8,
        "rel_extent": 12,
        "d_rel": 4,
        "log_scaling_n_floor": 4,
        "log_scaling_alpha": 0.3,
        "intermediate_size": 256,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 2,
        "route_scale": 2.0,
        "logits_mup_width_multiplier": 4.0,
        "max_position_embeddings": 4096,
    },
    # About 0.9B parameters, for benchmarks.
    "mini": {
        "vocab_size": 32768,
        "unpadded_vocab_size": 32000,
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "dense_mlp_idx": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "swa_num_attention_heads": 16,
        "swa_num_key_value_heads": 4,
        "swa_head_dim": 64,
        "sliding_window_size": 128,
        "rel_extent": 256,
        "d_rel": 16,
        "log_scaling_n_floor": 64,
        "log_scaling_alpha": 0.1,
        "intermediate_size": 3072,
        "moe_intermediate_size": 384,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "route_scale": 2.5,
        "logits_mup_width_multiplier": 8.0,
        "max_position_embeddings": 131072,
    },
}

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")  # the markup the gateway reads calls in


@dataclass(frozen=True)
class SyntheticSpec:
    preset: str = "tiny"
    seed: int = 0
    layout: Layout = "inkling_text"
    overrides: tuple[tuple[str, Any], ...] = ()
    mtp_layers: int = 0  # depths of a multi-token-prediction head (published layout only)


# what every synthetic checkpoint's config.json says besides its shape
BASE_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "inkling_text",
    "architectures": ["InklingForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "conv_kernel_size": 4,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def text_config(preset: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    cfg: dict[str, Any] = dict(BASE_TEXT_CONFIG)
    cfg.update(PRESETS[preset])
    cfg.update(overrides or {})
    return cfg


def _tensors(cfg: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights named as `InklingForCausalLM.state_dict()` names them."""
    shape = shape_from_config(cfg)
    h = shape.hidden_size

    def normal(*dims: int, std: float) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + normal(n, std=0.1)).astype(np.float32)

    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": normal(shape.vocab_size, h, std=1.0),
        "model.embed_tokens.embed_norm.weight": norm_weight(h),
        "model.norm.weight": norm_weight(h),
        "lm_head.weight": normal(shape.vocab_size, h, std=1.0 / np.sqrt(h) * 4.0),
    }
    for i in range(shape.num_layers):
        out.update(_layer_tensors(shape, i, f"model.layers.{i}.", normal, norm_weight, rng))
    return out


def _layer_tensors(shape, i: int, p: str, normal, norm_weight, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One decoder layer's random weights, named as transformers names them under prefix `p`."""
    h, k = shape.hidden_size, shape.conv_kernel_size
    out: dict[str, np.ndarray] = {}
    a = shape.layer_attention(i)
    out[p + "input_layernorm.weight"] = norm_weight(h)
    out[p + "post_attention_layernorm.weight"] = norm_weight(h)
    out[p + "self_attn.q_proj.weight"] = normal(a.q_width, h, std=1 / np.sqrt(h))
    out[p + "self_attn.k_proj.weight"] = normal(a.kv_width, h, std=1 / np.sqrt(h))
    out[p + "self_attn.v_proj.weight"] = normal(a.kv_width, h, std=1 / np.sqrt(h))
    out[p + "self_attn.r_proj.weight"] = normal(a.num_heads * shape.d_rel, h, std=1 / np.sqrt(h))
    out[p + "self_attn.o_proj.weight"] = normal(h, a.q_width, std=1 / np.sqrt(a.q_width))
    out[p + "self_attn.q_norm.weight"] = norm_weight(a.head_dim) * np.float32(np.sqrt(a.head_dim))
    out[p + "self_attn.k_norm.weight"] = norm_weight(a.head_dim)
    out[p + "self_attn.k_sconv.conv1d.weight"] = normal(a.kv_width, 1, k, std=0.3)
    out[p + "self_attn.v_sconv.conv1d.weight"] = normal(a.kv_width, 1, k, std=0.3)
    out[p + "self_attn.rel_logits_proj.proj"] = normal(shape.d_rel, a.rel_extent, std=0.5)
    out[p + "attn_sconv.conv1d.weight"] = normal(h, 1, k, std=0.3)
    out[p + "mlp_sconv.conv1d.weight"] = normal(h, 1, k, std=0.3)
    m = p + "mlp."
    if shape.is_dense(i):
        width = shape.intermediate_size
        out[m + "gate_proj.weight"] = normal(width, h, std=1 / np.sqrt(h))
        out[m + "up_proj.weight"] = normal(width, h, std=1 / np.sqrt(h))
        out[m + "down_proj.weight"] = normal(h, width, std=1 / np.sqrt(width))
        out[m + "global_scale"] = np.array([0.8 + 0.4 * rng.random()], dtype=np.float32)
    else:
        e, s, w = shape.n_routed_experts, shape.n_shared_experts, shape.moe_intermediate_size
        out[m + "gate.weight"] = normal(e + s, h, std=2 / np.sqrt(h))
        out[m + "gate.global_scale"] = np.array([0.8 + 0.4 * rng.random()], dtype=np.float32)
        out[m + "gate.e_score_correction_bias"] = normal(e, std=0.1)
        out[m + "experts.gate_up_proj"] = normal(e, 2 * w, h, std=1 / np.sqrt(h))
        out[m + "experts.down_proj"] = normal(e, h, w, std=1 / np.sqrt(w))
        out[m + "shared_experts.gate_proj"] = normal(s, w, h, std=1 / np.sqrt(h))
        out[m + "shared_experts.up_proj"] = normal(s, w, h, std=1 / np.sqrt(h))
        out[m + "shared_experts.down_proj"] = normal(s, h, w, std=1 / np.sqrt(w))
    return out


def mtp_config(depths: int) -> dict[str, Any]:
    """The head's config as published checkpoints carry it: like the 975B model, depths 1 and 3 are global."""
    return {
        "num_nextn_predict_layers": depths,
        "local_layer_ids": [d for d in range(depths) if d not in (1, 3)],
        "hidden_states_first": True,
        "chain_hidden_post_norm": False,
    }


def _mtp_tensors(cfg: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random MTP depths in the published names (`model.mtp.layers.{k}.*`)."""
    block = shape_from_config({"text_config": cfg, "mtp_config": mtp_config(cfg["num_mtp_layers"])})
    block = block.mtp_block_shape()
    h = block.hidden_size

    def normal(*dims: int, std: float) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + normal(n, std=0.1)).astype(np.float32)

    out: dict[str, np.ndarray] = {}
    for k in range(block.num_layers):
        p = f"model.mtp.layers.{k}."
        out[p + "hidden_norm.weight"] = norm_weight(h)
        out[p + "embed_norm.weight"] = norm_weight(h)
        out[p + "input_proj.weight"] = normal(h, 2 * h, std=1 / np.sqrt(2 * h))
        layer = _layer_tensors(block, k, "block.", normal, norm_weight, rng)
        out.update(_publish_layer(block, k, layer, "block.", p + "transformer_block."))
    return out


def _interleave(gate: np.ndarray, up: np.ndarray, axis: int) -> np.ndarray:
    stacked = np.stack([gate, up], axis=axis + 1)
    shape = list(gate.shape)
    shape[axis] *= 2
    return np.ascontiguousarray(stacked.reshape(shape))


def to_published(cfg: dict[str, Any], tensors: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """The same model in the published layout (InklingConfig + `model.llm.*` + interleaved w13)."""
    shape = shape_from_config(cfg)
    out: dict[str, np.ndarray] = {
        "model.llm.embed.weight": tensors["model.embed_tokens.weight"],
        "model.llm.embed_norm.weight": tensors["model.embed_tokens.embed_norm.weight"],
        "model.llm.norm.weight": tensors["model.norm.weight"],
        "model.llm.unembed.weight": tensors["lm_head.weight"],
    }
    for i in range(shape.num_layers):
        out.update(_publish_layer(shape, i, tensors, f"model.layers.{i}.", f"model.llm.layers.{i}."))
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    text["sconv_kernel_size"] = text.pop("conv_kernel_size")
    published = {
        "model_type": "inkling_mm_model",
        "architectures": ["InklingForConditionalGeneration"],
        "text_config": text,
    }
    return published, out


ATTENTION_NAMES = {"q_proj": "wq_du", "k_proj": "wk_dv", "v_proj": "wv_dv", "r_proj": "wr_du", "o_proj": "wo_ud"}


def _publish_layer(shape, i: int, tensors: dict[str, np.ndarray], s: str, p: str) -> dict[str, np.ndarray]:
    """Layer `i` (transformers names under prefix `s`) renamed to the published layout under prefix `p`."""
    out: dict[str, np.ndarray] = {}
    out[p + "attn_norm.weight"] = tensors[s + "input_layernorm.weight"]
    out[p + "mlp_norm.weight"] = tensors[s + "post_attention_layernorm.weight"]
    for ours, theirs in ATTENTION_NAMES.items():
        out[p + f"attn.{theirs}.weight"] = tensors[s + f"self_attn.{ours}.weight"]
    for norm in ("q_norm", "k_norm"):
        out[p + f"attn.{norm}.weight"] = tensors[s + f"self_attn.{norm}.weight"]
    out[p + "attn.k_sconv.weight"] = tensors[s + "self_attn.k_sconv.conv1d.weight"]
    out[p + "attn.v_sconv.weight"] = tensors[s + "self_attn.v_sconv.conv1d.weight"]
    out[p + "attn.rel_logits_proj.proj"] = tensors[s + "self_attn.rel_logits_proj.proj"]
    out[p + "attn_sconv.weight"] = tensors[s + "attn_sconv.conv1d.weight"]
    out[p + "mlp_sconv.weight"] = tensors[s + "mlp_sconv.conv1d.weight"]
    if shape.is_dense(i):
        out[p + "mlp.w13_dn.weight"] = _interleave(
            tensors[s + "mlp.gate_proj.weight"], tensors[s + "mlp.up_proj.weight"], axis=0
        )
        out[p + "mlp.w2_md.weight"] = tensors[s + "mlp.down_proj.weight"]
        out[p + "mlp.global_scale"] = tensors[s + "mlp.global_scale"]
    else:
        w = shape.moe_intermediate_size
        gate_up = tensors[s + "mlp.experts.gate_up_proj"]
        out[p + "mlp.experts.w13_weight"] = _interleave(gate_up[:, :w], gate_up[:, w:], axis=1)
        out[p + "mlp.experts.w2_weight"] = tensors[s + "mlp.experts.down_proj"]
        out[p + "mlp.shared_experts.shared_w13_weight"] = _interleave(
            tensors[s + "mlp.shared_experts.gate_proj"], tensors[s + "mlp.shared_experts.up_proj"], axis=1
        )
        out[p + "mlp.shared_experts.shared_w2_weight"] = tensors[s + "mlp.shared_experts.down_proj"]
        out[p + "mlp.gate.weight"] = tensors[s + "mlp.gate.weight"]
        out[p + "mlp.gate.global_scale"] = tensors[s + "mlp.gate.global_scale"]
        out[p + "mlp.gate.bias"] = tensors[s + "mlp.gate.e_score_correction_bias"]
    return out


def byte_level_tokenizer(vocab_rows: int) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json: specials at 0-2, the 256 bytes at 3-258, the tool-call tags at
    259-260 (text, as chat models' tokenizers hold them), reserved ids after."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.tokenizers import AddedToken

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_CALL_TAGS])
    reserved = [f"<|reserved_{i}|>" for i in range(max(0, vocab_rows - tokenizer.get_vocab_size()))]
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in reserved])
    return json.loads(tokenizer.to_str())


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes-to-unicode table, to order the alphabet by byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table[ch]


def write_checkpoint(out_dir: Path, spec: SyntheticSpec, progress: Any = None) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json to `out_dir`."""
    cfg = text_config(spec.preset, dict(spec.overrides))
    rng = np.random.default_rng(spec.seed)
    tensors = _tensors(cfg, rng)
    config_out: dict[str, Any] = cfg
    if spec.mtp_layers and spec.layout != "published":
        raise ValueError("an MTP head exists only in the published layout")
    if spec.layout == "published":
        config_out, tensors = to_published(cfg, tensors)
    if spec.mtp_layers:
        tensors.update(_mtp_tensors({**cfg, "num_mtp_layers": spec.mtp_layers}, rng))
        config_out["mtp_config"] = mtp_config(spec.mtp_layers)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config_out, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out_dir, cfg)
    return out_dir


def write_tokenizer(out_dir: Path, cfg: dict[str, Any]) -> None:
    """tokenizer.json (byte-level, one row per live vocabulary id) and tokenizer_config.json for `cfg`."""
    tokenizer = byte_level_tokenizer(cfg.get("unpadded_vocab_size") or cfg["vocab_size"])
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    special = {"bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0]}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": cfg["max_position_embeddings"],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
