"""Fleet planning: which contiguous layers go on which node, and what that costs in memory and time.

Pure functions only (no OpenVINO, no I/O): shared by `cascadia plan` and the operator. Layer ranges
are half-open, [start_layer, end_layer). Node 0 also holds the embedding; the last node also holds
the final norm and the head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from cascadia import defaults
from cascadia.kv_layout import KV_BLOCK, bytes_per_element, cache_blocks, far_blocks_for
from cascadia.model.config import ModelShape, shape_from_config
from cascadia.model.formats import WeightFormat, stored_bytes

if TYPE_CHECKING:
    from cascadia.engine.settings import EngineSettings

GIB = 2**30
ROW_BYTES_PER_HIDDEN = 4  # the residual stream travels as FP32

PRESET_CONFIGS: dict[str, dict] = {
    # The published 975B-total / 41B-active Inkling text model.
    "inkling-975b": {
        "vocab_size": 201024,
        "unpadded_vocab_size": 200058,
        "hidden_size": 6144,
        "num_hidden_layers": 66,
        "dense_mlp_idx": 2,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "swa_num_attention_heads": 64,
        "swa_num_key_value_heads": 16,
        "swa_head_dim": 128,
        "sliding_window_size": 512,
        "rel_extent": 1024,
        "d_rel": 16,
        "intermediate_size": 24576,
        "moe_intermediate_size": 3072,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
    },
    # Inkling-Small, 276B total / 12B active, as its published config describes it.
    "inkling-small-276b": {
        "vocab_size": 201024,
        "unpadded_vocab_size": 200058,
        "hidden_size": 4096,
        "num_hidden_layers": 42,
        "dense_mlp_idx": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "swa_num_attention_heads": 32,
        "swa_num_key_value_heads": 8,
        "swa_head_dim": 128,
        "sliding_window_size": 512,
        "rel_extent": 1024,
        "d_rel": 16,
        "intermediate_size": 16384,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "logits_mup_width_multiplier": 16.0,
        "log_scaling_n_floor": 128000,
        "log_scaling_alpha": 0.1,
        "max_position_embeddings": 1048576,
    },
}


class PlanError(ValueError):
    """A fleet that cannot hold the model, or a request the planner cannot meet; says why."""


@dataclass(frozen=True)
class PlanRequest:
    nodes: tuple[str, ...]
    node_memory: int  # usable bytes per node
    expert_weights: WeightFormat = "int4"
    attention_weights: WeightFormat = "int8"
    head_weights: WeightFormat = "int8"
    layers_per_node: int | None = None
    streams: int = defaults.PLANNED_STREAMS  # concurrent streams the KV budget is sized for
    # streams a shard steps together (at most the router's rows per group); None: all of them, as in
    # one frame of every stream on a one-machine chain
    streams_per_step: int | None = None
    context: int = 1024  # global-layer positions per stream
    rewind_slack: int = 32
    runtime_overhead: int = 2 * GIB  # OpenVINO runtime, activations, buffers per node
    kv_precision: str = "f32"  # keys and values as cached: f32, f16 or u8
    # the device the shards run on (the fleet's iGPU unless told): its plugin's copy of the weights takes
    # what `stage_plugin_copy_bytes` says
    device: str = "GPU"

    @classmethod
    def from_settings(cls, nodes: tuple[str, ...], node_memory: int, settings: EngineSettings, **kw) -> PlanRequest:
        return cls(
            nodes,
            node_memory,
            settings.expert_weights,
            settings.attention_weights,
            settings.head_weights,
            context=settings.context,
            rewind_slack=settings.rewind_slack,
            kv_precision=settings.kv_precision,
            **{"device": settings.device, **kw},
        )


@dataclass(frozen=True)
class StagePlan:
    node: str
    start_layer: int
    end_layer: int
    weight_bytes: int
    kv_bytes: int
    overhead_bytes: int
    far_stack_bytes: int = 0
    plugin_copy_bytes: int = 0  # what the device plugin's copy of the weights takes beyond their stored size

    @property
    def state_bytes(self) -> int:
        """What the stage holds for stream state: `kv_bytes` and the far blocks kept between steps."""
        return self.kv_bytes + self.far_stack_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.plugin_copy_bytes + self.state_bytes + self.overhead_bytes


@dataclass(frozen=True)
class FleetPlan:
    stages: tuple[StagePlan, ...]
    node_memory: int
    mode: str  # "fixed" or "balanced"
    note: str

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.start_layer, s.end_layer) for s in self.stages]


def preset_shape(name: str) -> ModelShape:
    if name not in PRESET_CONFIGS:
        raise PlanError(f"unknown preset '{name}' (choose from {', '.join(PRESET_CONFIGS)})")
    return shape_from_config(PRESET_CONFIGS[name])


def layer_weight_bytes(shape: ModelShape, layer: int, request: PlanRequest) -> int:
    """Resident bytes of one decoder layer at the requested weight formats."""
    a = shape.layer_attention(layer)
    h = shape.hidden_size
    fmt = request.attention_weights
    total = sum(
        stored_bytes(s, fmt)
        for s in ((a.q_width, h), (a.kv_width, h), (a.kv_width, h), (a.num_heads * shape.d_rel, h), (h, a.q_width))
    )
    # norms, convs, relative-bias bank: kept in f32
    total += 4 * (2 * h + 2 * a.head_dim + 2 * h * shape.conv_kernel_size + 2 * a.kv_width * shape.conv_kernel_size)
    total += 4 * shape.d_rel * a.rel_extent
    if shape.is_dense(layer):
        total += 3 * stored_bytes((shape.intermediate_size, h), request.expert_weights)
    else:
        experts = shape.n_routed_experts + shape.n_shared_experts
        total += 3 * experts * stored_bytes((shape.moe_intermediate_size, h), request.expert_weights)
        total += 4 * (experts * h + shape.n_routed_experts)  # f32 router
    return total


def _params_stored_as(shape: ModelShape, layer: int, request: PlanRequest, fmt: WeightFormat) -> int:
    """Weights of a layer's matmuls stored in `fmt`."""
    a = shape.layer_attention(layer)
    h = shape.hidden_size
    attention = a.q_width * h + 2 * a.kv_width * h + a.num_heads * shape.d_rel * h + h * a.q_width
    if shape.is_dense(layer):
        experts = 3 * shape.intermediate_size * h
    else:
        experts = 3 * (shape.n_routed_experts + shape.n_shared_experts) * shape.moe_intermediate_size * h
    return (attention if request.attention_weights == fmt else 0) + (experts if request.expert_weights == fmt else 0)


