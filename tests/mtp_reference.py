"""A float64 reference of Inkling's MTP head, written from its description (transformers has none).

Each depth's block is transformers' own `InklingDecoderLayer` (a one-layer `InklingTextModel`, dense
MLP, the depth's attention kind) in float64; everything around it -- the embedding one step ahead,
the two norms, `input_proj`, the chain, the head -- is written here. The tensors are read straight
from the checkpoint file with this module's own renames, so a loader mistake cannot hide in both.

`Variant` switches on one mistake at a time; the tests use them to show the comparison has teeth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import InklingForCausalLM
from transformers.models.inkling.configuration_inkling import InklingTextConfig
from transformers.models.inkling.modeling_inkling import InklingTextModel


@dataclass(frozen=True)
class Variant:
    embedding_first: bool = False  # cat[embed, hidden] instead of cat[hidden, embed]
    skip_hidden_norm: bool = False
    w13_halves: bool = False  # gate/up as the two halves of w13 instead of its interleaved rows
    no_convs: bool = False
    no_relative_bias: bool = False
    token_at_t: bool = False  # the embedding of x_{t+k} instead of x_{t+k+1}


CORRECT = Variant()

ATTENTION = {"wq_du": "q_proj", "wk_dv": "k_proj", "wv_dv": "v_proj", "wr_du": "r_proj", "wo_ud": "o_proj"}


def _block_state(tensors: dict[str, np.ndarray], prefix: str, variant: Variant) -> dict[str, torch.Tensor]:
    state: dict[str, np.ndarray] = {
        "input_layernorm.weight": tensors[prefix + "attn_norm.weight"],
        "post_attention_layernorm.weight": tensors[prefix + "mlp_norm.weight"],
        "self_attn.q_norm.weight": tensors[prefix + "attn.q_norm.weight"],
        "self_attn.k_norm.weight": tensors[prefix + "attn.k_norm.weight"],
        "self_attn.k_sconv.conv1d.weight": tensors[prefix + "attn.k_sconv.weight"],
        "self_attn.v_sconv.conv1d.weight": tensors[prefix + "attn.v_sconv.weight"],
        "self_attn.rel_logits_proj.proj": tensors[prefix + "attn.rel_logits_proj.proj"],
        "attn_sconv.conv1d.weight": tensors[prefix + "attn_sconv.weight"],
        "mlp_sconv.conv1d.weight": tensors[prefix + "mlp_sconv.weight"],
        "mlp.down_proj.weight": tensors[prefix + "mlp.w2_md.weight"],
        "mlp.global_scale": tensors[prefix + "mlp.global_scale"],
    }
    for theirs, ours in ATTENTION.items():
        state[f"self_attn.{ours}.weight"] = tensors[prefix + f"attn.{theirs}.weight"]
    w13 = tensors[prefix + "mlp.w13_dn.weight"]
    if variant.w13_halves:
        half = w13.shape[0] // 2
        state["mlp.gate_proj.weight"], state["mlp.up_proj.weight"] = w13[:half], w13[half:]
    else:
        state["mlp.gate_proj.weight"], state["mlp.up_proj.weight"] = w13[0::2], w13[1::2]
    if variant.no_convs:
        for name in [n for n in state if "sconv" in n]:
            state[name] = np.zeros_like(state[name])
    if variant.no_relative_bias:
        state["self_attn.rel_logits_proj.proj"] = np.zeros_like(state["self_attn.rel_logits_proj.proj"])
    return {"layers.0." + k: torch.from_numpy(np.array(v, dtype=np.float64)) for k, v in state.items()}


def _rms_norm(x: torch.Tensor, weight: np.ndarray, eps: float) -> torch.Tensor:
    w = torch.from_numpy(np.asarray(weight, dtype=np.float64))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class MtpReference:
    """The trunk (transformers, float64) and the MTP chain over a token sequence."""

    def __init__(self, published_dir: Path, trunk_dir: Path, variant: Variant = CORRECT) -> None:
        raw = json.loads((Path(published_dir) / "config.json").read_text())
        self.text = dict(raw["text_config"])
        self.mtp = raw["mtp_config"]
        self.variant = variant
        self.tensors = load_file(str(Path(published_dir) / "model.safetensors"))
        self.eps = float(self.text["rms_norm_eps"])
        self.mup = float(self.text["logits_mup_width_multiplier"])
        self.vocab = int(self.text.get("unpadded_vocab_size") or self.text["vocab_size"])
        self.trunk = InklingForCausalLM.from_pretrained(
            str(trunk_dir), dtype=torch.float64, experts_implementation="eager"
        ).eval()
        self.blocks = [self._block(k) for k in range(self.mtp["num_nextn_predict_layers"])]

    def _block(self, k: int) -> InklingTextModel:
        cfg = {key: v for key, v in self.text.items() if key not in ("sconv_kernel_size", "model_type")}
        cfg["conv_kernel_size"] = self.text["sconv_kernel_size"]
        cfg.update(
            num_hidden_layers=1,
            local_layer_ids=[0] if k in self.mtp["local_layer_ids"] else [],
            dense_mlp_idx=1,
        )
        config = InklingTextConfig(**cfg)
        model = InklingTextModel(config).to(torch.float64).eval()
        model.load_state_dict(
            _block_state(self.tensors, f"model.mtp.layers.{k}.transformer_block.", self.variant), strict=False
        )
        return model

    def trunk_states(self, ids: list[int]) -> torch.Tensor:
        """The trunk's final states after the final norm (no muP division), one per position."""
        with torch.no_grad():
            return self.trunk.model(torch.tensor([ids])).last_hidden_state[0]

    def chain(self, ids: list[int], trunk_rows: int, depths: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every depth over every row it can run: depth k at row t reads x_{t+k+1} and row t of depth k-1.

        `ids` may run past the trunk's rows (drafted tokens); depth k covers rows
        t < min(trunk_rows, len(ids) - k - 1). Returns (raw block outputs, logits) per depth.
        """
        v = self.variant
        embed = self.trunk.model.embed_tokens
        with torch.no_grad():
            prev = self.trunk_states(ids[:trunk_rows])
            out = []
            for k in range(depths):
                rows = min(trunk_rows, len(ids) - k - 1)
                p = f"model.mtp.layers.{k}."
                shift = k if v.token_at_t else k + 1
                embedded = embed(torch.tensor([ids[t + shift] for t in range(rows)]))
                hidden = prev[:rows]
                if not v.skip_hidden_norm:
                    hidden = _rms_norm(hidden, self.tensors[p + "hidden_norm.weight"], self.eps)
                parts = [hidden, _rms_norm(embedded, self.tensors[p + "embed_norm.weight"], self.eps)]
                if v.embedding_first:
                    parts.reverse()
                proj = torch.from_numpy(self.tensors[p + "input_proj.weight"].astype(np.float64))
                block_input = torch.cat(parts, dim=-1) @ proj.T
                captured: list[torch.Tensor] = []
                hook = self.blocks[k].layers[0].register_forward_hook(lambda _m, _i, o, into=captured: into.append(o))
                try:
                    self.blocks[k](inputs_embeds=block_input[None])
                finally:
                    hook.remove()
                raw = captured[0][0]
                head = torch.from_numpy(self.tensors["model.llm.unembed.weight"][: self.vocab].astype(np.float64))
                out.append((raw, (raw / self.mup) @ head.T))
                prev = raw
            return out

    def drafts(self, ids: list[int], depths: int) -> list[int]:
        """Self-fed greedy drafts after `ids` (its last id is the trunk's latest token, x_N)."""
        tokens = list(ids)
        n = len(ids) - 1
        for k in range(depths):
            _, logits = self.chain(tokens, n, k + 1)[k]
            tokens.append(int(torch.argmax(logits[n - 1])))
        return tokens[len(ids) :]
