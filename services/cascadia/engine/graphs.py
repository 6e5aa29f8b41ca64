"""OpenVINO graphs for one Inkling decoder layer, the embedding and the head.

Shape legend: T = rows in the step (tokens of many streams, flattened), S = streams in the step,
R = S * (K - 1) conv-history rows, K = conv kernel, Lc = cached key slots per stream, W = in-step key
slots per row, H = hidden, Hq / Hkv = query / key-value heads, G = Hq / Hkv, D = head dim,
N = cache blocks of a global layer's far keys, B = positions per block,
E = experts in the layer's bank (routed + shared, or the dense slices), I = expert width.

Every step-dependent index (which history rows and keys a row sees, distances, masks) is computed on
the host by `batch.plan_step` and fed in, so one compiled model serves any mix of streams.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import openvino as ov
import openvino.opset16 as ops
from openvino.utils.node_factory import NodeFactory

from cascadia.engine import cpu_kernels
from cascadia.engine.settings import FUSED_FFN, FfnForm
from cascadia.engine.weights import Quantized, Weight, WeightFormat, quantize, weight_node
from cascadia.kv_layout import KV_BLOCK, PARAMS
from cascadia.model.checkpoint import ExpertWeights, LayerWeights
from cascadia.model.config import ModelShape
from cascadia.model.formats import (
    expert_range,
    expert_slice,
    join_input_columns,
    join_output_rows,
    scaled_by_power_of_two,
    stack_output_rows,
)

Node = ov.Node
_OPSET4 = NodeFactory("opset4")


def swish(x: Node | ov.Output) -> Node:
    """Swish with no beta input: `ops.swish` always adds one, and that defeats the MoE fusion match."""
    return _OPSET4.create("Swish", [x if isinstance(x, ov.Output) else x.output(0)], {})


def i64_constant(*values: int) -> Node:
    return ops.constant(np.array(values, dtype=np.int64))


def _f32(value: float | np.ndarray) -> Node:
    return ops.constant(np.asarray(value, dtype=np.float32))


def graph_input(name: str, shape: list[int], dtype: str = "f32") -> ov.Node:
    node = ops.parameter(ov.PartialShape(shape), getattr(ov.Type, dtype), name=name)
    node.output(0).get_tensor().set_names({name})
    return node


def cached_rows(name: str, shape: list[int], kv_type: str) -> tuple[list[ov.Node], Node]:
    """A cached key or value input and the node attention reads.

    f32 and f16 rows are the input itself (`as_f32` widens f16 where it is read); u8 rows come with
    `{name}_params` [..., 2] (each row's scale and offset, see `kv_quant`) and are widened here.
    """
    if kv_type != "u8":
        rows = graph_input(name, shape, kv_type)
        return [rows], rows
    codes = graph_input(name, shape, "u8")
    params = graph_input(f"{name}_params", [*shape[:-1], PARAMS])
    scale = ops.slice(params, i64_constant(0), i64_constant(1), i64_constant(1), i64_constant(-1))
    offset = ops.slice(params, i64_constant(1), i64_constant(2), i64_constant(1), i64_constant(-1))
    return [codes, params], ops.add(ops.multiply(ops.convert(codes, "f32"), scale), offset)


def named_output(node: Node | ov.Output, name: str) -> Node | ov.Output:
    output = node if isinstance(node, ov.Output) else node.output(0)
    output.get_tensor().set_names({name})
    return node


def as_f32(x: Node) -> Node:
    """Cached keys or values kept in f16 enter the f32 arithmetic here."""
    return x if x.get_output_element_type(0) == ov.Type.f32 else ops.convert(x, "f32")


@dataclass(frozen=True)
class FarKeys:
    """A global layer's far region: cache blocks [S, N, Hkv, B, D] of keys and values, and a mask [S, N * B]."""

    keys: Node
    values: Node
    mask: Node
    block: int


def far_inputs(
    kv_heads: int, head_dim: int, block: int, kv_type: str = "f32", suffix: str = "", mask: Node | None = None
) -> tuple[list[ov.Node], FarKeys]:
    """Inputs `far_k{suffix}`, `far_v{suffix}` and (unless a shared `mask` is given) `far_mask`."""
    k_params, far_k = cached_rows(f"far_k{suffix}", [-1, -1, kv_heads, block, head_dim], kv_type)
    v_params, far_v = cached_rows(f"far_v{suffix}", [-1, -1, kv_heads, block, head_dim], kv_type)
    params = [*k_params, *v_params]
    if mask is None:
        mask = graph_input("far_mask", [-1, -1])
        params.append(mask)
    return params, FarKeys(far_k, far_v, mask, block)


def segment_attention(
    q: Node,
    keys_new: Node,
    values_new: Node,
    past_k: Node | None,
    past_v: Node | None,
    cell_rows: Node,
    row_cells: Node,
    key_mask: Node,
    kv_heads: int,
    head_dim: int,
    scale: float,
    bias: Node | None = None,
    tau: Node | None = None,
    far: FarKeys | None = None,
) -> Node:
    """Grouped-query attention computed per stream, not per row: a band of keys, and on global layers far blocks.

    q [T, Hq, D], this step's keys and values [T, Hkv, D]. The band is each stream's nearest cached
    keys [S, 1 + Ln, Hkv, D] (slot 0 padding) and this step's own, where `key_mask` and the relative
    `bias` ([T, Hq, Lb]) depend on the row; `tau` [T] is the log scale of global layers' queries.
    `far`, on global layers, is the rest of the history as the cache stores it: blocks of B positions
    with each head's rows consecutive, read in place (no copy or transpose of the history), masked
    per stream and seen by every row with no bias. Each key block is exponentiated against the shared
    row maximum and the blocks are summed (an online softmax over tiles, parallel over streams, heads
    and blocks), so nothing of size [rows, history] other than the scores themselves is ever built.
    The rows are laid out as a [S, W] grid of cells, so every stream's keys are read once for all its
    rows. With no cached band (`past_k`/`past_v` None: every cached key is far) the band is the
    step's own rows. Returns [T, Hq * D].
    """
    groups = q.get_output_partial_shape(0)[1].get_length() // kv_heads
    if past_k is None and far is None:
        raise ValueError("attention needs a cached band, far blocks or both")
    streams = ops.gather(
        ops.shape_of(past_k if past_k is not None else far.keys, "i64"), i64_constant(0), i64_constant(0)
    )

    def cells(x: Node) -> Node:
        """Rows [T, ...] to cells [S, W, ...]."""
        gathered = ops.gather(x, cell_rows, i64_constant(0))
        rest = ops.slice(
            ops.shape_of(gathered, "i64"), i64_constant(1), i64_constant(2**31), i64_constant(1), i64_constant(0)
        )
        return ops.reshape(gathered, ops.concat([streams, i64_constant(-1), rest], 0), False)

    def band_of(cached: Node | None, new: Node) -> Node:
        """[S, 1 + Ln, Hkv, D] cached and [T, Hkv, D] new -> [S, Hkv, 1, Ln + W, D] (the padding slot dropped)."""
        rows = cells(new)
        if cached is not None:
            rows = ops.concat(
                [
                    ops.slice(as_f32(cached), i64_constant(1), i64_constant(2**62), i64_constant(1), i64_constant(1)),
                    rows,
                ],
                1,
            )
        return ops.unsqueeze(ops.transpose(rows, i64_constant(0, 2, 1, 3)), i64_constant(2))

    queries = ops.reshape(q, i64_constant(0, kv_heads, groups, head_dim), True)  # [T, Hkv, G, D]
    row_scale = _f32(scale)
    if tau is not None:
        row_scale = ops.multiply(ops.unsqueeze(tau, i64_constant(1, 2, 3)), row_scale)  # [T, 1, 1, 1]
    queries = ops.transpose(cells(ops.multiply(queries, row_scale)), i64_constant(0, 2, 3, 1, 4))  # [S, Hkv, G, W, D]
    keys_band, values_band = band_of(past_k, keys_new), band_of(past_v, values_new)
    band = ops.matmul(queries, keys_band, False, True)  # [S, Hkv, G, W, Lb]
    if bias is not None:
        if tau is not None:
            bias = ops.multiply(bias, ops.unsqueeze(tau, i64_constant(1, 2)))
        bias = ops.reshape(bias, i64_constant(0, kv_heads, groups, -1), True)  # [T, Hkv, G, Lb]
        band = ops.add(band, ops.transpose(cells(bias), i64_constant(0, 2, 3, 1, 4)))
    band = ops.add(band, ops.unsqueeze(cells(key_mask), i64_constant(1, 2)))
    if far is None:
        context = ops.matmul(ops.softmax(band, -1), values_band, False, False)
    else:
        # scores per block [S, N, Hkv, G, W, B]; blocks and slots are the two reduced axes
        block_queries = ops.unsqueeze(queries, i64_constant(1))  # [S, 1, Hkv, G, W, D]
        keys_far = ops.unsqueeze(as_f32(far.keys), i64_constant(3))  # [S, N, Hkv, 1, B, D]
        values_far = ops.unsqueeze(as_f32(far.values), i64_constant(3))
        scores = ops.matmul(block_queries, keys_far, False, True)
        slot_mask = ops.reshape(far.mask, i64_constant(0, -1, 1, 1, 1, far.block), True)  # [S, N, 1, 1, 1, B]
        far_top = _far_maximum(scores, slot_mask, far.block)  # [S, Hkv, G, W, 1]
        top = ops.maximum(far_top, ops.reduce_max(band, i64_constant(-1), True))
        scores = ops.exp(ops.subtract(ops.add(scores, slot_mask), ops.unsqueeze(top, i64_constant(1))))
        band = ops.exp(ops.subtract(band, top))
        total = ops.add(
            ops.reduce_sum(ops.reduce_sum(scores, i64_constant(5), True), i64_constant(1), False),
            ops.reduce_sum(band, i64_constant(-1), True),
        )
        far_context = ops.reduce_sum(ops.matmul(scores, values_far, False, False), i64_constant(1), False)
        context = ops.add(far_context, ops.matmul(band, values_band, False, False))
        context = ops.divide(context, total)  # [S, Hkv, G, W, D]
    context = ops.transpose(context, i64_constant(0, 3, 1, 2, 4))  # [S, W, Hkv, G, D]
    context = ops.reshape(context, i64_constant(-1, kv_heads * groups * head_dim), False)
    return ops.gather(context, row_cells, i64_constant(0))


def _far_maximum(scores: Node, slot_mask: Node, block: int) -> Node:
    """The row maximum over far keys [S, Hkv, G, W, 1] of block scores [S, N, Hkv, G, W, B], exact,
    without a masked copy of the scores.

    A stream's far keys are its first positions, so its blocks are full, then at most one partial
    block, then wholly masked padding. Full blocks are reduced as they are; only the partial block is
    taken out and masked. The slot mask can then join the subtraction and exp() in one pass over the
    scores instead of a pass of its own.
    """
    full_block = ops.reduce_min(slot_mask, i64_constant(5), True)  # [S, N, 1, 1, 1, 1]: 0 when every slot is a far key
    top = ops.reduce_max(ops.add(ops.reduce_max(scores, i64_constant(5), True), full_block), i64_constant(1), False)
    is_far_key = ops.convert(ops.equal(slot_mask, _f32(0.0)), "i64")
    far_keys = ops.reshape(ops.reduce_sum(is_far_key, i64_constant(1, 5), False), i64_constant(-1, 1), False)  # [S, 1]
    last = ops.maximum(
        ops.subtract(ops.divide(ops.add(far_keys, i64_constant(block - 1)), i64_constant(block)), i64_constant(1)),
        i64_constant(0),
    )
    last_scores = ops.gather(scores, last, i64_constant(1), 1)  # [S, 1, Hkv, G, W, B]
    last_mask = ops.gather(slot_mask, last, i64_constant(1), 1)  # [S, 1, 1, 1, 1, B]
    last_top = ops.reduce_max(ops.add(last_scores, last_mask), i64_constant(5), True)  # [S, 1, Hkv, G, W, 1]
    return ops.maximum(top, ops.squeeze(last_top, i64_constant(1)))


def rms_norm(x: Node, weight: np.ndarray, eps: float) -> Node:
    mean_square = ops.reduce_mean(ops.multiply(x, x), i64_constant(-1), keep_dims=True)
    inv = ops.divide(_f32(1.0), ops.sqrt(ops.add(mean_square, _f32(eps))))
    return ops.multiply(ops.multiply(x, inv), _f32(weight))


def linear(x: Node, weight: Weight, fmt: WeightFormat, name: str, compute: str = "f32") -> Node:
    """x [.., K] times `weight` [N, K] transposed, in `compute` arithmetic (x is already in it)."""
    return ops.matmul(x, _weight_in(weight, fmt, name, compute), transpose_a=False, transpose_b=True)


def stacked_linear(
    x: Node, weights: list[Weight], fmt: WeightFormat, name: str, compute: str = "f32"
) -> list[Node | ov.Output]:
    """x times each weight, as one matmul over the stacked rows split after it when they are stored alike.

    One compressed matmul instead of several: fewer nodes, each a thread hand-off per step.
    """
    stacked = stack_output_rows(weights)
    if stacked is None:
        return [linear(x, w, fmt, f"{name}.{n}", compute) for n, w in enumerate(weights)]
    sizes = ops.constant(np.array([w.shape[0] for w in weights], dtype=np.int64))
    return list(ops.variadic_split(linear(x, stacked, fmt, name, compute), i64_constant(-1), sizes).outputs())


def short_conv(x: Node, history: Node, index: Node, weight: np.ndarray) -> Node:
    """Causal depthwise conv over [history rows; this step's rows] plus the residual input.

    x [T, C], history [R, C], index [T, K] into the concatenation, weight [C, K].
    """
    extended = ops.concat([history, x], 0)
    window = ops.gather(extended, index, i64_constant(0))  # [T, K, C]
    taps = _f32(np.ascontiguousarray(weight.T))  # [K, C]
    return ops.add(ops.reduce_sum(ops.multiply(window, taps), i64_constant(1), keep_dims=False), x)


def attention_graph(
    shape: ModelShape,
    layer: LayerWeights,
    attention_fmt: WeightFormat,
    expert_fmt: WeightFormat | None,
    kv_type: str = "f32",
    ffn: FfnForm = FUSED_FFN,
) -> ov.Model:
    """Norm, attention with its convs, residual, post-attention norm and the FP32 router.

    With `expert_fmt` the experts, the MLP-output conv and the residual add join the same model
    (unless the experts need a compiled model of their own, `EngineSettings.split_expert_graph`).
    """
    i = layer.index
    a = shape.layer_attention(i)
    w = layer.attention
    h, k, d = shape.hidden_size, shape.conv_kernel_size, a.head_dim
    eps = shape.rms_norm_eps

    hidden = graph_input("hidden", [-1, h])
    hist_k = graph_input("conv_hist_k", [-1, a.kv_width])
    hist_v = graph_input("conv_hist_v", [-1, a.kv_width])
    hist_o = graph_input("conv_hist_o", [-1, h])
    conv_index = graph_input("conv_index", [-1, k], "i32")
    cell_rows = graph_input("cell_rows", [-1], "i32")
    row_cells = graph_input("row_cells", [-1], "i32")
    k_params, past_k = cached_rows("past_k", [-1, -1, a.num_kv_heads, d], kv_type)
    v_params, past_v = cached_rows("past_v", [-1, -1, a.num_kv_heads, d], kv_type)
    key_mask = graph_input("key_mask", [-1, -1])
    key_distance = graph_input("key_distance", [-1, -1], "i32")
    params = [hidden, hist_k, hist_v, hist_o, conv_index, cell_rows, row_cells, *k_params, *v_params]
    params += [key_mask, key_distance]
    far = None
    if a.window is None:
        far_params, far = far_inputs(a.num_kv_heads, d, KV_BLOCK, kv_type)
        params += far_params

    x = rms_norm(hidden, w.input_norm, eps)
    # one matmul for the four projections of the normed input: at one row each matmul is a thread hand-off
    projections = [w.q_proj, w.k_proj, w.v_proj, w.r_proj]
    q, k_out, v_out, r = stacked_linear(x, projections, attention_fmt, f"l{i}.qkvr")
    k_in, v_in = named_output(k_out, "k_conv_in"), named_output(v_out, "v_conv_in")

    q = rms_norm(ops.reshape(q, i64_constant(-1, a.num_heads, d), False), w.q_norm, eps)  # [T, Hq, D]
    keys_new = ops.reshape(short_conv(k_in, hist_k, conv_index, w.k_conv), i64_constant(-1, a.num_kv_heads, d), False)
    keys_new = named_output(rms_norm(keys_new, w.k_norm, eps), "new_k")  # [T, Hkv, D]
    values_new = named_output(
        ops.reshape(short_conv(v_in, hist_v, conv_index, w.v_conv), i64_constant(-1, a.num_kv_heads, d), False),
        "new_v",
    )

    # relative-position bias: one value per (row, head, distance), zero beyond the extent
    rel = ops.matmul(ops.reshape(r, i64_constant(-1, a.num_heads, shape.d_rel), False), _f32(w.rel_proj), False, False)
    clamped = ops.clamp(key_distance, 0, a.rel_extent - 1)
    distance_shape = ops.shape_of(clamped, "i64")
    heads_shape = ops.concat(
        [
            ops.gather(distance_shape, i64_constant(0), i64_constant(0)),
            i64_constant(a.num_heads),
            ops.gather(distance_shape, i64_constant(1), i64_constant(0)),
        ],
        0,
    )
    gather_index = ops.broadcast(ops.unsqueeze(clamped, i64_constant(1)), heads_shape)  # [T, Hq, L]
    bias = ops.gather_elements(rel, gather_index, 2)  # [T, Hq, L]
    in_extent = ops.logical_and(
        ops.greater_equal(key_distance, ops.constant(np.int32(0))),
        ops.less(key_distance, ops.constant(np.int32(a.rel_extent))),
    )
    bias = ops.select(ops.unsqueeze(in_extent, i64_constant(1)), bias, _f32(0.0))

    tau = None
    if a.kind == "global" and shape.log_scaling_n_floor is not None:
        query_position = graph_input("query_position", [-1])
        params.append(query_position)
        n_eff = ops.divide(ops.add(query_position, _f32(1.0)), _f32(float(shape.log_scaling_n_floor)))
        tau = ops.add(_f32(1.0), ops.multiply(_f32(shape.log_scaling_alpha), ops.log(ops.maximum(n_eff, _f32(1.0)))))

    # each stream's rows see its cached keys, then its rows of this step (the mask keeps them causal)
    context = segment_attention(
        q, keys_new, values_new, past_k, past_v, cell_rows, row_cells, key_mask,
        a.num_kv_heads, d, 1.0 / d, bias, tau, far,
    )  # fmt: skip
    o_in = named_output(linear(context, w.o_proj, attention_fmt, f"l{i}.o"), "o_conv_in")
    residual = named_output(ops.add(hidden, short_conv(o_in, hist_o, conv_index, w.attn_conv)), "residual")
    mlp_input = named_output(rms_norm(residual, layer.post_attention_norm, eps), "mlp_input")

    results = [k_in, v_in, o_in, keys_new, values_new]
    index, weight = _routing(shape, layer, mlp_input)
    if expert_fmt is None:
        results += [residual, mlp_input, named_output(index, "expert_index"), named_output(weight, "expert_weight")]
    else:
        params_e, results_e = _expert_block(
            shape, layer, mlp_input, index, weight, residual, conv_index, expert_fmt, ffn=ffn
        )
        params += params_e
        results += results_e
    return ov.Model([ops.result(n) for n in results], params, f"layer{i}_attention")


def _routing(shape: ModelShape, layer: LayerWeights, x: Node) -> tuple[Node, Node]:
    """Expert ids [T, n] and weights [T, n] for the layer's bank.

    MoE: FP32 logits, sigmoid scores, top-k on score + correction bias, then the chosen routed
    sigmoids and the shared experts' sigmoids normalised together (exp(logsigmoid) = sigmoid, so the
    log-sum-exp normalisation is a plain sum) times route_scale and the router's global_scale.
    Dense: every slice with the MLP's global scale.
    """
    rows = ops.gather(ops.shape_of(x, "i64"), i64_constant(0), i64_constant(0))
    if layer.router is None:
        n = layer.experts.gate.shape[0]
        shape_tn = ops.concat([rows, i64_constant(n)], 0)
        index = ops.broadcast(ops.constant(np.arange(n, dtype=np.int32)), shape_tn)
        weight = ops.broadcast(_f32(np.full(n, layer.dense_scale, dtype=np.float32)), shape_tn)
        return index, weight
    e, s, top_k = shape.n_routed_experts, shape.n_shared_experts, shape.num_experts_per_tok
    logits = ops.matmul(x, _f32(layer.router.weight), False, True)  # [T, e + s]
    scores = ops.sigmoid(logits)
    routed = ops.slice(scores, i64_constant(0), i64_constant(e), i64_constant(1), i64_constant(1))
    shared = ops.slice(scores, i64_constant(e), i64_constant(e + s), i64_constant(1), i64_constant(1))
    choice = ops.add(routed, _f32(layer.router.correction_bias))
    chosen = ops.topk(choice, ops.constant(np.int64(top_k)), 1, "max", "none", "i32").output(1)
    picked = ops.gather_elements(routed, chosen, 1)
    both = ops.concat([picked, shared], 1)
    scale = shape.route_scale * layer.router.global_scale
    weight = ops.multiply(ops.divide(both, ops.reduce_sum(both, i64_constant(1), keep_dims=True)), _f32(scale))
    shared_ids = ops.broadcast(
        ops.constant(np.arange(e, e + s, dtype=np.int32)), ops.concat([rows, i64_constant(s)], 0)
    )
    return ops.concat([chosen, shared_ids], 1), weight


def to_compute(x: Node | ov.Output, compute: str) -> Node | ov.Output:
    """`x` in the banks' arithmetic (`FfnForm.compute`); f32 nodes pass through.

    The CPU plugin's Convert to bf16 drops the low bits, so `x` is first rounded to nearest in f32
    (Veltkamp's split: with c = (2^16 + 1) x, c + (x - c) keeps the 8 leading bits of x, rounded as
    f32 arithmetic rounds, to even) and converts exactly.
    """
    if compute == "f32":
        return x
    spread = ops.multiply(x, _f32(float(2**16 + 1)))
    return ops.convert(ops.add(spread, ops.subtract(x, spread)), compute)


def bf16_rounded(values: np.ndarray) -> np.ndarray:
    """f32 values rounded to the nearest bf16 (ties to even), still as f32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32).reshape(values.shape)


def _weight_in(weight: Weight, fmt: WeightFormat, name: str, compute: str) -> Node | ov.Output:
    """`weight` as a node in `compute` arithmetic.

    f32 weights meant for bf16 are rounded to nearest on the host, so that the CPU plugin's Convert
    (folded into the constant), which drops the low bits, converts them exactly. Dropped bits in
    weights and activations had doubled the bf16 modes' error against the oracle.
    """
    if compute == "f32":
        return weight_node(weight, fmt, name)
    if isinstance(weight, np.ndarray) and fmt == "f32" and compute == "bf16":
        return ops.convert(ops.constant(bf16_rounded(weight), name=name), compute)
    return ops.convert(weight_node(weight, fmt, name), compute)


def _as_f32(x: Node | ov.Output, compute: str) -> Node | ov.Output:
    return x if compute == "f32" else ops.convert(x, "f32")


def _fused_experts(x: Node, index: Node, weight: Node, gate: Node, up: Node, down: Node, n: int, h: int) -> Node:
    """All experts of the bank in the vectorised form OpenVINO fuses into its MOE primitive.

    The graph reads as "every expert on every row, weighted by a dense routing matrix"; the plugin's
    MoE fusion turns it into a kernel that runs only each row's chosen experts. It computes in `x`'s
    element type (`weight` and the weights alike).
    """
    flat = ops.reshape(x, i64_constant(-1, h), False)
    tiled = ops.reshape(ops.tile(flat, i64_constant(n, 1)), i64_constant(n, -1, h), False)  # [E, T, H]
    gated = ops.multiply(swish(ops.matmul(tiled, gate, False, True)), ops.matmul(tiled, up, False, True))
    expert_out = ops.reshape(ops.matmul(gated, down, False, True), i64_constant(n, 1, -1, h), False)  # [E, 1, T, H]
    rows = ops.gather(ops.shape_of(flat, "i64"), i64_constant(0), i64_constant(0))
    dense = ops.broadcast(ops.convert_like(_f32(0.0), x), ops.concat([rows, i64_constant(n)], 0))
    routing = ops.scatter_elements_update(dense, index, weight, ops.constant(np.int64(1)), "none")
    routing = ops.unsqueeze(
        ops.reshape(ops.transpose(routing, i64_constant(1, 0)), i64_constant(n, 1, -1), False), i64_constant(3)
    )
    combined = ops.reduce_sum(ops.multiply(expert_out, routing), i64_constant(0), keep_dims=False)  # [1, T, H]
    return ops.reshape(combined, i64_constant(-1, h), False)


def _expert_ranks(flat_ids: Node, n: int) -> tuple[Node, Node]:
    """For pairs choosing experts `flat_ids` [P]: each pair's rank among the pairs that chose its
    expert, in pair order [P], and each expert's count [E].

    Cumulative sums over a [P, E] one-hot, where a stable sort of the pairs (a TopK over all of them)
    took 1.4x as long for the whole bank at 512 rows.
    """
    chose = ops.convert(
        ops.equal(ops.unsqueeze(flat_ids, i64_constant(1)), ops.constant(np.arange(n, dtype=np.int32))), "i32"
    )
    counts = ops.reduce_sum(chose, i64_constant(0), keep_dims=False)
    before = ops.cumsum(chose, ops.constant(np.int64(0)), exclusive=True)  # [P, E] earlier pairs per expert
    rank = ops.reduce_sum(ops.multiply(before, chose), i64_constant(1), keep_dims=False)
    return rank, counts


def _grouped_experts(
    x: Node, index: Node, weight: Node, bank: ExpertWeights, fmt: WeightFormat, name: str, compute: str = "f32"
) -> Node:
    """The bank with each expert's rows gathered into one matmul per expert.

    The step's (row, expert) pairs are ordered by expert (a stable counting sort) and cut into one
    block per expert, however many rows chose it (none is an empty block). An expert's weights are
    then read once per step, where a kernel that runs a matrix-vector product per pair reads them
    once per row. The activation and the routing weight run once over all pairs between the two
    matmuls, and each row's outputs are summed back into it with one scatter. With `compute` bf16
    the matmuls take bf16 inputs; the activation, the routing weights and the sum stay in f32.
    """
    flat_ids = ops.reshape(index, i64_constant(-1), False)  # [P] expert of each pair, row-major
    n = bank.gate.shape[0]
    rank, counts = _expert_ranks(flat_ids, n)
    starts = ops.cumsum(counts, ops.constant(np.int64(0)), exclusive=True)
    sorted_slot = ops.add(ops.gather(starts, flat_ids, i64_constant(0)), rank)  # [P] where each pair goes
    pairs = ops.squeeze(ops.shape_of(flat_ids, "i32"), i64_constant(0))
    pair_range = ops.range(ops.constant(np.int32(0)), pairs, ops.constant(np.int32(1)), "i32")  # [P]
    order = ops.scatter_elements_update(
        ops.broadcast(ops.constant(np.int32(0)), ops.shape_of(flat_ids, "i64")),
        sorted_slot,
        pair_range,
        i64_constant(0),
    )  # [P] the pair at each sorted position
    per_row = ops.gather(ops.shape_of(index, "i32"), i64_constant(1), i64_constant(0))  # [1]
    rows = ops.divide(order, per_row)  # [P] the row of each sorted pair

    def per_expert(pairs_in: Node, weights: list[Weight], part: str) -> Node:
        blocks = ops.variadic_split(pairs_in, i64_constant(0), counts)
        outputs = []
        for e in range(n):
            sliced = [expert_slice(w, e) for w in weights]
            stacked = stack_output_rows(sliced)
            if stacked is not None:
                outputs.append(linear(blocks.output(e), stacked, fmt, f"{name}.{e}.{part}", compute))
            else:  # stored unlike: one matmul each, side by side
                parts = [
                    linear(blocks.output(e), w, fmt, f"{name}.{e}.{part}.{k}", compute) for k, w in enumerate(sliced)
                ]
                outputs.append(ops.concat(parts, 1))
        return ops.concat(outputs, 0)

    gate_up = per_expert(
        ops.gather(to_compute(x, compute), rows, i64_constant(0)), [bank.gate, bank.up], "gate_up"
    )  # [P, 2I]
    gated, lifted = ops.split(_as_f32(gate_up, compute), ops.constant(np.int64(1)), 2).outputs()
    pair_weight = ops.gather(ops.reshape(weight, i64_constant(-1), False), order, i64_constant(0))
    mixed = ops.multiply(ops.multiply(swish(gated), lifted), ops.unsqueeze(pair_weight, i64_constant(1)))
    outputs = _as_f32(per_expert(to_compute(mixed, compute), [bank.down], "down"), compute)  # [P, H]
    zeros = ops.broadcast(_f32(0.0), ops.shape_of(x, "i64"))
    return ops.scatter_nd_update(zeros, ops.unsqueeze(rows, i64_constant(1)), outputs, "sum")


def _vnni_experts(x: Node, index: Node, weight: Node, bank: ExpertWeights) -> Node:
    """The bank on the project's int8 CPU kernel, its weights quantised as the int8 format stores them."""
    gate, up, down = (w if isinstance(w, Quantized) else quantize(w, "int8") for w in (bank.gate, bank.up, bank.down))
    gate_up = np.concatenate([gate.values, up.values], axis=1)  # [E, 2I, H]: gate rows, then up rows
    gate_up_scale = np.concatenate([gate.scale, up.scale], axis=1)[..., 0]
    return cpu_kernels.expert_bank(
        _output(x), _output(index), _output(weight), gate_up, gate_up_scale, down.values, down.scale[..., 0]
    )


def _output(x: Node | ov.Output) -> ov.Output:
    return x.output(0) if isinstance(x, ov.Node) else x


def _bank_form(bank: ExpertWeights, fmt: WeightFormat, ffn: FfnForm) -> str:
    """The form of a bank: its weights' stored format (as read, else as the settings store them) picks it.

    The int8 kernel takes per-channel int8 weights whose sizes fit its groups, on a CPU that runs it;
    any other bank it would be given runs grouped.
    """
    stored = bank.gate.fmt if isinstance(bank.gate, Quantized) else fmt
    form = ffn.experts if stored == "f32" else ffn.compressed_experts
    if form == "vnni":
        hidden, inner = bank.gate.shape[2], bank.gate.shape[1]
        usable = stored == "int8" and cpu_kernels.fits(hidden, inner) and cpu_kernels.expert_bank_available()
        return "vnni" if usable else "grouped"
    return form


def _expert_bank(
    x: Node, index: Node, weight: Node, bank: ExpertWeights, fmt: WeightFormat, ffn: FfnForm, i: int, h: int
) -> Node:
    """The experts `index` names for each row, weighted, in the form `ffn` gives the bank, in f32."""
    form, compute = _bank_form(bank, fmt, ffn), ffn.compute
    if form == "vnni":
        return _vnni_experts(x, index, weight, bank)
    if form == "grouped":
        return _grouped_experts(x, index, weight, bank, fmt, f"l{i}.experts", compute)
    gate, up, down = (
        _weight_in(w, fmt, f"l{i}.experts.{part}", compute)
        for w, part in ((bank.gate, "gate"), (bank.up, "up"), (bank.down, "down"))
    )
    x_in, weight_in = to_compute(x, compute), to_compute(weight, compute)
    return _as_f32(_fused_experts(x_in, index, weight_in, gate, up, down, bank.gate.shape[0], h), compute)


def _all_active(
    x: Node,
    bank: ExpertWeights,
    slice_weight: Node | None,
    fmt: WeightFormat,
    name: str,
    compute: str = "f32",
    scale: float = 1.0,
) -> Node:
    """Slices every row runs ([S, I, H] gate and up, [S, H, I] down) as plain matmuls over the joined
    slices, the matmuls in `compute` arithmetic, what lies between them and the output in f32.

    With `slice_weight` [T, S], each slice's activations are scaled by its row's weight before the
    joined down projection, which then sums the weighted slices. `scale` (a dense layer's global
    scale) multiplies the activations before the down projection too: after it, the CPU plugin folds
    the constant into the projection's weights, which materialises them in f32 (604 MB for one
    dense layer of the 975B model, beside its 113 MB of int4).
    """
    joined = [join_output_rows(bank.gate), join_output_rows(bank.up)]
    gate_out, up_out = stacked_linear(to_compute(x, compute), joined, fmt, f"{name}.gate_up", compute)
    mixed = ops.multiply(swish(_as_f32(gate_out, compute)), _as_f32(up_out, compute))  # [T, S * I], slice-major
    if slice_weight is not None:
        slices, width = bank.gate.shape[0], bank.gate.shape[1]
        per_slice = ops.reshape(mixed, i64_constant(0, slices, width), True)
        mixed = ops.reshape(
            ops.multiply(per_slice, ops.unsqueeze(slice_weight, i64_constant(2))), i64_constant(0, -1), True
        )
    if scale != 1.0:
        mixed = ops.multiply(mixed, _f32(scale))
    down = join_input_columns(bank.down)
    return _as_f32(linear(to_compute(mixed, compute), down, fmt, f"{name}.down", compute), compute)


def _joinable(down: Weight) -> bool:
    """Whether a bank's down projections can run joined as one matmul: f32, or stored so that each
    row has one scale across the slices (`cascadia.model.checkpoint` stores int8 so for that form)."""
    if isinstance(down, np.ndarray):
        return True
    try:
        join_input_columns(down)
    except ValueError:
        return False
    return True


def _expert_block(
    shape: ModelShape,
    layer: LayerWeights,
    x: Node,
    index: Node,
    weight: Node,
    residual: Node | None,
    conv_index: Node | None,
    fmt: WeightFormat,
    out_scale: float = 1.0,
    ffn: FfnForm = FUSED_FFN,
) -> tuple[list[Node], list[Node]]:
    """Experts, then (when `residual` is given) the MLP-output conv and the residual add.

    A dense layer's bank runs as all-active slices, or with `ffn.dense="matmul"` as three plain
    matmuls over the joined slices (then `index` and `weight` are not read). With `ffn.dense="matmul"`
    a sparse layer's shared experts, the last columns of `index` as the router lays them out, run the
    same way beside the routed bank. Banks run in the form `ffn.experts` names.
    """
    i, h = layer.index, shape.hidden_size
    bank = layer.experts
    if out_scale != 1.0:
        bank = replace(bank, down=scaled_by_power_of_two(bank.down, out_scale))
    if layer.router is None and ffn.dense == "matmul":
        mixed = _all_active(x, bank, None, fmt, f"l{i}", ffn.compute, layer.dense_scale)
    elif (
        layer.router is not None
        and ffn.dense == "matmul"
        and _joinable(expert_range(bank.down, shape.n_routed_experts, None))
    ):
        # the shared experts every row runs: plain matmuls beside the routed bank
        e, top_k = shape.n_routed_experts, shape.num_experts_per_tok
        routed_index = ops.slice(index, i64_constant(0), i64_constant(top_k), i64_constant(1), i64_constant(1))
        routed_weight = ops.slice(weight, i64_constant(0), i64_constant(top_k), i64_constant(1), i64_constant(1))
        shared_weight = ops.slice(weight, i64_constant(top_k), i64_constant(2**62), i64_constant(1), i64_constant(1))
        routed_bank = ExpertWeights(*(expert_range(w, 0, e) for w in (bank.gate, bank.up, bank.down)))
        if _bank_form(bank, fmt, ffn) == "fused":
            # the fused kernel takes the whole bank, as its index never names a shared expert: a constant of
            # the whole bank shares the memory its reader filled, where one of a slice would be a copy
            routed_bank = bank
        shared_bank = ExpertWeights(*(expert_range(w, e, None) for w in (bank.gate, bank.up, bank.down)))
        routed = _expert_bank(x, routed_index, routed_weight, routed_bank, fmt, ffn, i, h)
        shared = _all_active(x, shared_bank, shared_weight, fmt, f"l{i}.shared", ffn.compute)
        mixed = ops.add(routed, shared)
    else:
        mixed = _expert_bank(x, index, weight, bank, fmt, ffn, i, h)
    if residual is None:
        return [], [named_output(mixed, "expert_out")]
    if layer.mlp_conv is None:  # Llama-family: the FFN output joins the residual directly
        return [], [named_output(ops.add(residual, mixed), "hidden_out")]
    hist_m = graph_input("conv_hist_m", [-1, h])
    m_in = named_output(mixed, "m_conv_in")
    out = named_output(ops.add(residual, short_conv(mixed, hist_m, conv_index, layer.mlp_conv)), "hidden_out")
    return [hist_m], [m_in, out]


def expert_graph(
    shape: ModelShape, layer: LayerWeights, fmt: WeightFormat, out_scale: float, ffn: FfnForm = FUSED_FFN
) -> ov.Model:
    """Experts alone, for a compute precision other than the residual stream's.

    Down-projection weights are pre-multiplied by `out_scale` (a power of two) so f16 arithmetic
    cannot overflow; `post_graph` undoes it in f32.
    """
    h = shape.hidden_size
    x = graph_input("mlp_input", [-1, h])
    index = graph_input("expert_index", [-1, -1], "i32")
    weight = graph_input("expert_weight", [-1, -1])
    _, results = _expert_block(shape, layer, x, index, weight, None, None, fmt, out_scale, ffn)
    return ov.Model([ops.result(n) for n in results], [x, index, weight], f"layer{layer.index}_experts")


def post_graph(shape: ModelShape, layer: LayerWeights, out_scale: float) -> ov.Model:
    """Undo the experts' power-of-two scale, then the MLP-output conv (if any) and the residual add, in f32."""
    h, k = shape.hidden_size, shape.conv_kernel_size
    expert_out = graph_input("expert_out", [-1, h])
    residual = graph_input("residual", [-1, h])
    mixed = named_output(ops.multiply(expert_out, _f32(1.0 / out_scale)), "m_conv_in")
    if layer.mlp_conv is None:
        out = named_output(ops.add(residual, mixed), "hidden_out")
        return ov.Model([ops.result(out)], [expert_out, residual], f"layer{layer.index}_post")
    hist_m = graph_input("conv_hist_m", [-1, h])
    conv_index = graph_input("conv_index", [-1, k], "i32")
    out = named_output(ops.add(residual, short_conv(mixed, hist_m, conv_index, layer.mlp_conv)), "hidden_out")
    return ov.Model(
        [ops.result(mixed), ops.result(out)],
        [expert_out, residual, hist_m, conv_index],
        f"layer{layer.index}_post",
    )


def embed_rows(ids: Node, embed: Weight, embed_norm: np.ndarray | None, eps: float, fmt: WeightFormat) -> Node:
    """Embedding rows of `ids`, normed when the model norms them (Inkling does, Llama does not)."""
    rows = ops.gather(weight_node(embed, fmt, "embed"), ids, i64_constant(0))
    return rows if embed_norm is None else rms_norm(rows, embed_norm, eps)


def embed_graph(embed: Weight, embed_norm: np.ndarray | None, eps: float, fmt: WeightFormat) -> ov.Model:
    ids = graph_input("input_ids", [-1], "i32")
    out = named_output(embed_rows(ids, embed, embed_norm, eps, fmt), "hidden")
    return ov.Model([ops.result(out)], [ids], "embed")


def head_graph(
    shape: ModelShape,
    final_norm: np.ndarray | None,
    head: Weight,
    fmt: WeightFormat,
    vocab: int | None = None,
    compute: str = "f32",
) -> ov.Model:
    """Final norm, division by the muP width multiplier, head, and the slice to the first `vocab` ids
    (default: the unpadded vocabulary). The MTP head's draft logits use it with no norm."""
    hidden = graph_input("hidden", [-1, shape.hidden_size])
    logits = head_logits(shape, hidden, final_norm, head, fmt, vocab, compute)
    return ov.Model([ops.result(named_output(logits, "logits"))], [hidden], "head")


def head_logits(
    shape: ModelShape,
    x: Node,
    final_norm: np.ndarray | None,
    head: Weight,
    fmt: WeightFormat,
    vocab: int | None = None,
    compute: str = "f32",
) -> Node:
    """The nodes of `head_graph` on final states `x`: the norm and the logits in f32, the head's matmul
    in `compute` arithmetic when the head is stored in f32 (its constant then holds bf16 values). A
    head stored compressed keeps f32 arithmetic: the CPU decompresses it faster to f32 (SmolLM2's
    u8-block head in bf16 decoded 64 tok/s against 69)."""
    if isinstance(head, Quantized) or fmt != "f32":
        compute = "f32"
    if final_norm is not None:
        x = rms_norm(x, final_norm, shape.rms_norm_eps)
    if shape.logits_mup_width_multiplier != 1.0:
        x = ops.divide(x, _f32(shape.logits_mup_width_multiplier))
    vocab = shape.unpadded_vocab_size if vocab is None else vocab
    if vocab < head.shape[0]:
        head = head[:vocab] if isinstance(head, np.ndarray) else head.map_blocks(lambda a: a[:vocab])
    return _as_f32(linear(to_compute(x, compute), head, fmt, "head", compute), compute)


def mtp_input_graph(
    shape: ModelShape,
    hidden_norm: np.ndarray,
    embed_norm: np.ndarray,
    input_proj: np.ndarray,
    trunk_norm: np.ndarray | None,
    fmt: WeightFormat,
) -> ov.Model:
    """One MTP depth's input: `input_proj(cat[hidden_norm(prev), embed_norm(embedded)])`.

    `prev` is the trunk's final state for depth 0 (normed here by `trunk_norm`, the trunk's final
    norm, without the muP division) and the previous depth's raw block output after that;
    `embedded` is the trunk's normed embedding of the token one step ahead.
    """
    h, eps = shape.hidden_size, shape.rms_norm_eps
    prev = graph_input("prev", [-1, h])
    embedded = graph_input("embedded", [-1, h])
    x = prev if trunk_norm is None else rms_norm(prev, trunk_norm, eps)
    parts = [rms_norm(x, hidden_norm, eps), rms_norm(embedded, embed_norm, eps)]
    if not shape.mtp_hidden_states_first:
        parts.reverse()
    joined = ops.concat(parts, axis=-1)
    out = linear(joined, input_proj, fmt, "input_proj")
    return ov.Model([ops.result(named_output(out, "block_input"))], [prev, embedded], "mtp_input")


def dense_mlp_graph(shape: ModelShape, layer: LayerWeights, dense_ffn: str) -> ov.Model:
    """A dense layer's MLP alone in either form (all-active slices through the fused kernel or plain matmuls)."""
    x = graph_input("mlp_input", [-1, shape.hidden_size])
    index, weight = _routing(shape, layer, x)
    ffn = FfnForm(dense="matmul" if dense_ffn == "matmul" else "experts", experts="fused")
    _, results = _expert_block(shape, layer, x, index, weight, None, None, "f32", ffn=ffn)
    return ov.Model([ops.result(n) for n in results], [x], f"dense_{dense_ffn}")