# bytes the CPU plugin holds per weight beyond its stored size: int4 scales widened from f16 to f32 (2
# bytes per group of 32); f16 weights held as f32, twice (8 bytes where 2 are stored: a 2-layer stage at
# the 975B model's width held 9.5 GB for 2.1 GB of f16 weights, an f32 one 4.4 GB for 4.2 GB)
CPU_COPY_EXTRA = {"int4": 2 / 32, "f16": 6.0}


def stage_plugin_copy_bytes(shape: ModelShape, start: int, end: int, request: PlanRequest) -> int:
    """What the device plugin's own copy of the stage's weights takes beyond their stored size.

    Both plugins copy the weights they compute with into memory of their own when they compile (the
    CPU plugin repacks every matmul's and the MoE kernel's weights, measured as the anonymous memory a
    stage holds; the iGPU plugin uploads them), after which the mapped weight files are mostly not read
    again and the kernel drops their pages under pressure: the copy takes their place rather than adding
    to them. On the CPU the copy is larger than what is stored for int4 (scales in f32) and f16 (the
    weights in f32, twice: `CPU_COPY_EXTRA`); the embedding, a gather, stays mapped.
    """
    if not request.device.upper().startswith("CPU"):
        return 0
    extra = 0.0
    for fmt, per_weight in CPU_COPY_EXTRA.items():
        params = sum(_params_stored_as(shape, i, request, fmt) for i in range(start, end))
        if end == shape.num_layers and request.head_weights == fmt:
            params += shape.unpadded_vocab_size * shape.hidden_size
        extra += params * per_weight
    return round(extra)


def _position_bytes(shape: ModelShape, layer: int, request: PlanRequest) -> float:
    """Key and value bytes of one position of one layer (a u8 row's scale and offset included)."""
    a = shape.layer_attention(layer)
    return 2 * a.kv_width * bytes_per_element(request.kv_precision, a.head_dim)


def layer_kv_bytes(shape: ModelShape, layer: int, request: PlanRequest) -> int:
    """State bytes one layer holds for the planned streams: KV rows and the four conv histories.

    Counted as a shard told the planned streams (`cascadia shard --streams`, as the operator starts
    them) allocates them: a global layer's cache in whole blocks of its budget, and sliding rings and
    conv histories in pools of one slot per planned stream.
    """
    a = shape.layer_attention(layer)
    per_position = _position_bytes(shape, layer, request)
    conv_rows = shape.conv_kernel_size - 1 + request.rewind_slack if shape.has_convs else 0
    ring = conv_rows * (2 * a.kv_width + 2 * shape.hidden_size) * 4
    cache = 0
    if a.window is None:
        cache = round(cache_blocks(request.context) * KV_BLOCK * per_position)
    else:
        ring += round((a.window - 1 + request.rewind_slack) * per_position)
    return request.streams * (ring + cache)


