"""OpenVINO graph for one Llama-family decoder layer, batched over many streams like Inkling's.

Same inputs and index tables as `graphs.attention_graph` (see its shape legend), plus each row's
absolute position for the rotary embedding. Keys are cached after rotation. With no position bias,
every cached key is in the far region (read in place from the cache's blocks under one mask per
stream) and the band holds only this step's rows. The FFN is `graphs`'
dense bank: all-active expert slices with unit weights, or plain matmuls (`EngineSettings.dense_ffn`).

A stage can instead attend through OpenVINO's PagedAttention op (`paged_stage_graph`): the plugin
writes each step's keys and values into per-layer block pools the engine binds once, and reads each
stream's history through its block table (`paged.paged_tables`), one fused node per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset16 as ops
from openvino._pyopenvino.op import _PagedAttentionExtension

from cascadia.engine import graphs
from cascadia.engine.graphs import (
    FarKeys,
    _f32,
    far_inputs,
    graph_input,
    i64_constant,
    linear,
    named_output,
    rms_norm,
    segment_attention,
    stacked_linear,
)
from cascadia.engine.paged import PAGE
from cascadia.engine.settings import FUSED_FFN, FfnForm, HeadCompute
from cascadia.engine.weights import WeightFormat
from cascadia.kv_layout import KV_BLOCK
from cascadia.model.config import ModelShape
from cascadia.model.llama import LlamaLayerWeights

Node = ov.Node


def inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def rotate(x: Node, cos: Node, sin: Node, head_dim: int) -> Node:
    """Rotate-half RoPE on [T, heads, D] with cos/sin [T, 1, D]."""
    half = head_dim // 2
    first = ops.slice(x, i64_constant(0), i64_constant(half), i64_constant(1), i64_constant(2))
    second = ops.slice(x, i64_constant(half), i64_constant(head_dim), i64_constant(1), i64_constant(2))
    rotated = ops.concat([ops.multiply(second, _f32(-1.0)), first], -1)
    return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin))


@dataclass(frozen=True)
class _Shared:
    """Per-step inputs every layer of a stage reads: the row layout, the key masks and each row's rotary angles."""

    cell_rows: Node
    row_cells: Node
    key_mask: Node
    far_mask: Node
    cos: Node
    sin: Node


def _shared_inputs(shape: ModelShape) -> tuple[list[Node], _Shared]:
    d = shape.attention[0].head_dim
    cell_rows = graph_input("cell_rows", [-1], "i32")
    row_cells = graph_input("row_cells", [-1], "i32")
    key_mask = graph_input("key_mask", [-1, -1])
    far_mask = graph_input("far_mask", [-1, -1])
    position = graph_input("query_position", [-1])
    angles = ops.multiply(
        ops.unsqueeze(position, i64_constant(1)), _f32(inverse_frequencies(d, shape.rope_theta)[None, :])
    )
    angles = ops.unsqueeze(ops.concat([angles, angles], -1), i64_constant(1))  # [T, 1, D]
    shared = _Shared(cell_rows, row_cells, key_mask, far_mask, ops.cos(angles), ops.sin(angles))
    return [cell_rows, row_cells, key_mask, far_mask, position], shared


def _layer(
    shape: ModelShape,
    layer: LlamaLayerWeights,
    hidden: Node,
    shared: _Shared,
    far: FarKeys | PagedInputs,
    attention_fmt: WeightFormat,
    expert_fmt: WeightFormat | None,
    ffn: FfnForm = FUSED_FFN,
) -> tuple[Node, Node, list[Node]]:
    """One layer's nodes: (new keys, new values, [hidden_out] or the expert graph's inputs)."""
    i = layer.index
    a = shape.layer_attention(i)
    d = a.head_dim
    eps = shape.rms_norm_eps

    x = rms_norm(hidden, layer.input_norm, eps)
    q, k, v = (
        ops.reshape(p, i64_constant(-1, heads, d), False)
        for p, heads in zip(
            stacked_linear(x, [layer.q_proj, layer.k_proj, layer.v_proj], attention_fmt, f"l{i}.qkv"),
            (a.num_heads, a.num_kv_heads, a.num_kv_heads),
            strict=True,
        )
    )
    q = rotate(q, shared.cos, shared.sin, d)
    keys_new = rotate(k, shared.cos, shared.sin, d)

    if isinstance(far, PagedInputs):
        context = far.attend(q, keys_new, v, a.num_heads, a.num_kv_heads, d)
    else:
        context = segment_attention(
            q, keys_new, v, None, None, shared.cell_rows, shared.row_cells, shared.key_mask,
            a.num_kv_heads, d, 1.0 / np.sqrt(d), far=far,
        )  # fmt: skip
    residual = ops.add(hidden, linear(context, layer.o_proj, attention_fmt, f"l{i}.o"))
    mlp_input = rms_norm(residual, layer.post_attention_norm, eps)

    index, weight = graphs._routing(shape, layer, mlp_input)
    if expert_fmt is None:
        return keys_new, v, [residual, mlp_input, index, weight]
    _, (hidden_out,) = graphs._expert_block(shape, layer, mlp_input, index, weight, residual, None, expert_fmt, ffn=ffn)
    return keys_new, v, [hidden_out]


