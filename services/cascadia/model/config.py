"""A decoder's shape: Inkling's, read from either checkpoint layout's config.json, or a Llama-family one.

The rules mirror `InklingTextConfig.__post_init__` in transformers (the oracle): layer types derived
from `local_layer_ids` (default: every 6th layer is global), `dense_mlp_idx` for the leading dense
layers, and the `dense_intermediate_size` swap used by published checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

AttentionKind = Literal["sliding", "global"]
MlpKind = Literal["dense", "sparse"]
Family = Literal["inkling", "llama"]


class ConfigError(ValueError):
    """A config value that is missing, malformed or not supported by the engine."""


@dataclass(frozen=True)
class AttentionShape:
    kind: AttentionKind
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None  # keys with distance < window are visible; None: unbounded
    rel_extent: int  # bias is zero at distance >= rel_extent

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    unpadded_vocab_size: int
    hidden_size: int
    num_layers: int
    attention: tuple[AttentionShape, ...]
    mlp_kinds: tuple[MlpKind, ...]
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    route_scale: float
    d_rel: int
    conv_kernel_size: int
    rms_norm_eps: float
    log_scaling_n_floor: int | None
    log_scaling_alpha: float
    logits_mup_width_multiplier: float
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    num_mtp_layers: int | None = None
    # the multi-token-prediction head's depths (published checkpoints): one dense decoder layer each
    mtp_attention: tuple[AttentionShape, ...] = ()
    mtp_hidden_states_first: bool = True
    layout: Literal["inkling_text", "published", "llama", "gguf"] = "inkling_text"
    # Llama-family decoders: rotary positions, no short convolutions, no relative bias, an optional
    # head tied to the embedding (conv_kernel_size and d_rel are 0 for them)
    family: Family = "inkling"
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @property
    def mtp_depths(self) -> int:
        return len(self.mtp_attention)

    def mtp_block_shape(self) -> ModelShape:
        """The MTP head's depths seen as a decoder of their own: depth k is layer k, every MLP dense."""
        return replace(
            self,
            num_layers=self.mtp_depths,
            attention=self.mtp_attention,
            mlp_kinds=("dense",) * self.mtp_depths,
            mtp_attention=(),
        )

    @property
    def has_convs(self) -> bool:
        return self.conv_kernel_size > 0

    def layer_attention(self, layer: int) -> AttentionShape:
        return self.attention[layer]

    def is_dense(self, layer: int) -> bool:
        return self.mlp_kinds[layer] == "dense"

    def layer_parameter_count(self, layer: int) -> int:
        """Parameters of one decoder layer (used by planners and bandwidth floors)."""
        a = self.attention[layer]
        h = self.hidden_size
        attn = h * (a.q_width + 2 * a.kv_width + a.num_heads * self.d_rel) + a.q_width * h
        if self.family == "inkling":
            attn += 2 * a.head_dim + self.d_rel * a.rel_extent + 2 * a.kv_width * self.conv_kernel_size
        common = 2 * h + 2 * h * self.conv_kernel_size
        if self.is_dense(layer):
            mlp = 3 * h * self.intermediate_size + 1
        else:
            experts = self.n_routed_experts + self.n_shared_experts
            mlp = 3 * h * self.moe_intermediate_size * experts + experts * h + self.n_routed_experts + 1
        return attn + common + mlp

    def active_layer_parameter_count(self, layer: int) -> int:
        """Parameters one token touches in a layer: only its chosen experts."""
        if self.is_dense(layer):
            return self.layer_parameter_count(layer)
        experts = self.n_routed_experts + self.n_shared_experts
        inactive = 3 * self.hidden_size * self.moe_intermediate_size * (experts - self.active_experts)
        return self.layer_parameter_count(layer) - inactive

    @property
    def active_experts(self) -> int:
        return self.num_experts_per_tok + self.n_shared_experts


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise ConfigError(f"config.json: missing required field '{key}'")
    return cfg[key]