def stage_far_stack_bytes(shape: ModelShape, start: int, end: int, request: PlanRequest) -> int:
    """The far keys and values a stage keeps from one step to the next (`FarStack`): a second copy of
    the global layers' far blocks of the streams stepping together, once they have used their budget.

    A lone stream's far blocks are read in place, and a context within the relative-bias band has none.
    """
    together = request.streams if request.streams_per_step is None else min(request.streams, request.streams_per_step)
    global_layers = [i for i in range(start, end) if shape.layer_attention(i).window is None]
    if together < 2 or not global_layers:
        return 0
    band = 0 if shape.family == "llama" else max(shape.layer_attention(i).rel_extent for i in global_layers) - 1
    far_keys = request.context - 1 - band  # the keys before the band of a row at the last position
    if far_keys <= 0:
        return 0
    positions = far_blocks_for(far_keys) * KV_BLOCK
    return together * sum(round(positions * _position_bytes(shape, i, request)) for i in global_layers)


def _edge_bytes(shape: ModelShape, request: PlanRequest) -> tuple[int, int]:
    h = shape.hidden_size
    embed = stored_bytes((shape.vocab_size, h), request.head_weights) + 4 * h
    head = stored_bytes((shape.unpadded_vocab_size, h), request.head_weights) + 4 * h
    return embed, head


def plan_stage(shape: ModelShape, request: PlanRequest, node: str, start: int, end: int) -> StagePlan:
    """What layers [start, end) on `node` hold: weights, the plugin's copy, stream state, runtime."""
    embed, head = _edge_bytes(shape, request)
    weights = sum(layer_weight_bytes(shape, i, request) for i in range(start, end))
    weights += embed if start == 0 else 0
    weights += head if end == shape.num_layers else 0
    kv = sum(layer_kv_bytes(shape, i, request) for i in range(start, end))
    stacks = stage_far_stack_bytes(shape, start, end, request)
    copies = stage_plugin_copy_bytes(shape, start, end, request)
    return StagePlan(node, start, end, weights, kv, request.runtime_overhead, stacks, copies)


def _check_fits(stages: list[StagePlan], memory: int) -> None:
    over = [s for s in stages if s.total_bytes > memory]
    if over:
        worst = max(over, key=lambda s: s.total_bytes)
        raise PlanError(
            f"{len(over)} node(s) exceed their {memory / GIB:.1f} GiB: {worst.node} needs "
            f"{worst.total_bytes / GIB:.1f} GiB for layers {worst.start_layer}:{worst.end_layer} "
            f"({worst.weight_bytes / GIB:.1f} GiB weights, {worst.plugin_copy_bytes / GIB:.1f} GiB plugin copies, "
            f"{worst.state_bytes / GIB:.1f} GiB KV, "
            f"{worst.overhead_bytes / GIB:.1f} GiB runtime)"
        )


def plan_fleet(shape: ModelShape, request: PlanRequest) -> FleetPlan:
    """Place contiguous layer ranges on the request's nodes, or fail saying why the model does not fit."""
    nodes, layers = request.nodes, shape.num_layers
    if not nodes:
        raise PlanError("the fleet has no nodes")
    if request.node_memory <= request.runtime_overhead:
        raise PlanError(
            f"node memory {request.node_memory / GIB:.1f} GiB leaves nothing after the "
            f"{request.runtime_overhead / GIB:.1f} GiB runtime overhead"
        )
    if request.layers_per_node is not None:
        k = request.layers_per_node
        if k < 1:
            raise PlanError(f"layers_per_node must be >= 1, got {k}")
        needed = math.ceil(layers / k)
        if needed > len(nodes):
            raise PlanError(f"{layers} layers at {k} per node need {needed} nodes; the fleet has {len(nodes)}")
        stages = [plan_stage(shape, request, nodes[i], i * k, min((i + 1) * k, layers)) for i in range(needed)]
        _check_fits(stages, request.node_memory)
        return FleetPlan(tuple(stages), request.node_memory, "fixed", f"{k} layers per node on {needed} nodes")
    return _balanced(shape, request)


