"""The compute core of a shard: a contiguous range of Inkling layers on OpenVINO, many streams at once.

`StageEngine.step` advances any mix of streams (prefill windows, decode rows, verify runs) in one
batched call per layer; stream state lives on the host in `state.StreamState` and is fed to the
compiled models through the index tables of `batch.plan_step`. Llama-family stages run every layer
in one call; on the CPU their keys and values live in a block pool that OpenVINO's PagedAttention op
writes in place, addressed by each stream's block table (`paged`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov

from cascadia.engine import cpu_kernels, graphs, llama_graphs, mapped, stage_graph
from cascadia.engine.batch import KeyPlan, Segment, StepPlan, check_segments, plan_step
from cascadia.engine.far_stack import FarStack
from cascadia.engine.graph_store import BuiltGraphs, GraphStore
from cascadia.engine.paged import BlockPool, PagedTables, blocks_for, paged_tables
from cascadia.engine.settings import EngineSettings
from cascadia.engine.state import (
    BudgetExceeded,
    GrowingRows,
    HistorySlots,
    LayerRings,
    LayerState,
    RingPool,
    RingRows,
    Rows,
    StreamSlots,
    StreamState,
    conv_histories,
    history_slots,
)
from cascadia.kv_layout import STORAGE, bytes_per_element
from cascadia.model.checkpoint import HeldStage, LayerWeights, StageReader, StageWeights
from cascadia.model.config import AttentionShape
from cascadia.model.formats import as_float, expert_slice

CONV_INPUTS = stage_graph.CONV_INPUTS  # as their histories lie in a stream's ring
Progress = Callable[[str, int, int], None]


class UnsupportedSettings(ValueError):
    """Settings the device cannot compile (e.g. f16 fused experts on the CPU)."""


class StreamError(ValueError):
    """A request about a stream that does not exist, already exists, or is at another position."""


@dataclass(frozen=True)
class StepResult:
    hidden: np.ndarray  # [T, H] residual rows: for the next stage, or on the last one the final states before the norm
    logits: np.ndarray | None  # [rows asked for, V] on the last stage
    logit_rows: np.ndarray | None  # which step rows the logits belong to


def compile_config(settings: EngineSettings, compute: str) -> dict[str, str]:
    config = {"INFERENCE_PRECISION_HINT": compute, "PERFORMANCE_HINT": "LATENCY"}
    if settings.device.upper().startswith(("CPU", "GPU")) or settings.activation_quant_group:
        # on the CPU and the iGPU always: both plugins quantise compressed matmuls' activations by
        # default (the CPU's in 2026.4, the GPU's on iGPUs without systolic arrays), which is not exact
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(settings.activation_quant_group)
    if settings.device.upper().startswith("CPU") and settings.paged_attention:
        # the plugin gives PagedAttention's pools this precision (u8 by default on this CPU)
        config["KEY_CACHE_PRECISION"] = config["VALUE_CACHE_PRECISION"] = settings.kv_precision
    if settings.threads:
        config["INFERENCE_NUM_THREADS"] = str(settings.threads)
    if settings.profile_ops:
        config["PERF_COUNT"] = "YES"
    return config


def conv_widths(attention: AttentionShape, hidden: int) -> tuple[int, int, int, int]:
    """Widths of a layer's short-convolution inputs k, v, o and m, as they lie side by side in its ring."""
    return attention.kv_width, attention.kv_width, hidden, hidden


def _power_of_two_scale(layer: LayerWeights) -> float:
    """Scale for the down projection so that f16 expert outputs stay far below f16's maximum.

    A bound on |output| per unit of input activation is the largest row L1-norm of the down
    weights; 2^-n brings it under 2^8, leaving room for large activations.
    """
    down = layer.experts.down
    # expert by expert: a bank of the real model's width in f32 would not fit in memory
    bound = max(float(np.abs(as_float(expert_slice(down, j))).sum(axis=-1).max()) for j in range(down.shape[0]))
    exponent = max(0, math.ceil(math.log2(max(bound, 1e-30))) - 8)
    return 2.0**-exponent


class _Layer:
    """What a step needs to know of one layer, and its compiled models when it runs as calls of its own."""

    def __init__(self, shape, index: int) -> None:
        self.index = index
        self.attention = shape.layer_attention(index)
        # rotary positions (Llama) or log-scaled queries (Inkling's global layers) need each row's position
        self.needs_query_position = shape.family == "llama" or (
            self.attention.kind == "global" and shape.log_scaling_n_floor is not None
        )
        self.has_convs = shape.has_convs
        # what a step keeps of the layer, besides its output rows, when it runs in a joined stage
        self.joined_outputs = ("new_k", "new_v", *(("conv_in",) if shape.has_convs else ()))
        self.conv_splits = list(np.cumsum(conv_widths(self.attention, shape.hidden_size))[:-1])
        # Llama has no relative bias, so every cached key is read from the far blocks: no cached band
        self.has_cached_band = shape.family != "llama"
        self.attention_model: ov.CompiledModel | None = None
        self.expert_model: ov.CompiledModel | None = None
        self.attention_request: ov.InferRequest | None = None
        self.expert_request: ov.InferRequest | None = None
        self.post_request: ov.InferRequest | None = None

    def compile(
        self, core: ov.Core, source: StageReader | HeldStage, settings: EngineSettings, store: GraphStore
    ) -> None:
        """The layer's own models: attention with the experts, or (experts that run apart,
        `EngineSettings.split_expert_graph`) attention, experts and the post-expert residual as three."""
        split = settings.split_expert_graph
        residual_cfg = compile_config(settings, settings.residual_compute)
        i = self.index

        names = [f"layer{i}.attention", f"layer{i}.experts", f"layer{i}.post"] if split else [f"layer{i}"]
        # every graph of the layer first, then the reader's copy of its weights goes, then the plugin's
        model, *rest = [store.model(name, graph_builder(source, settings, name)) for name in names]
        source.release()
        self.attention_model = core.compile_model(model, settings.device, residual_cfg)
        self.attention_request = self.attention_model.create_infer_request()
        if not split:
            return
        experts, post_model = rest
        try:
            self.expert_model = core.compile_model(
                experts, settings.device, compile_config(settings, settings.expert_compute)
            )
        except RuntimeError as exc:
            raise UnsupportedSettings(
                f"layer {i}: the fused experts do not compile on {settings.device} with "
                f"expert_compute={settings.expert_compute} ({str(exc).strip().splitlines()[-1]}); "
                "f16 arithmetic is the iGPU's, use f32 or bf16 on the CPU"
            ) from exc
        self.expert_request = self.expert_model.create_infer_request()
        self.post_request = core.compile_model(post_model, settings.device, residual_cfg).create_infer_request()

    def run(
        self, inputs: dict[str, np.ndarray | ov.Tensor], hist_m: np.ndarray | None, conv_index: np.ndarray
    ) -> dict[str, np.ndarray]:
        assert self.attention_request is not None, "a layer of a joined stage runs in the stage's call"
        out = _infer(self.attention_request, inputs)
        if self.expert_request is None:
            return out
        expert_out = _infer(
            self.expert_request,
            {
                "mlp_input": out["mlp_input"],
                "expert_index": out["expert_index"],
                "expert_weight": out["expert_weight"],
            },
        )["expert_out"]
        assert self.post_request is not None
        post = {"expert_out": expert_out, "residual": out["residual"]}
        if self.has_convs:
            post.update({"conv_hist_m": hist_m, "conv_index": conv_index})
        out.update(_infer(self.post_request, post))
        return out