def layer_graph(
    shape: ModelShape,
    layer: LlamaLayerWeights,
    attention_fmt: WeightFormat,
    expert_fmt: WeightFormat | None,
    kv_type: str = "f32",
    ffn: FfnForm = FUSED_FFN,
) -> ov.Model:
    """One layer: norm, RoPE attention, residual, post-attention norm, and (with `expert_fmt`) the FFN and its residual.

    Without `expert_fmt` it ends at the expert graph's inputs (experts at another compute precision).
    """
    a = shape.layer_attention(layer.index)
    hidden = graph_input("hidden", [-1, shape.hidden_size])
    shared_params, shared = _shared_inputs(shape)
    far_params, far = far_inputs(a.num_kv_heads, a.head_dim, KV_BLOCK, kv_type, mask=shared.far_mask)
    keys, values, rest = _layer(shape, layer, hidden, shared, far, attention_fmt, expert_fmt, ffn)
    names = ["hidden_out"] if expert_fmt is not None else ["residual", "mlp_input", "expert_index", "expert_weight"]
    results = [named_output(keys, "new_k"), named_output(values, "new_v")] + [
        named_output(n, m) for n, m in zip(rest, names, strict=True)
    ]
    params = [hidden, *far_params, *shared_params]
    return ov.Model([ops.result(n) for n in results], params, f"layer{layer.index}_llama")


def stage_graph(
    shape: ModelShape,
    layers: Sequence[LlamaLayerWeights],
    attention_fmt: WeightFormat,
    expert_fmt: WeightFormat,
    ffn: FfnForm = FUSED_FFN,
    kv_type: str = "f32",
) -> ov.Model:
    """Every layer of a stage in one model: one call per step instead of one per layer.

    Inputs: `hidden`, the shared tables, and `far_k_{n}` / `far_v_{n}` (the cache's blocks) for the n-th layer;
    outputs: `new_k_{n}`, `new_v_{n}`, each layer's output `layer_out_{n}` and `hidden_out`.
    """
    hidden = graph_input("hidden", [-1, shape.hidden_size])
    shared_params, shared = _shared_inputs(shape)
    params, results = [hidden, *shared_params], []
    x = hidden
    for n, layer in enumerate(layers):
        a = shape.layer_attention(layer.index)
        far_params, far = far_inputs(a.num_kv_heads, a.head_dim, KV_BLOCK, kv_type, f"_{n}", shared.far_mask)
        params += far_params
        keys, values, (x,) = _layer(shape, layer, x, shared, far, attention_fmt, expert_fmt, ffn)
        results += [
            named_output(keys, f"new_k_{n}"),
            named_output(values, f"new_v_{n}"),
            named_output(x, f"layer_out_{n}"),
        ]
    results.append(named_output(ops.convert(x, "f32"), "hidden_out"))
    return ov.Model([ops.result(n) for n in results], params, "stage_llama")


PAGED_TABLES = ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins")


@dataclass(frozen=True)
class PagedInputs:
    """One layer's block pools and the step's sequence tables (shared by every layer)."""

    key_cache: Node
    value_cache: Node
    tables: tuple[Node, ...]  # PAGED_TABLES, in the op's order
    max_context_len: Node
    unused: tuple[Node, ...]  # `_unused_paged_inputs()`, one set for every layer

    def attend(self, q: Node, k: Node, v: Node, heads: int, kv_heads: int, head_dim: int) -> Node:
        """Causal attention of each row over its stream's cached positions and its segment's earlier rows.

        q [T, heads, D], k and v [T, kv_heads, D] (rotated); returns [T, heads * D]. The op also
        stores k and v into the pools at each row's position.
        """
        flat = [
            ops.reshape(x, i64_constant(0, n * head_dim), True) for x, n in ((q, heads), (k, kv_heads), (v, kv_heads))
        ]
        scale = _f32(1.0 / np.sqrt(head_dim))
        inputs = [*flat, self.key_cache, self.value_cache, *self.tables, scale, *self.unused[:2], self.max_context_len]
        op = _PagedAttentionExtension([node.output(0) for node in [*inputs, *self.unused[2:]]])
        info = op.get_rt_info()
        info["num_k_heads"], info["k_head_size"] = kv_heads, head_dim
        info["num_v_heads"], info["v_head_size"] = kv_heads, head_dim
        return op.output(0)


