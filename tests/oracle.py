"""The numerical oracle: transformers' InklingForCausalLM in float32 on the same (dequantised) weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import InklingForCausalLM

from cascadia.engine.settings import EngineSettings
from cascadia.engine.weights import dequantize, quantize
from cascadia.model.checkpoint import StageWeights
from cascadia.model.formats import join_input_columns


def load_oracle(model_dir: Path) -> InklingForCausalLM:
    model = InklingForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def layer_outputs(model: InklingForCausalLM, ids: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """Each decoder layer's output rows and the logits, from one full forward pass."""
    captured: list[np.ndarray] = []
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()[0].numpy().copy()))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy()
    finally:
        for hook in hooks:
            hook.remove()
    return captured, logits


def greedy(model: InklingForCausalLM, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    return out[0, len(ids) :].tolist()


def relative_rms(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((ours - ref) ** 2)) / np.sqrt(np.mean(ref**2)))


def dequantised_oracle(model: InklingForCausalLM, weights: StageWeights, settings: EngineSettings) -> None:
    """Load into `model` the weights exactly as the engine computes with them."""

    def dq(array: np.ndarray, fmt: str) -> torch.Tensor:
        return torch.from_numpy(dequantize(quantize(array, fmt)).copy())

    shape = weights.shape
    state: dict[str, torch.Tensor] = {}
    if weights.embed is not None:
        state["model.embed_tokens.weight"] = dq(weights.embed, settings.head_weights)
    if weights.head is not None:
        head = dq(weights.head[: shape.unpadded_vocab_size], settings.head_weights)
        full = model.lm_head.weight.detach().clone()
        full[: shape.unpadded_vocab_size] = head
        state["lm_head.weight"] = full
    for layer in weights.layers:
        p = f"model.layers.{layer.index}."
        a = layer.attention
        for name in ("q_proj", "k_proj", "v_proj", "r_proj", "o_proj"):
            state[p + f"self_attn.{name}.weight"] = dq(getattr(a, name), settings.attention_weights)
        bank = layer.experts
        gate = dequantize(quantize(bank.gate, settings.expert_weights))
        up = dequantize(quantize(bank.up, settings.expert_weights))
        down = dequantize(quantize(bank.down, settings.expert_weights))
        if layer.router is None:
            h = shape.hidden_size
            state[p + "mlp.gate_proj.weight"] = torch.from_numpy(gate.reshape(-1, h).copy())
            state[p + "mlp.up_proj.weight"] = torch.from_numpy(up.reshape(-1, h).copy())
            # as expert slices the down projection is quantised slice by slice, as a plain matmul whole
            if settings.dense_ffn_path == "matmul":
                joined = dequantize(quantize(join_input_columns(bank.down), settings.expert_weights))
            else:
                joined = join_input_columns(down)
            state[p + "mlp.down_proj.weight"] = torch.from_numpy(np.ascontiguousarray(joined))
        else:
            e = shape.n_routed_experts
            state[p + "mlp.experts.gate_up_proj"] = torch.from_numpy(np.concatenate([gate[:e], up[:e]], axis=1))
            state[p + "mlp.experts.down_proj"] = torch.from_numpy(down[:e].copy())
            state[p + "mlp.shared_experts.gate_proj"] = torch.from_numpy(gate[e:].copy())
            state[p + "mlp.shared_experts.up_proj"] = torch.from_numpy(up[e:].copy())
            shared_down = down[e:]
            if settings.dense_ffn_path == "matmul":  # the shared experts' down projections quantised joined
                joined = dequantize(quantize(join_input_columns(bank.down[e:]), settings.expert_weights))
                shared_down = np.moveaxis(joined.reshape(joined.shape[0], len(shared_down), -1), 1, 0)
            state[p + "mlp.shared_experts.down_proj"] = torch.from_numpy(np.ascontiguousarray(shared_down))
    missing = set(state) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(state, strict=False)