def graph_builder(source: StageReader | HeldStage, settings: EngineSettings, name: str) -> Callable[[], ov.Model]:
    """How to build the stage graph `name` (one of `graph_store.stage_graph_names`) from `source`'s weights.

    A reader keeps the layer it read last, so a layer's three graphs (split experts) read it once.
    """
    shape = source.shape
    if name == "embed":

        def embed() -> ov.Model:
            weights, norm, _, _ = source.ends()
            return graphs.embed_graph(weights, norm, shape.rms_norm_eps, settings.head_weights)

        return embed
    if name == "head":

        def head() -> ov.Model:
            _, _, final_norm, weights = source.ends()
            return graphs.head_graph(shape, final_norm, weights, settings.head_weights, compute=settings.head_compute)

        return head
    layer, _, part = name.removeprefix("layer").partition(".")
    i = int(layer)
    if part == "":
        return lambda: _layer_graph(shape, source.layer(i), settings, settings.expert_weights)
    if part == "attention":
        return lambda: _layer_graph(shape, source.layer(i), settings, None)
    if part == "experts":

        def experts() -> ov.Model:
            weights = source.layer(i)
            scale = _power_of_two_scale(weights)
            return graphs.expert_graph(shape, weights, settings.expert_weights, scale, settings.ffn_form)

        return experts
    if part == "post":
        return lambda: graphs.post_graph(shape, source.layer(i), _power_of_two_scale(source.layer(i)))
    raise ValueError(f"no stage graph named '{name}'")


def _layer_graph(shape, weights: LayerWeights, settings: EngineSettings, expert_fmt) -> ov.Model:
    build = llama_graphs.layer_graph if shape.family == "llama" else graphs.attention_graph
    return build(
        shape,
        weights,
        settings.attention_weights,
        expert_fmt,
        kv_type=settings.kv_precision,
        ffn=settings.ffn_form,
    )


def _stacked(rows: list[np.ndarray]) -> np.ndarray:
    """Streams' cached rows as one [S, L, ...] array; a single stream's view is passed on without a copy."""
    return rows[0][None] if len(rows) == 1 else np.stack(rows)


def _cached_inputs(name: str, stores: Sequence[GrowingRows], positions: np.ndarray) -> dict[str, np.ndarray]:
    """Input `name` [S, L, Hkv, D]: each stream's cached rows of a global layer at its positions (and
    `{name}_params` for u8); sliding layers' rows come from their ring pools (`_pooled_inputs`)."""
    inputs = {name: _stacked([store.read(positions[b]) for b, store in enumerate(stores)])}
    if stores[0].params is not None:
        inputs[f"{name}_params"] = _stacked([store.read_params(positions[b]) for b, store in enumerate(stores)])
    return inputs


def _growing(stores: Sequence[Rows]) -> list[GrowingRows]:
    """A global layer's stores, as the block caches they are."""
    caches = [store for store in stores if isinstance(store, GrowingRows)]
    assert len(caches) == len(stores), "global layers keep block caches, sliding ones rings"
    return caches


def _whole_pool(name: str, pool: RingPool) -> dict[str, np.ndarray]:
    """Input `name`: a ring pool as it is, every slot (and `{name}_params` for u8), read in the graph."""
    inputs = {name: pool.data}
    if pool.params is not None:
        inputs[f"{name}_params"] = pool.params
    return inputs