def _unused_paged_inputs() -> tuple[Node, ...]:
    """The op's optional inputs, switched off (inputs 10, 11 and 13..27 of PagedAttentionExtension):
    no sliding window, no ALiBi, no score output, no cache rotation, no sparse (xattention) prefill,
    no sinks, no adaptive eviction, no token types, no query bias."""
    i32, f32 = np.int32, np.float32
    none_i32, none_f32 = np.zeros(0, i32), np.zeros(0, f32)
    values = [
        np.array(0, i32),  # sliding window
        none_f32,  # alibi slopes
        none_i32,  # score aggregation window
        none_i32,  # rotated block indices
        none_i32,  # rotation deltas
        none_f32,  # rotation trig table
        none_f32,  # xattention threshold
        np.array(0, i32),  # xattention block size
        np.array(0, i32),  # xattention stride
        np.zeros((0, 0, 0, 0), f32),  # sinks
        np.array(0, i32),  # adaptive eviction start
        none_i32,  # adaptive eviction sizes
        none_i32,  # adaptive eviction block sets
        none_i32,  # their begins
        none_i32,  # token types
        np.zeros(0, np.uint8),  # query bias
        none_i32,  # query bias begins
    ]
    return tuple(ops.constant(v) for v in values)


def paged_stage_graph(
    shape: ModelShape,
    layers: Sequence[LlamaLayerWeights],
    attention_fmt: WeightFormat,
    expert_fmt: WeightFormat,
    ffn: FfnForm = FUSED_FFN,
    kv_type: str = "f32",
    layer_outputs: bool = True,
    head: StageHead | None = None,
    embed: StageEmbed | None = None,
) -> ov.Model:
    """Every layer of a stage in one model, attending through PagedAttention over block pools.

    Inputs: `hidden` (or with `embed`, the first stage, `input_ids`), `query_position`, the sequence
    tables (`paged.PagedTables.as_inputs`) and each layer's pools `key_cache_{n}` / `value_cache_{n}`
    [blocks, kv_heads, PAGE, D], which the op updates in place; outputs: each layer's output
    `layer_out_{n}` (with `layer_outputs`) and `hidden_out`. With `head` (the last stage), also
    `logits` of the rows listed in `logit_rows`.
    """
    if embed is None:
        first = x = graph_input("hidden", [-1, shape.hidden_size])
    else:
        first = graph_input("input_ids", [-1], "i32")
        x = graphs.embed_rows(first, embed.weight, embed.norm, shape.rms_norm_eps, embed.fmt)
    shared_params, shared = _shared_inputs(shape)
    position = shared_params[-1]
    tables = tuple(graph_input(name, [-1], "i32") for name in PAGED_TABLES)
    max_context_len = graph_input("max_context_len", [], "i32")
    unused = _unused_paged_inputs()
    params, results = [first, position, *tables, max_context_len], []
    for n, layer in enumerate(layers):
        a = shape.layer_attention(layer.index)
        pools = [
            graph_input(f"{kv}_cache_{n}", [-1, a.num_kv_heads, PAGE, a.head_dim], kv_type) for kv in ("key", "value")
        ]
        params += pools
        paged = PagedInputs(pools[0], pools[1], tables, max_context_len, unused)
        _, _, (x,) = _layer(shape, layer, x, shared, paged, attention_fmt, expert_fmt, ffn)
        if layer_outputs:
            results.append(named_output(x, f"layer_out_{n}"))
    results.append(named_output(ops.convert(x, "f32"), "hidden_out"))
    if head is not None:
        logit_rows = graph_input("logit_rows", [-1], "i32")
        params.append(logit_rows)
        chosen = ops.gather(x, logit_rows, i64_constant(0))
        logits = graphs.head_logits(shape, chosen, head.final_norm, head.weight, head.fmt, compute=head.compute)
        results.append(named_output(logits, "logits"))
    return ov.Model([ops.result(n) for n in results], params, "stage_llama_paged")


@dataclass(frozen=True)
class StageEmbed:
    """What the first stage's graph needs to start from token ids."""

    weight: graphs.Weight
    norm: np.ndarray | None
    fmt: WeightFormat


@dataclass(frozen=True)
class StageHead:
    """What the last stage's graph needs to end in logits."""

    final_norm: np.ndarray | None
    weight: graphs.Weight
    fmt: WeightFormat
    compute: HeadCompute = "f32"  # the head matmul's arithmetic (`EngineSettings.head_compute`)