def _balanced(shape: ModelShape, request: PlanRequest) -> FleetPlan:
    """Contiguous split minimising the largest node's resident bytes (DP over split points)."""
    nodes, layers = request.nodes, shape.num_layers
    count = min(len(nodes), layers)
    cost = {}

    def node_bytes(start: int, end: int) -> int:
        key = (start, end)
        if key not in cost:
            cost[key] = plan_stage(shape, request, "", start, end).total_bytes
        return cost[key]

    inf = float("inf")
    # best[j][e]: smallest achievable maximum over the first j nodes holding layers [0, e)
    best = [[inf] * (layers + 1) for _ in range(count + 1)]
    cut = [[0] * (layers + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for j in range(1, count + 1):
        for e in range(j, layers + 1):
            for s in range(j - 1, e):
                if best[j - 1][s] == inf:
                    continue
                value = max(best[j - 1][s], node_bytes(s, e))
                if value < best[j][e]:
                    best[j][e], cut[j][e] = value, s
    bounds, e = [], layers
    for j in range(count, 0, -1):
        s = cut[j][e]
        bounds.append((s, e))
        e = s
    bounds.reverse()
    stages = [plan_stage(shape, request, nodes[i], s, e) for i, (s, e) in enumerate(bounds)]
    _check_fits(stages, request.node_memory)
    sizes = [e - s for s, e in bounds]
    even = layers / count
    if len(set(sizes)) == 1:
        note = f"balanced by resident bytes: {sizes[0]} layers on each of {count} nodes"
    else:
        heavy = [s.node for s, n in zip(stages, sizes, strict=True) if n < even]
        light = [s.node for s, n in zip(stages, sizes, strict=True) if n > even]
        note = (
            f"balanced by resident bytes: layer counts {sizes}; nodes holding lighter layers (dense layers, or "
            f"none of the embedding/head) take more ({', '.join(light)}), nodes with heavier ones fewer "
            f"({', '.join(heavy)})"
        )
    return FleetPlan(tuple(stages), request.node_memory, "balanced", note)


def stage_step_bytes(shape: ModelShape, stage: StagePlan, request: PlanRequest, rows: int) -> float:
    """Weight bytes a stage reads to advance `rows` rows by one token (each distinct expert once)."""
    h = shape.hidden_size
    total = 0.0
    for i in range(stage.start_layer, stage.end_layer):
        full = layer_weight_bytes(shape, i, request)
        if shape.is_dense(i):
            total += full
            continue
        one = 3 * stored_bytes((shape.moe_intermediate_size, h), request.expert_weights)
        experts = shape.n_routed_experts + shape.n_shared_experts
        distinct = shape.n_routed_experts * (1 - (1 - shape.num_experts_per_tok / shape.n_routed_experts) ** rows)
        total += full - one * experts + one * (distinct + shape.n_shared_experts)
    if stage.end_layer == shape.num_layers:
        total += _edge_bytes(shape, request)[1]
    return total


def floor_throughput(
    shape: ModelShape,
    plan: FleetPlan,
    request: PlanRequest,
    streams: int,
    bandwidth: float,
    link_bytes_per_s: float = 125e6,
) -> float:
    """Bandwidth-floor decode tok/s for `streams` streams, one group per stage in flight.

    With N stages and the streams split into N groups of r rows, every tick each stage advances
    one group, and one group (r tokens) leaves the last stage: tok/s = r / tick, where the tick is
    the slowest stage's read time plus the FP32 rows' time on the link.
    """
    n = len(plan.stages)
    rows = max(1, math.ceil(streams / n))
    hop = rows * shape.hidden_size * ROW_BYTES_PER_HIDDEN / link_bytes_per_s
    tick = max(stage_step_bytes(shape, s, request, rows) / bandwidth for s in plan.stages) + hop
    groups = min(n, math.ceil(streams / rows))
    return rows * groups / (n * tick)


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """A Kubernetes-style quantity ("64Gi", "61.5G", "512Mi") or a byte count, as bytes."""
    value = text.strip()
    number = value.rstrip("KMGTkmgtiIbB")
    unit = value[len(number) :].lower().removesuffix("b")
    try:
        amount = float(number)
    except ValueError:
        raise PlanError(f"memory size '{text}' is not a number with a unit like Gi or G") from None
    if unit not in _UNITS or amount <= 0:
        raise PlanError(f"memory size '{text}' has an unknown unit or is not positive")
    return int(amount * _UNITS[unit])


def stage_state_bytes(shape: ModelShape, start: int, end: int, request: PlanRequest) -> int:
    """Stream state of layers [start, end) for the request's streams and context (`StagePlan.state_bytes`)."""
    return plan_stage(shape, request, "", start, end).state_bytes


def context_that_fits(shape: ModelShape, start: int, end: int, request: PlanRequest, free_bytes: int, most: int) -> int:
    """The largest context budget up to `most` whose stream state fits in `free_bytes` (0: not even one
    position; the shard's start-up probe). A stage without global layers fits any context or none."""

    def fits(context: int) -> bool:
        return stage_state_bytes(shape, start, end, replace(request, context=context)) <= free_bytes

    if not fits(1):
        return 0
    low, high = 1, most
    while low < high:  # state bytes never shrink as the context grows
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low