def _pooled_inputs(name: str, pool: RingPool, streams: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
    """Input `name` [S, L, Hkv, D] from a ring pool, in one gather (and `{name}_params` for u8)."""
    inputs = {name: pool.read(streams, positions)}
    if pool.params is not None:
        inputs[f"{name}_params"] = pool.read_params(streams, positions)
    return inputs


@dataclass(frozen=True)
class _StepRings:
    """Where a step's rows lie in the stage's ring pools, worked out once per step."""

    streams: np.ndarray  # [S] each segment's stream slot
    row_slots: np.ndarray  # [T] each row's stream slot
    row_ends: np.ndarray  # [T] the position after each row's segment
    history: HistorySlots | None  # where the conv histories lie (stages with convolutions)

    def history_cells(self, capacity: int) -> dict[str, np.ndarray]:
        """The convolution histories' flat ring cells and which of their rows count, as a joined stage
        reads them (`stage_graph.SHARED_INPUTS`)."""
        assert self.history is not None
        cells = stage_graph.ring_cells(self.streams, self.history.slots, capacity).reshape(-1)
        keep = np.ones((len(cells), 1), dtype=np.float32)
        if self.history.before_start is not None:
            keep[self.history.before_start] = 0.0
        return {"history_cells": cells, "history_keep": keep}

    def write(self, pool: RingPool, positions: np.ndarray, rows: np.ndarray) -> None:
        """Every row into its stream's ring; of a segment longer than the ring, only its last `capacity` rows."""
        kept = positions >= self.row_ends - pool.capacity
        if kept.all():
            pool.write(self.row_slots, positions, rows)
        else:
            pool.write(self.row_slots[kept], positions[kept], rows[kept])


@functools.lru_cache(maxsize=8)
def _no_far_keys(shape: tuple[int, ...], dtype: str) -> ov.Tensor:
    """Zero blocks for steps where no stream has far keys yet (every slot is masked), shared between steps.

    Handed over as a tensor: OpenVINO copies a read-only array at every call, megabytes at 32 streams.
    """
    return ov.Tensor(np.zeros(shape, dtype=dtype), shared_memory=True)


def _infer(
    request: ov.InferRequest, inputs: dict[str, np.ndarray | ov.Tensor], outputs: list[str] | None = None
) -> dict[str, np.ndarray]:
    """Run `request` and copy out the named outputs (default: all of them)."""
    request.infer(inputs, share_inputs=True)
    names = outputs if outputs is not None else [out.get_any_name() for out in request.model_outputs]
    return {name: request.get_tensor(name).data.copy() for name in names}


class StageEngine:
    """Layers [start, end) of one checkpoint; the first stage also embeds, the last also runs the head."""

    def __init__(
        self,
        weights: StageWeights | StageReader,
        settings: EngineSettings,
        progress: Progress | None = None,
        reload: Callable[[], StageWeights] | None = None,
        graph_store: GraphStore | None = None,
    ) -> None:
        """`weights` held in memory, or a `StageReader` that reads each layer when its graph is built
        (so that a stage is never all in memory before it is compiled). `reload` reads held weights
        again (e.g. `functools.partial(load_stage, path, start, end)`) for models compiled only when
        first needed; without it the engine keeps `weights` for them (a reader reads them again).
        `graph_store` gives an Inkling stage's graphs by name (`graph_store.stage_graph_names`): by
        default built from the weights; a converted stage's are read from its files instead."""
        source = HeldStage(weights) if isinstance(weights, StageWeights) else weights
        self.shape = source.shape
        self.settings = settings
        self.start_layer, self.end_layer = source.start_layer, source.end_layer
        layer_indices = range(self.start_layer, self.end_layer)
        self.is_first = source.is_first
        self.is_last = source.is_last
        core = ov.Core()
        cpu_kernels.add_to(core, settings)
        mapped.use_compile_cache(core, settings.device)
        store: GraphStore = graph_store if graph_store is not None else BuiltGraphs(core, settings)
        if graph_store is not None and self.shape.family == "llama":
            raise UnsupportedSettings(
                "converted stages hold Inkling layers; Llama-family stages are built from weights"
            )
        # a paged Llama stage's graph starts from the token ids itself: one call per step, not two
        paged_llama = self.shape.family == "llama" and not settings.split_expert_graph and settings.paged_attention
        self._embeds_in_stage = self.is_first and paged_llama
        # Inkling's layers run as one compiled model unless the experts run apart (`joined_layers`)
        self._joined = settings.joined_layers and self.shape.family != "llama" and not settings.split_expert_graph
        total = (
            len(layer_indices)
            + int(self.is_first and not self._embeds_in_stage)
            + int(self.is_last)
            + int(self._joined)
        )
        done = 0

        def tick(what: str) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(what, done, total)

        self._embed = self._head = None
        residual_cfg = compile_config(settings, settings.residual_compute)
        if self.is_first and not self._embeds_in_stage:
            model = store.model("embed", graph_builder(source, settings, "embed"))
            self._embed = core.compile_model(model, settings.device, residual_cfg).create_infer_request()
            del model
            tick("embedding")
        self._layers: list[_Layer] = []
        self._stage_model = self._stage_request = None
        self._pool: BlockPool | None = None
        # paged stages: the request that also returns every layer's output (compiled when first asked
        # for, so that steps without a trace do not pay for 30 more outputs), and the pool generation
        # each request has bound
        self._traced_request: ov.InferRequest | None = None
        self._bound_pool: dict[int, int] = {}
        # far blocks of the last step's streams, per global-layer input, kept until a stream opens or
        # closes. One list of streams only: a shard taking its pipeline's groups in turn starts the
        # stack again at each group, as the copy of every step did, rather than holding a second copy
        # of every group's far blocks
        self._far_stacks: dict[str, FarStack] = {}
        # models compiled later (a trace's per-layer outputs, the head alone) are built from the weights
        # read again when `reload` says how, so that once compiled the engine holds no copy of them
        again: Callable[[], StageWeights] = reload if reload is not None else source.weights
        # the closures kept for later compiles read these, not `self`: an engine holding a closure over
        # itself sits in a reference cycle and keeps its compiled models until a garbage collection
        shape, is_last, embeds_in_stage = self.shape, self.is_last, self._embeds_in_stage
        if self.shape.family == "llama" and not settings.split_expert_graph:
            weights = source.weights()
            # small dense layers: one compiled model for the whole range, so a step is one call
            if settings.paged_attention:

                def stage(w: StageWeights, layer_outputs: bool) -> ov.Model:
                    # the last stage ends in the head too: one call per step, not two
                    head = None
                    if is_last:
                        head = llama_graphs.StageHead(
                            w.final_norm, w.head, settings.head_weights, settings.head_compute
                        )
                    embed = None
                    if embeds_in_stage:
                        embed = llama_graphs.StageEmbed(w.embed, w.embed_norm, settings.head_weights)
                    return llama_graphs.paged_stage_graph(
                        shape,
                        w.layers,
                        settings.attention_weights,
                        settings.expert_weights,
                        settings.ffn_form,
                        settings.kv_precision,
                        layer_outputs,
                        head,
                        embed,
                    )

                self._compile_traced = lambda: mapped.compile_model(core, stage(again(), True), settings, residual_cfg)
                model = stage(weights, False)
            else:
                model = llama_graphs.stage_graph(
                    self.shape,
                    weights.layers,
                    settings.attention_weights,
                    settings.expert_weights,
                    settings.ffn_form,
                    settings.kv_precision,
                )
            self._stage_model = mapped.compile_model(core, model, settings, residual_cfg)
            del model
            self._stage_request = self._stage_model.create_infer_request()
            if settings.paged_attention:
                a = self.shape.layer_attention(weights.layers[0].index)
                kv = STORAGE[settings.kv_precision]
                self._pool = BlockPool(len(weights.layers), a.num_kv_heads, a.head_dim, kv)
            for layer in weights.layers:
                self._layers.append(_Layer(self.shape, layer.index))
                tick(f"layer {layer.index}")
        elif self._joined:
            # Inkling's layers in one model: each layer's graph is written out (mapping its weights) as
            # soon as it is built, so the stage's weights are never all in the heap at once
            graphs_of_layers = []
            for i in layer_indices:
                self._layers.append(_Layer(self.shape, i))
                graphs_of_layers.append(store.model(f"layer{i}", graph_builder(source, settings, f"layer{i}")))
                tick(f"layer {i}")
            # the graphs hold the weights now (mapped, or shared): the reader's copy goes before the plugin
            # makes its own
            source.release()
            windows = [layer.attention.window for layer in self._layers]
            self._stage_model = core.compile_model(
                stage_graph.join_layers(graphs_of_layers, windows), settings.device, residual_cfg
            )
            del graphs_of_layers
            self._stage_request = self._stage_model.create_infer_request()
            tick("layers joined")
        else:
            for i in layer_indices:
                compiled = _Layer(self.shape, i)
                compiled.compile(core, source, settings, store)
                self._layers.append(compiled)
                tick(f"layer {i}")
        if self.is_last:

            def head_model(w: StageWeights) -> ov.CompiledModel:
                model = graphs.head_graph(
                    shape, w.final_norm, w.head, settings.head_weights, compute=settings.head_compute
                )
                return mapped.compile_model(core, model, settings, residual_cfg)

            self._compile_head = lambda: head_model(again())
            if self._pool is None:  # a paged stage's graph has the head; this one serves `head_logits`
                model = store.model("head", graph_builder(source, settings, "head"))
                self._head = core.compile_model(model, settings.device, residual_cfg).create_infer_request()
                del model
            tick("head")
        source.release()
        self._windows = tuple(layer.attention.window for layer in self._layers)
        # cached keys nearer than this may carry a relative bias on global layers; farther ones are read
        # in place from the cache's blocks with no per-row tables. Llama has no bias: every cached key is far.
        extents = [layer.attention.rel_extent for layer in self._layers if layer.attention.window is None]
        self._global_band = 0 if self.shape.family == "llama" else max(extents, default=1) - 1
        self._has_global = any(w is None for w in self._windows)
        self._streams: dict[Hashable, StreamState] = {}
        self._rings = [] if self._pool is not None else [self._layer_rings(layer.attention) for layer in self._layers]
        self._ring_slots = StreamSlots(
            [pool for rings in self._rings for pool in rings.pools], settings.planned_streams
        )

    def _layer_rings(self, attention: AttentionShape) -> LayerRings:
        slack, kv = self.settings.rewind_slack, STORAGE[self.settings.kv_precision]
        keys = values = convs = None
        if attention.window is not None:
            row = (attention.num_kv_heads, attention.head_dim)
            keys = RingPool(attention.window - 1 + slack, row, dtype=kv)
            values = RingPool(attention.window - 1 + slack, row, dtype=kv)
        if self.shape.has_convs:
            width = sum(conv_widths(attention, self.shape.hidden_size))
            convs = RingPool(self.shape.conv_kernel_size - 1 + slack, (width,))
        return LayerRings(keys, values, convs)

    @property
    def joined_layers(self) -> bool:
        """Whether the stage's layers run as one compiled model (the settings ask, and they can)."""
        return self._joined

    def runtime_ops(self, precisions: bool = False) -> list[dict[str, int]]:
        """Per layer (or for a Llama stage, whose layers share their ops' names, for the whole stage), the
        plugin's executed op types, as "type/precision" with `precisions` (the precision each ran in).

        This is how to check which expert fusion formed, and in which arithmetic.
        """

        def kind_of(op: ov.Node) -> str:
            info = op.get_rt_info()
            kind = info["layerType"].astype(str)
            return f"{kind}/{info['runtimePrecision'].astype(str)}" if precisions else kind

        if self._joined:
            assert self._stage_model is not None
            per_layer: list[dict[str, int]] = [{} for _ in self._layers]
            for op in self._stage_model.get_runtime_model().get_ops():
                layer = stage_graph.layer_of(op.get_friendly_name())
                if layer is not None:
                    kind = kind_of(op)
                    per_layer[layer][kind] = per_layer[layer].get(kind, 0) + 1
            return per_layer
        counts = []
        groups = (
            [[self._stage_model]]
            if self._stage_model is not None
            else [[m for m in (layer.attention_model, layer.expert_model) if m is not None] for layer in self._layers]
        )
        for models in groups:
            kinds: dict[str, int] = {}
            for model in models:
                for op in model.get_runtime_model().get_ops():
                    kind = kind_of(op)
                    kinds[kind] = kinds.get(kind, 0) + 1
            counts.append(kinds)
        return counts

    def op_times(self) -> dict[str, float]:
        """Seconds the plugin spent per op kind ("type/implementation", e.g. "FullyConnected/gemm_mlas_f32")
        in the last call of each of the stage's compiled models: for a step, where its time went.

        Needs `EngineSettings.profile_ops`. The step's wall time less these is, roughly, what lies
        outside the ops (the plugin taking in new shapes between them, the host's tables and copies):
        the plugin's timers can also add up to more than the wall time.
        """
        if not self.settings.profile_ops:
            raise ValueError("op times need an engine compiled with profile_ops=True")
        requests = [self._embed, self._stage_request, self._head]
        for layer in self._layers:
            requests += [layer.attention_request, layer.expert_request, layer.post_request]
        times: dict[str, float] = {}
        for request in requests:
            if request is None:
                continue
            for op in request.get_profiling_info():
                if op.status == ov.ProfilingInfo.Status.EXECUTED:
                    kind = f"{op.node_type}/{op.exec_type}"
                    times[kind] = times.get(kind, 0.0) + op.real_time.total_seconds()
        return times

    # -- stream lifecycle -------------------------------------------------------------------------

    def open(self, stream: Hashable, context: int | None = None) -> None:
        if stream in self._streams:
            raise StreamError(f"stream {stream!r} is already open")
        context = context or self.settings.context
        if not 1 <= context <= self.settings.context:
            raise BudgetExceeded(
                f"stream {stream!r}: context {context} exceeds this engine's budget of {self.settings.context}"
            )
        slack = self.settings.rewind_slack
        self._far_stacks.clear()
        if self._pool is not None:
            self._streams[stream] = StreamState([], 0, slack, context=context)
            return
        kv = STORAGE[self.settings.kv_precision]
        slot = self._ring_slots.take()
        layers = []
        for layer, rings in zip(self._layers, self._rings, strict=True):
            a = layer.attention
            keys: RingRows | GrowingRows
            values: RingRows | GrowingRows
            if rings.keys is None or rings.values is None:
                keys = GrowingRows(context, (a.num_kv_heads, a.head_dim), dtype=kv)
                values = GrowingRows(context, (a.num_kv_heads, a.head_dim), dtype=kv)
            else:
                keys, values = RingRows(rings.keys, slot), RingRows(rings.values, slot)
            convs = None if rings.convs is None else RingRows(rings.convs, slot)
            layers.append(LayerState(keys, values, convs))
        self._streams[stream] = StreamState(layers, 0, slack, ring_slot=slot)

    def close(self, stream: Hashable) -> None:
        state = self._streams.pop(stream, None)
        if state is None:
            raise StreamError(f"stream {stream!r} is not open")
        if self._pool is not None:
            self._pool.release(state.blocks)
        if state.ring_slot >= 0:
            self._ring_slots.give_back(state.ring_slot)
        self._far_stacks.clear()  # lists of streams change: the stacks start again at their next step

    def rewind(self, stream: Hashable, position: int) -> None:
        self._stream(stream).rewind(position)

    @property
    def rings(self) -> bool:
        """Whether streams keep rows in rings (sliding windows, conv histories), which drop older rows."""
        return any(rings.pools for rings in self._rings)

    @property
    def reach(self) -> int:
        """Positions `adopt` and `copy` may step a stream back behind the furthest it was fed: the rewind
        slack where rings drop older rows; where every row is held (Llama stages), its whole context."""
        return self.settings.rewind_slack if self.rings else self.settings.context

    def _step_back(self, state: StreamState, position: int, source: Hashable) -> None:
        """A kept stream's state stepped back to `position` for the prompt that takes it over or copies it:
        within the rewind slack where rings drop older rows, anywhere where every row is held (the rows
        past `position` are then never read again, and speculation's rewinds count from there)."""
        if self.rings:
            state.rewind(position)
        elif not 0 <= position <= state.position:
            raise ValueError(f"cannot step stream {source!r} back to {position}: it is at {state.position}")
        else:
            state.position = state.reached = position

    def adopt(self, source: Hashable, stream: Hashable, position: int) -> None:
        """`stream` takes over `source`'s state, stepped back to `position` (within `reach`): a finished
        stream's positions serve a later prompt that starts with the same tokens. `source` is gone
        afterwards; on an error nothing has changed."""
        if stream in self._streams:
            raise StreamError(f"stream {stream!r} is already open")
        state = self._stream(source)
        self._step_back(state, position, source)
        self._streams[stream] = self._streams.pop(source)
        self._far_stacks.clear()  # the lists of streams change, as on open and close

    def copy(self, source: Hashable, stream: Hashable, position: int) -> None:
        """Open `stream` holding `source`'s first `position` positions (within `reach` of the furthest
        `source` was fed): prompts that start alike are computed once. `source` goes on as it was."""
        held = self._stream(source)
        if stream in self._streams:
            raise StreamError(f"stream {stream!r} is already open")
        if not 0 <= position <= held.position or held.reached - position > self.reach:
            raise ValueError(
                f"cannot copy stream {source!r} at {position}: it is at {held.position}, fed to {held.reached}, "
                f"with a rewind slack of {self.reach}"
            )
        self.open(stream, held.context or None)
        try:
            self._copy_rows(held, self._streams[stream], position)
        except Exception:  # a budget exceeded: nothing is left open
            self.close(stream)
            raise

    def _copy_rows(self, held: StreamState, state: StreamState, position: int) -> None:
        if self._pool is not None:
            count = blocks_for(position)
            state.blocks = self._pool.allocate(count)
            for arrays in (self._pool.keys, self._pool.values):
                for array in arrays:
                    array[state.blocks] = array[held.blocks[:count]]
        else:
            for pool in (pool for rings in self._rings for pool in rings.pools):
                pool.data[state.ring_slot] = pool.data[held.ring_slot]
                if pool.params is not None:
                    pool.params[state.ring_slot] = pool.params[held.ring_slot]
            for mine, theirs in zip(state.layers, held.layers, strict=True):
                for copied, original in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                    if isinstance(copied, GrowingRows) and isinstance(original, GrowingRows):
                        copied.copy_from(original, position)
        # the rows past `position` are the source's, as after a rewind: the same slack bounds a step back;
        # where every row is held, none past it is read again
        state.position, state.reached = position, held.reached if self.rings else position

    def position(self, stream: Hashable) -> int:
        return self._stream(stream).position

    @property
    def context_limit(self) -> int:
        """Positions a stream opened with the default budget can reach here (0: no global layer, no limit)."""
        return self.settings.context if self._has_global else 0

    def kv_bytes_per_position(self) -> int:
        """KV bytes one more position of one stream costs on this stage (global layers; sliding ones are bounded)."""
        precision = self.settings.kv_precision
        return sum(
            round(2 * a.kv_width * bytes_per_element(precision, a.head_dim))
            for a in (layer.attention for layer in self._layers)
            if a.window is None
        )

    def stream_bytes(self, stream: Hashable) -> int:
        return self._state_bytes_of(self._stream(stream))

    def state_bytes(self) -> int:
        """The open streams' `stream_bytes` together. A shard's `Stats` reads this beside a running
        step, which may open and close streams meanwhile: the table is copied before it is walked."""
        return sum(self._state_bytes_of(state) for state in list(self._streams.values()))

    def _state_bytes_of(self, state: StreamState) -> int:
        return len(state.blocks) * self._pool.block_bytes if self._pool is not None else state.nbytes

    def held_state_bytes(self) -> int:
        """Memory this stage holds for stream state: its ring pools with their free slots, the global
        layers' caches of open streams and the far stacks kept between steps, or its paged KV pool.
        Above the open streams' `stream_bytes` while the pools keep the slots of closed streams.

        A shard reads this from its gRPC thread while a step runs: the tables are copied before they
        are walked, as a step may add or drop entries meanwhile."""
        if self._pool is not None:
            return self._pool.nbytes
        pooled = sum(pool.nbytes for rings in self._rings for pool in rings.pools)
        growing = sum(
            store.nbytes
            for state in list(self._streams.values())
            for layer in state.layers
            for store in (layer.keys, layer.values)
            if isinstance(store, GrowingRows)
        )
        return pooled + growing + sum(stack.nbytes for stack in list(self._far_stacks.values()))

    @property
    def streams(self) -> list[Hashable]:
        return list(self._streams)

    def _stream(self, stream: Hashable) -> StreamState:
        try:
            return self._streams[stream]
        except KeyError:
            raise StreamError(f"stream {stream!r} is not open") from None

    # -- stepping ---------------------------------------------------------------------------------

    def step(
        self,
        segments: Sequence[Segment],
        inputs: np.ndarray,
        logit_rows: np.ndarray | None = None,
        trace: list[np.ndarray] | None = None,
    ) -> StepResult:
        """Advance every segment's stream by its rows.

        `inputs` holds token ids [T] on the first stage and residual rows [T, H] elsewhere. On the
        last stage, `logit_rows` picks the rows whose logits are returned (default: every row).
        `trace`, when given, receives each layer's output rows (for numerics checks and capture).
        """
        states = [self._stream(seg.stream) for seg in segments]
        for seg, state in zip(segments, states, strict=True):
            if seg.start != state.position:
                raise StreamError(
                    f"stream {seg.stream!r}: segment starts at {seg.start} but the stream is at {state.position}"
                )
            if self._has_global and seg.start + seg.length > self._global_limit(state):
                raise BudgetExceeded(
                    f"stream {seg.stream!r}: {seg.start + seg.length} positions exceed its context budget "
                    f"of {self._global_limit(state)}"
                )
        plan: StepPlan | PagedTables
        if self._pool is not None:
            self._reserve_blocks(segments, states)
            plan = paged_tables(segments, [state.blocks for state in states])
            rows = len(plan.row_position)
        else:
            plan = plan_step(segments, max(1, self.shape.conv_kernel_size), self._windows, self._global_band)
            rows = plan.rows
        if self.is_first:
            ids = np.asarray(inputs)
            if ids.shape != (rows,) or not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"expected {rows} integer token ids, got array of shape {ids.shape}")
            if ids.size and (ids.min() < 0 or ids.max() >= self.shape.vocab_size):
                raise ValueError(f"token ids must lie in [0, {self.shape.vocab_size})")
            if self._embeds_in_stage:
                hidden = ids.astype(np.int32)  # the stage's graph embeds them
            else:
                hidden = _infer(self._embed, {"input_ids": ids.astype(np.int32)})["hidden"]
        else:
            hidden = np.ascontiguousarray(inputs, dtype=np.float32)
            if hidden.shape != (rows, self.shape.hidden_size):
                raise ValueError(
                    f"expected hidden rows of shape ({rows}, {self.shape.hidden_size}), got {hidden.shape}"
                )
        longest = max((seg.length for seg in segments), default=0)
        for state in states:
            for layer_state in state.layers:
                for rows_store in (layer_state.keys, layer_state.values):
                    if isinstance(rows_store, GrowingRows):
                        rows_store.reserve(state.position + longest)
        chosen = logits = None
        if self.is_last:
            chosen = np.arange(rows) if logit_rows is None else np.asarray(logit_rows, dtype=np.int64)
            if chosen.size and (chosen.ndim != 1 or chosen.min() < 0 or chosen.max() >= rows):
                raise ValueError(f"logit rows must lie in [0, {rows}), got {chosen.tolist()}")
        if isinstance(plan, PagedTables):
            hidden, logits = self._run_paged_stage(plan, hidden, trace, chosen)
        elif self._joined:
            hidden = self._run_joined(plan, states, hidden, self._step_rings(plan, states), trace)
        elif self._stage_request is not None:
            hidden = self._run_stage(plan, states, hidden, trace)
        else:
            rings = self._step_rings(plan, states)
            for li, layer in enumerate(self._layers):
                hidden = self._run_layer(li, layer, plan, states, hidden, rings)
                if trace is not None:
                    trace.append(hidden)
        for seg, state in zip(segments, states, strict=True):
            state.advance(seg.length)
        if not self.is_last:
            return StepResult(hidden, None, None)
        if logits is None:
            logits = _infer(self._head_request(), {"hidden": np.ascontiguousarray(hidden[chosen])})["logits"]
        return StepResult(hidden, logits, chosen)

    def head_logits(self, final_states: np.ndarray) -> np.ndarray:
        """The last stage's head on final states (before the norm), e.g. captured ones."""
        if not self.is_last:
            raise ValueError("only the last stage holds the head")
        return _infer(self._head_request(), {"hidden": np.ascontiguousarray(final_states, dtype=np.float32)})["logits"]

    def _head_request(self) -> ov.InferRequest:
        if self._head is None:
            self._head = self._compile_head().create_infer_request()
        return self._head

    def _global_limit(self, state: StreamState) -> int:
        if self._pool is not None:
            return state.context
        return next(layer.keys.limit for layer in state.layers if isinstance(layer.keys, GrowingRows))

    def _reserve_blocks(self, segments: Sequence[Segment], states: list[StreamState]) -> None:
        """Give each stream the pool blocks its rows will be written to (all or none on failure)."""
        assert self._pool is not None
        check_segments(segments)
        pairs = zip(segments, states, strict=True)
        wanted = [max(0, blocks_for(seg.start + seg.length) - len(state.blocks)) for seg, state in pairs]
        fresh = self._pool.allocate(sum(wanted))
        for state, count in zip(states, wanted, strict=True):
            state.blocks.extend(fresh[:count])
            del fresh[:count]

    def _run_paged_stage(
        self, tables: PagedTables, rows_in: np.ndarray, trace: list[np.ndarray] | None, logit_rows: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Every layer in one call, PagedAttention writing the step's keys and values into the pool; on
        the last stage the same call ends in the logits of `logit_rows`. `rows_in` holds residual rows,
        or the token ids on a stage whose graph embeds them."""
        assert self._pool is not None and self._stage_request is not None
        request = self._stage_request
        if trace is not None:
            if self._traced_request is None:
                self._traced_request = self._compile_traced().create_infer_request()
            request = self._traced_request
        if self._bound_pool.get(id(request)) != self._pool.generation:
            for n, (keys, values) in enumerate(zip(self._pool.keys, self._pool.values, strict=True)):
                request.set_tensor(f"key_cache_{n}", ov.Tensor(keys, shared_memory=True))
                request.set_tensor(f"value_cache_{n}", ov.Tensor(values, shared_memory=True))
            self._bound_pool[id(request)] = self._pool.generation
        first = "input_ids" if self._embeds_in_stage else "hidden"
        inputs = {first: rows_in, "query_position": tables.row_position.astype(np.float32), **tables.as_inputs()}
        wanted = ["hidden_out"]
        if logit_rows is not None:
            inputs["logit_rows"] = logit_rows.astype(np.int32)
            wanted.append("logits")
        if trace is not None:
            wanted += [f"layer_out_{li}" for li in range(len(self._layers))]
        out = _infer(request, inputs, wanted)
        if trace is not None:
            trace.extend(out[f"layer_out_{li}"] for li in range(len(self._layers)))
        return out["hidden_out"], out.get("logits")

    def _run_stage(
        self, plan: StepPlan, states: list[StreamState], hidden: np.ndarray, trace: list[np.ndarray] | None
    ) -> np.ndarray:
        """Every layer in one call (Llama family): the key tables are shared, each layer has its own cache."""
        keys_plan = plan.keys[None]
        inputs = {
            "hidden": hidden,
            "cell_rows": plan.cell_rows,
            "row_cells": plan.row_cells,
            "key_mask": keys_plan.key_mask,
            "far_mask": keys_plan.far_mask,
            "query_position": plan.row_position.astype(np.float32),
        }
        for li in range(len(self._layers)):
            keys = _growing([st.layers[li].keys for st in states])
            values = _growing([st.layers[li].values for st in states])
            inputs.update(self._far_inputs(f"far_k_{li}", f"far_k_{li}", keys, keys_plan, states))
            inputs.update(self._far_inputs(f"far_v_{li}", f"far_v_{li}", values, keys_plan, states))
        layers = range(len(self._layers))
        wanted = ["hidden_out", *(f"new_{kv}_{li}" for li in layers for kv in "kv")]
        if trace is not None:
            wanted += [f"layer_out_{li}" for li in layers]
        out = _infer(self._stage_request, inputs, wanted)
        for b, (seg, st) in enumerate(zip(plan.segments, states, strict=True)):
            first = int(plan.row_offset[b])
            rows = slice(first, first + seg.length)
            positions = plan.row_position[rows]
            for li, ls in enumerate(st.layers):
                self._write(ls.keys, positions, out[f"new_k_{li}"][rows])
                self._write(ls.values, positions, out[f"new_v_{li}"][rows])
        if trace is not None:
            trace.extend(out[f"layer_out_{li}"] for li in range(len(self._layers)))
        return out["hidden_out"]

    def _far_inputs(
        self, name: str, key: str, caches: Sequence[GrowingRows], plan: KeyPlan, states: list[StreamState]
    ) -> dict[str, np.ndarray | ov.Tensor]:
        """Input `name` [S, N, Hkv, B, D]: the cache blocks holding each stream's far keys (and
        `{name}_params` for u8); `key` names the input's stack among the stage's layers."""
        inputs = {name: self._far_blocks(key, [c.blocks(plan.far_blocks) for c in caches], caches, plan, states)}
        if caches[0].params is not None:
            params = [c.block_params(plan.far_blocks) for c in caches]
            inputs[f"{name}_params"] = self._far_blocks(f"{key}_params", params, caches, plan, states)
        return inputs

    def _far_blocks(
        self,
        key: str,
        blocks: list[np.ndarray],
        caches: Sequence[GrowingRows],
        plan: KeyPlan,
        states: list[StreamState],
    ) -> np.ndarray | ov.Tensor:
        """Streams' leading blocks as one array: a view for one stream, else the input's stack, whose
        blocks are copied again only where they may have changed since the last step."""
        if len(blocks) == 1 and blocks[0].shape[0] == plan.far_blocks:
            return blocks[0][None]
        if not plan.far_keys.any():
            return _no_far_keys((len(blocks), plan.far_blocks, *blocks[0].shape[1:]), blocks[0].dtype.str)
        owners = tuple(c.serial for c in caches)
        fixed = np.array([st.reached - st.slack for st in states], dtype=np.int64)
        stack = self._far_stacks.setdefault(key, FarStack())
        return stack.gather(owners, blocks, plan.far_blocks, plan.far_keys, fixed)

    def _step_rings(self, plan: StepPlan, states: list[StreamState]) -> _StepRings:
        streams = np.array([state.ring_slot for state in states], dtype=np.int64)
        ends = np.array([seg.start + seg.length for seg in plan.segments], dtype=np.int64)
        history = None
        if self.shape.has_convs:
            convs = self._rings[0].convs  # every conv ring of a stage has one capacity
            assert convs is not None
            history = history_slots([seg.start for seg in plan.segments], self.shape.conv_kernel_size, convs.capacity)
        return _StepRings(streams, streams[plan.row_stream], ends[plan.row_stream], history)

    def _run_layer(
        self,
        li: int,
        layer: _Layer,
        plan: StepPlan,
        states: list[StreamState],
        hidden: np.ndarray,
        step_rings: _StepRings,
    ) -> np.ndarray:
        inputs, hist_m = self._layer_inputs(li, layer, plan, states, step_rings)
        inputs["hidden"] = hidden
        out = layer.run(inputs, hist_m, plan.conv_index)
        self._keep_layer_outputs(li, plan, states, step_rings, out)
        return out["hidden_out"]

    def _run_joined(
        self,
        plan: StepPlan,
        states: list[StreamState],
        hidden: np.ndarray,
        step_rings: _StepRings,
        trace: list[np.ndarray] | None,
    ) -> np.ndarray:
        """Every layer in one call: a layer reads only rows cached before the step, so every layer's
        inputs are gathered first and every layer's new rows kept after."""
        assert self._stage_request is not None
        inputs: dict[str, np.ndarray | ov.Tensor] = {"hidden": hidden}
        if self.shape.has_convs:
            convs = self._rings[0].convs  # every conv ring of a stage has one capacity
            assert convs is not None
            inputs.update(step_rings.history_cells(convs.capacity))
        for li, layer in enumerate(self._layers):
            window = layer.attention.window
            band_cells = stage_graph.stage_name("band_cells", li, window)
            ring = self._rings[li].keys
            if ring is not None and band_cells not in inputs:  # one table for the sliding layers of a window
                past = plan.keys[window].past_positions
                inputs[band_cells] = stage_graph.ring_cells(step_rings.streams, past, ring.capacity)
            layer_inputs, _ = self._layer_inputs(li, layer, plan, states, step_rings, joined=True)
            inputs.update((stage_graph.stage_name(name, li, window), v) for name, v in layer_inputs.items())
        wanted = ["hidden_out"]
        for li, layer in enumerate(self._layers):
            wanted += [stage_graph.stage_name(name, li, layer.attention.window) for name in layer.joined_outputs]
        if trace is not None:
            wanted += [f"layer_out_{li}" for li in range(len(self._layers) - 1)]
        out = _infer(self._stage_request, inputs, wanted)
        for li, layer in enumerate(self._layers):
            window = layer.attention.window
            kept = {name: out[stage_graph.stage_name(name, li, window)] for name in layer.joined_outputs}
            self._keep_layer_outputs(li, plan, states, step_rings, kept)
            if trace is not None:
                trace.append(out["hidden_out" if li == len(self._layers) - 1 else f"layer_out_{li}"])
        return out["hidden_out"]

    def _layer_inputs(
        self,
        li: int,
        layer: _Layer,
        plan: StepPlan,
        states: list[StreamState],
        step_rings: _StepRings,
        joined: bool = False,
    ) -> tuple[dict[str, np.ndarray | ov.Tensor], np.ndarray | None]:
        """Layer `li`'s inputs but the residual rows: the step's tables and the streams' cached rows,
        and the MLP-output conv history (for a layer whose experts run apart). `joined`: as a joined
        stage takes them, the ring pools whole with the cells to read (`stage_graph.join_layers`)."""
        keys_plan = plan.keys[layer.attention.window]
        rings = self._rings[li]
        past = keys_plan.past_positions
        # a global layer's caches grow per stream; a sliding layer's rows are in its ring pools
        pooled = rings.keys is not None and rings.values is not None
        keys = [] if pooled else _growing([st.layers[li].keys for st in states])
        values = [] if pooled else _growing([st.layers[li].values for st in states])
        inputs: dict[str, np.ndarray | ov.Tensor] = {
            "cell_rows": plan.cell_rows,
            "row_cells": plan.row_cells,
            "key_mask": keys_plan.key_mask,
        }
        if layer.has_cached_band:
            if rings.keys is not None and rings.values is not None and joined:  # read at the step's `band_cells`
                inputs.update(_whole_pool("ring_k", rings.keys))
                inputs.update(_whole_pool("ring_v", rings.values))
            elif rings.keys is not None and rings.values is not None:
                inputs.update(_pooled_inputs("past_k", rings.keys, step_rings.streams, past))
                inputs.update(_pooled_inputs("past_v", rings.values, step_rings.streams, past))
            else:
                inputs.update(_cached_inputs("past_k", keys, past))
                inputs.update(_cached_inputs("past_v", values, past))
        if keys_plan.far_mask is not None:
            inputs["far_mask"] = keys_plan.far_mask
            inputs.update(self._far_inputs("far_k", f"far_k_{li}", keys, keys_plan, states))
            inputs.update(self._far_inputs("far_v", f"far_v_{li}", values, keys_plan, states))
        hist_m = None
        if layer.has_convs:
            assert rings.convs is not None and step_rings.history is not None, "a layer with convolutions has rings"
            inputs.update(conv_index=plan.conv_index, key_distance=keys_plan.key_distance)
            if joined:
                inputs["conv_ring"] = rings.convs.data  # read at the step's `history_cells`
            else:
                joint = conv_histories(rings.convs, step_rings.streams, step_rings.history)
                parts = np.split(joint, layer.conv_splits, 1)
                hist_k, hist_v, hist_o, hist_m = (np.ascontiguousarray(part) for part in parts)
                inputs.update(conv_hist_k=hist_k, conv_hist_v=hist_v, conv_hist_o=hist_o)
                if layer.expert_request is None:
                    inputs["conv_hist_m"] = hist_m
        if layer.needs_query_position:
            inputs["query_position"] = plan.row_position.astype(np.float32)
        return inputs, hist_m

    def _keep_layer_outputs(
        self, li: int, plan: StepPlan, states: list[StreamState], step_rings: _StepRings, out: dict[str, np.ndarray]
    ) -> None:
        """Layer `li`'s new keys, values and convolution inputs (`conv_in` side by side, or each of
        `CONV_INPUTS`) into the streams' rings and caches."""
        rings = self._rings[li]
        if rings.convs is not None:
            joint = out.get("conv_in")
            if joint is None:
                joint = np.concatenate([out[name] for name in CONV_INPUTS], 1)
            step_rings.write(rings.convs, plan.row_position, joint)
        if rings.keys is not None and rings.values is not None:
            step_rings.write(rings.keys, plan.row_position, out["new_k"])
            step_rings.write(rings.values, plan.row_position, out["new_v"])
            return
        keys = _growing([st.layers[li].keys for st in states])
        values = _growing([st.layers[li].values for st in states])
        for b, (seg, stream_keys, stream_values) in enumerate(zip(plan.segments, keys, values, strict=True)):
            first = int(plan.row_offset[b])
            rows = slice(first, first + seg.length)
            self._write(stream_keys, plan.row_position[rows], out["new_k"][rows])
            self._write(stream_values, plan.row_position[rows], out["new_v"][rows])

    @staticmethod
    def _write(store: RingRows | GrowingRows, positions: np.ndarray, rows: np.ndarray) -> None:
        if isinstance(store, RingRows) and len(positions) > store.capacity:
            positions, rows = positions[-store.capacity :], rows[-store.capacity :]
        store.write(positions, rows)
