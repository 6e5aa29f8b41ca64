"""OpenVINO graph for one Llama-family decoder layer, batched over many streams like Inkling's.

Same inputs and index tables as `graphs.attention_graph` (see its shape legend), plus each row's
absolute position for the rotary embedding. Keys are cached after rotation. The FFN runs through
`graphs`' fused expert path as all-active slices with unit weights.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset16 as ops

from cascadia.engine import graphs
from cascadia.engine.graphs import _f32, _i64, _named, _param, linear, rms_norm
from cascadia.engine.weights import WeightFormat
from cascadia.model.config import ModelShape
from cascadia.model.llama import LlamaLayerWeights

Node = ov.Node


def inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def rotate(x: Node, cos: Node, sin: Node, head_dim: int) -> Node:
    """Rotate-half RoPE on [T, heads, D] with cos/sin [T, 1, D]."""
    half = head_dim // 2
    first = ops.slice(x, _i64(0), _i64(half), _i64(1), _i64(2))
    second = ops.slice(x, _i64(half), _i64(head_dim), _i64(1), _i64(2))
    rotated = ops.concat([ops.multiply(second, _f32(-1.0)), first], -1)
    return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin))


def layer_graph(
    shape: ModelShape,
    layer: LlamaLayerWeights,
    attention_fmt: WeightFormat,
    expert_fmt: WeightFormat | None,
) -> ov.Model:
    """Norm, RoPE attention, residual, post-attention norm, and (with `expert_fmt`) the FFN and its residual."""
    i = layer.index
    a = shape.layer_attention(i)
    h, d = shape.hidden_size, a.head_dim
    groups = a.num_heads // a.num_kv_heads
    eps = shape.rms_norm_eps

    hidden = _param("hidden", [-1, h])
    row_stream = _param("row_stream", [-1], "i32")
    past_k = _param("past_k", [-1, -1, a.num_kv_heads, d])
    past_v = _param("past_v", [-1, -1, a.num_kv_heads, d])
    step_keys = _param("step_keys", [-1, -1], "i32")
    key_mask = _param("key_mask", [-1, -1])
    position = _param("query_position", [-1])
    params = [hidden, row_stream, past_k, past_v, step_keys, key_mask, position]

    angles = ops.multiply(ops.unsqueeze(position, _i64(1)), _f32(inverse_frequencies(d, shape.rope_theta)[None, :]))
    angles = ops.unsqueeze(ops.concat([angles, angles], -1), _i64(1))  # [T, 1, D]
    cos, sin = ops.cos(angles), ops.sin(angles)

    x = rms_norm(hidden, layer.input_norm, eps)
    q = ops.reshape(linear(x, layer.q_proj, attention_fmt, f"l{i}.q"), _i64(-1, a.num_heads, d), False)
    k = ops.reshape(linear(x, layer.k_proj, attention_fmt, f"l{i}.k"), _i64(-1, a.num_kv_heads, d), False)
    v = ops.reshape(linear(x, layer.v_proj, attention_fmt, f"l{i}.v"), _i64(-1, a.num_kv_heads, d), False)
    q = rotate(q, cos, sin, d)
    keys_new = _named(rotate(k, cos, sin, d), "new_k")
    values_new = _named(v, "new_v")

    keys = ops.concat([ops.gather(past_k, row_stream, _i64(0)), ops.gather(keys_new, step_keys, _i64(0))], 1)
    values = ops.concat([ops.gather(past_v, row_stream, _i64(0)), ops.gather(values_new, step_keys, _i64(0))], 1)
    q_grouped = ops.reshape(q, _i64(0, a.num_kv_heads, groups, d), True)  # [T, Hkv, G, D]
    scores = ops.matmul(q_grouped, ops.transpose(keys, _i64(0, 2, 3, 1)), False, False)  # [T, Hkv, G, L]
    scores = ops.add(ops.multiply(scores, _f32(1.0 / np.sqrt(d))), ops.unsqueeze(key_mask, _i64(1, 2)))
    context = ops.matmul(ops.softmax(scores, -1), ops.transpose(values, _i64(0, 2, 1, 3)), False, False)
    context = ops.reshape(context, _i64(-1, a.q_width), False)
    residual = _named(ops.add(hidden, linear(context, layer.o_proj, attention_fmt, f"l{i}.o")), "residual")
    mlp_input = _named(rms_norm(residual, layer.post_attention_norm, eps), "mlp_input")

    results = [keys_new, values_new]
    index, weight = graphs._routing(shape, layer, mlp_input)
    if expert_fmt is None:
        results += [residual, mlp_input, _named(index, "expert_index"), _named(weight, "expert_weight")]
    else:
        _, expert_results = graphs._expert_block(shape, layer, mlp_input, index, weight, residual, None, expert_fmt)
        results += expert_results
    return ov.Model([ops.result(n) for n in results], params, f"layer{i}_llama")