def _positive_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default) if default is not None else _require(cfg, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json: '{key}' must be a positive integer, got {value!r}")
    return value


def shape_from_config(raw: dict[str, Any]) -> ModelShape:
    """Parse a config.json dict of either layout into an `ModelShape`."""
    layout: Literal["inkling_text", "published"] = "inkling_text"
    cfg = dict(raw)
    mtp_config: dict[str, Any] = {}
    if "text_config" in cfg or cfg.get("model_type") == "inkling_mm_model":
        layout = "published"
        mtp_config = cfg.get("mtp_config") or {}
        cfg = dict(_require(cfg, "text_config"))
    model_type = cfg.get("model_type", "inkling_text")
    if model_type not in ("inkling_text", "inkling"):
        raise ConfigError(f"config.json: model_type '{model_type}' is not an Inkling text model")

    if "sconv_kernel_size" in cfg:
        cfg.setdefault("conv_kernel_size", cfg["sconv_kernel_size"])
    if "model_max_length" in cfg:
        cfg.setdefault("max_position_embeddings", cfg["model_max_length"])
    if "num_local_experts" in cfg:
        cfg.setdefault("n_routed_experts", cfg["num_local_experts"])
    if "sliding_window" in cfg:
        cfg.setdefault("sliding_window_size", cfg["sliding_window"])

    intermediate = cfg.get("intermediate_size", 24576)
    moe_intermediate = cfg.get("moe_intermediate_size", 3072)
    if cfg.get("dense_intermediate_size") is not None:
        moe_intermediate = intermediate
        intermediate = cfg["dense_intermediate_size"]

    num_layers = _positive_int(cfg, "num_hidden_layers")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        local = cfg.get("local_layer_ids")
        local_ids = set(local) if local is not None else {i for i in range(num_layers) if (i + 1) % 6}
        layer_types = ["hybrid_sliding" if i in local_ids else "hybrid" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ConfigError(f"config.json: 'layer_types' has {len(layer_types)} entries for {num_layers} layers")
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        dense_idx = cfg.get("dense_mlp_idx", 0)
        mlp_types = ["dense" if i < dense_idx else "sparse" for i in range(num_layers)]
    if len(mlp_types) != num_layers:
        raise ConfigError(f"config.json: 'mlp_layer_types' has {len(mlp_types)} entries for {num_layers} layers")

    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"config.json: hidden_act '{hidden_act}' is not supported (only 'silu')")
    if cfg.get("shared_expert_sink", True) is not True:
        raise ConfigError("config.json: shared_expert_sink=false is not supported")
    n_shared = cfg.get("n_shared_experts", 2)
    if "sparse" in mlp_types and (not isinstance(n_shared, int) or n_shared < 1):
        raise ConfigError(f"config.json: n_shared_experts must be >= 1, got {n_shared!r}")

    window = _positive_int(cfg, "sliding_window_size", 512)
    rel_extent = _positive_int(cfg, "rel_extent", 1024)
    attention: list[AttentionShape] = []
    for i, kind in enumerate(layer_types):
        if kind == "hybrid_sliding":
            attention.append(
                AttentionShape(
                    kind="sliding",
                    num_heads=_positive_int(cfg, "swa_num_attention_heads", 64),
                    num_kv_heads=_positive_int(cfg, "swa_num_key_value_heads", 16),
                    head_dim=_positive_int(cfg, "swa_head_dim", 128),
                    window=window,
                    rel_extent=window,
                )
            )
        elif kind == "hybrid":
            attention.append(
                AttentionShape(
                    kind="global",
                    num_heads=_positive_int(cfg, "num_attention_heads", 64),
                    num_kv_heads=_positive_int(cfg, "num_key_value_heads", 8),
                    head_dim=_positive_int(cfg, "head_dim", 128),
                    window=None,
                    rel_extent=rel_extent,
                )
            )
        else:
            raise ConfigError(f"config.json: layer_types[{i}] = '{kind}' is not supported")
        a = attention[-1]
        if a.num_heads % a.num_kv_heads:
            raise ConfigError(f"config.json: layer {i}: {a.num_heads} heads not divisible by {a.num_kv_heads} kv heads")
    for i, kind in enumerate(mlp_types):
        if kind not in ("dense", "sparse"):
            raise ConfigError(f"config.json: mlp_layer_types[{i}] = '{kind}' is not supported")

    mtp_attention, hidden_first = _mtp_attention(cfg, mtp_config)
    vocab = _positive_int(cfg, "vocab_size", 201024)
    unpadded = cfg.get("unpadded_vocab_size") or vocab
    if unpadded > vocab:
        raise ConfigError(f"config.json: unpadded_vocab_size {unpadded} exceeds vocab_size {vocab}")
    n_floor = cfg.get("log_scaling_n_floor")
    top_k = _positive_int(cfg, "num_experts_per_tok", 6)
    n_routed = _positive_int(cfg, "n_routed_experts", 256)
    if top_k > n_routed:
        raise ConfigError(f"config.json: num_experts_per_tok {top_k} exceeds n_routed_experts {n_routed}")
    return ModelShape(
        vocab_size=vocab,
        unpadded_vocab_size=unpadded,
        hidden_size=_positive_int(cfg, "hidden_size", 6144),
        num_layers=num_layers,
        attention=tuple(attention),
        mlp_kinds=tuple(mlp_types),
        intermediate_size=intermediate,
        moe_intermediate_size=moe_intermediate,
        n_routed_experts=n_routed,
        num_experts_per_tok=top_k,
        n_shared_experts=n_shared,
        route_scale=float(cfg.get("route_scale", 8.0)),
        d_rel=_positive_int(cfg, "d_rel", 16),
        conv_kernel_size=_positive_int(cfg, "conv_kernel_size", 4),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        log_scaling_n_floor=n_floor,
        log_scaling_alpha=float(cfg.get("log_scaling_alpha", 0.1)),
        logits_mup_width_multiplier=float(cfg.get("logits_mup_width_multiplier", 24.0)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        bos_token_id=cfg.get("bos_token_id", 1),
        eos_token_id=cfg.get("eos_token_id", 2),
        num_mtp_layers=cfg.get("num_mtp_layers", mtp_config.get("num_nextn_predict_layers")),
        mtp_attention=mtp_attention,
        mtp_hidden_states_first=hidden_first,
        layout=layout,
    )


def _mtp_attention(cfg: dict[str, Any], mtp: dict[str, Any]) -> tuple[tuple[AttentionShape, ...], bool]:
    """Per-depth attention of the MTP head: `local_layer_ids` depths are sliding at the head's own window."""
    depths = mtp.get("num_nextn_predict_layers", mtp.get("num_mtp_layers", 0)) or 0
    if not isinstance(depths, int) or depths < 0:
        raise ConfigError(f"config.json: mtp_config.num_nextn_predict_layers must be >= 0, got {depths!r}")
    if mtp.get("chain_hidden_post_norm", False):
        raise ConfigError("config.json: mtp_config.chain_hidden_post_norm=true is not supported")
    local = mtp.get("local_layer_ids", cfg.get("mtp_local_layer_ids")) or []
    if any(not isinstance(d, int) or not 0 <= d < depths for d in local):
        raise ConfigError(f"config.json: mtp_config.local_layer_ids {local!r} are not depths of 0..{depths - 1}")
    window = mtp.get("local_extent", cfg.get("mtp_local_extent", cfg.get("sliding_window_size", 512)))
    sliding = AttentionShape(
        kind="sliding",
        num_heads=mtp.get("swa_num_attention_heads", cfg.get("swa_num_attention_heads", 64)),
        num_kv_heads=mtp.get("swa_num_key_value_heads", cfg.get("swa_num_key_value_heads", 16)),
        head_dim=mtp.get("swa_head_dim", cfg.get("swa_head_dim", 128)),
        window=window,
        rel_extent=window,
    )
    full = AttentionShape(
        kind="global",
        num_heads=cfg.get("num_attention_heads", 64),
        num_kv_heads=cfg.get("num_key_value_heads", 8),
        head_dim=cfg.get("head_dim", 128),
        window=None,
        rel_extent=cfg.get("rel_extent", 1024),
    )
    return tuple(sliding if d in local else full for d in range(depths)), bool(mtp.get("hidden_states_first", True))


def load_shape(model_dir: Path) -> ModelShape:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in the model directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    return shape_from_config(raw)
