"""The ways a stage's layers execute, one runner each, behind one small protocol (`StageRunner`); the engine
picks one when it is built (`build_runner`) and never again.

- `PagedLlamaRunner`: a Llama-family stage as one compiled model whose PagedAttention ops write keys and
  values into a block pool in place, embedding (first stage) and head (last stage) inside it.
- `LlamaStageRunner`: a Llama-family stage as one compiled model over per-stream block caches.
- `JoinedRunner`: Inkling's layers as one compiled model reading the streams' ring pools in place.
- `PerLayerRunner`: a compiled model per layer, or three where the experts run apart
  (`EngineSettings.split_expert_graph`: f16 experts on the iGPU).

A runner compiles its models, plans a step's tables over the streams and runs the step; the streams'
state, the embedding and the head alone stay with `StageEngine`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import openvino as ov

from cascadia.engine import llama_graphs, mapped, stage_graph
from cascadia.engine.batch import Segment, StepPlan, check_segments, plan_step
from cascadia.engine.compiled import CompiledLayer, graph_builder, infer
from cascadia.engine.graph_store import GraphStore
from cascadia.engine.paged import BlockPool, PagedTables, blocks_for, paged_tables
from cascadia.engine.settings import EngineSettings
from cascadia.engine.state import StreamState
from cascadia.engine.step_io import StepIO, growing_caches, write_rows
from cascadia.kv_layout import STORAGE
from cascadia.model.checkpoint import HeldStage, StageReader, StageWeights

Plan = StepPlan | PagedTables


@dataclass
class Build:
    """What every runner compiles from: the plugin, the stage's weights or graphs, and how to report."""

    core: ov.Core
    source: StageReader | HeldStage
    settings: EngineSettings
    store: GraphStore
    config: dict[str, str]  # the residual stream's compile settings
    again: Callable[[], StageWeights]  # the weights read again, for models compiled only when first needed
    tick: Callable[[str], None]


class StageRunner(Protocol):
    layers: list[CompiledLayer]
    joined: bool  # the layers run as one compiled model that reads the ring pools in place
    pool: BlockPool | None  # a paged stage's KV blocks; None where streams keep rings and block caches
    embeds: bool  # the stage's model takes the token ids itself (first stage)
    has_head: bool  # the stage's model ends in the logits (last stage)

    def plan(self, segments: Sequence[Segment], states: list[StreamState]) -> Plan: ...

    def run(
        self, io: StepIO, plan: Plan, states: list[StreamState], rows_in: np.ndarray,
        trace: list[np.ndarray] | None, logit_rows: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray | None]: ...  # fmt: skip

    def runtime_ops(self, kind_of: Callable[[ov.Node], str]) -> list[dict[str, int]]: ...

    def requests(self) -> list[ov.InferRequest | None]: ...


def _count(models: list[ov.CompiledModel], kind_of: Callable[[ov.Node], str]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for model in models:
        for op in model.get_runtime_model().get_ops():
            kind = kind_of(op)
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


class _RingRunner:
    """Steps planned over ring pools and block caches (`batch.plan_step`)."""

    pool: BlockPool | None = None
    embeds = False
    has_head = False
    joined = False

    def __init__(self, shape, layers: list[CompiledLayer]) -> None:
        self.layers = layers
        self._conv_kernel = max(1, shape.conv_kernel_size)
        self._windows = tuple(layer.attention.window for layer in layers)
        # cached keys nearer than this may carry a relative bias on global layers; farther ones are read
        # in place from the cache's blocks with no per-row tables. Llama has no bias: every cached key is far.
        extents = [layer.attention.rel_extent for layer in layers if layer.attention.window is None]
        self._global_band = 0 if shape.family == "llama" else max(extents, default=1) - 1

    def plan(self, segments: Sequence[Segment], states: list[StreamState]) -> Plan:
        return plan_step(segments, self._conv_kernel, self._windows, self._global_band)


class _OneModel:
    """A runner whose layers are one compiled model."""

    model: ov.CompiledModel
    request: ov.InferRequest

    def runtime_ops(self, kind_of: Callable[[ov.Node], str]) -> list[dict[str, int]]:
        """The whole stage's ops as one group: a Llama stage's layers share their ops' names."""
        return [_count([self.model], kind_of)]

    def requests(self) -> list[ov.InferRequest | None]:
        return [self.request]


class PerLayerRunner(_RingRunner):
    def __init__(self, shape, build: Build, indices: range) -> None:
        layers = []
        for i in indices:
            layer = CompiledLayer(shape, i)
            layer.compile(build.core, build.source, build.settings, build.store)
            layers.append(layer)
            build.tick(f"layer {i}")
        super().__init__(shape, layers)

    def run(self, io, plan, states, rows_in, trace, logit_rows):
        assert isinstance(plan, StepPlan)
        step_rings = io.step_rings(plan, states)
        hidden = rows_in
        for li, layer in enumerate(self.layers):
            inputs, hist_m = io.layer_inputs(li, layer, plan, states, step_rings)
            inputs["hidden"] = hidden
            out = layer.run(inputs, hist_m, plan.conv_index)
            io.keep_layer_outputs(li, plan, states, step_rings, out)
            hidden = out["hidden_out"]
            if trace is not None:
                trace.append(hidden)
        return hidden, None

    def runtime_ops(self, kind_of: Callable[[ov.Node], str]) -> list[dict[str, int]]:
        models = [[m for m in (layer.attention_model, layer.expert_model) if m is not None] for layer in self.layers]
        return [_count(group, kind_of) for group in models]

    def requests(self) -> list[ov.InferRequest | None]:
        return [r for layer in self.layers for r in (layer.attention_request, layer.expert_request, layer.post_request)]


class JoinedRunner(_OneModel, _RingRunner):
    """Inkling's layers in one model: each layer's graph is written out (mapping its weights) as soon as it
    is built, so the stage's weights are never all in the heap at once."""

    joined = True

    def __init__(self, shape, build: Build, indices: range) -> None:
        layers, graphs_of_layers = [], []
        for i in indices:
            layers.append(CompiledLayer(shape, i))
            graphs_of_layers.append(
                build.store.model(f"layer{i}", graph_builder(build.source, build.settings, f"layer{i}"))
            )
            build.tick(f"layer {i}")
        # the graphs hold the weights now (mapped, or shared): the reader's copy goes before the plugin
        # makes its own
        build.source.release()
        windows = [layer.attention.window for layer in layers]
        joined = stage_graph.join_layers(graphs_of_layers, windows)
        self.model = build.core.compile_model(joined, build.settings.device, build.config)
        del graphs_of_layers, joined
        self.request = self.model.create_infer_request()
        build.tick("layers joined")
        super().__init__(shape, layers)

    def runtime_ops(self, kind_of: Callable[[ov.Node], str]) -> list[dict[str, int]]:
        """Per layer, by the layer each op's name carries in the joined model."""
        per_layer: list[dict[str, int]] = [{} for _ in self.layers]
        for op in self.model.get_runtime_model().get_ops():
            layer = stage_graph.layer_of(op.get_friendly_name())
            if layer is not None:
                kind = kind_of(op)
                per_layer[layer][kind] = per_layer[layer].get(kind, 0) + 1
        return per_layer

    def run(self, io, plan, states, rows_in, trace, logit_rows):
        """Every layer in one call: a layer reads only rows cached before the step, so every layer's inputs
        are gathered first and every layer's new rows kept after."""
        assert isinstance(plan, StepPlan)
        step_rings = io.step_rings(plan, states)
        inputs: dict[str, np.ndarray | ov.Tensor] = {"hidden": rows_in}
        if io.shape.has_convs:
            convs = io.rings[0].convs  # every conv ring of a stage has one capacity
            assert convs is not None
            inputs.update(step_rings.history_cells(convs.capacity))
        for li, layer in enumerate(self.layers):
            window = layer.attention.window
            band_cells = stage_graph.stage_name("band_cells", li, window)
            ring = io.rings[li].keys
            if ring is not None and band_cells not in inputs:  # one table for the sliding layers of a window
                past = plan.keys[window].past_positions
                inputs[band_cells] = stage_graph.ring_cells(step_rings.streams, past, ring.capacity)
            layer_inputs, _ = io.layer_inputs(li, layer, plan, states, step_rings, joined=True)
            inputs.update((stage_graph.stage_name(name, li, window), v) for name, v in layer_inputs.items())
        wanted = ["hidden_out"]
        for li, layer in enumerate(self.layers):
            wanted += [stage_graph.stage_name(name, li, layer.attention.window) for name in layer.joined_outputs]
        if trace is not None:
            wanted += [f"layer_out_{li}" for li in range(len(self.layers) - 1)]
        out = infer(self.request, inputs, wanted)
        for li, layer in enumerate(self.layers):
            window = layer.attention.window
            kept = {name: out[stage_graph.stage_name(name, li, window)] for name in layer.joined_outputs}
            io.keep_layer_outputs(li, plan, states, step_rings, kept)
            if trace is not None:
                trace.append(out["hidden_out" if li == len(self.layers) - 1 else f"layer_out_{li}"])
        return out["hidden_out"], None


class LlamaStageRunner(_OneModel, _RingRunner):
    """Small dense layers: one compiled model for the whole range, so a step is one call; the key tables
    are shared, each layer has its own cache."""

    def __init__(self, shape, build: Build, weights: StageWeights) -> None:
        settings = build.settings
        model = llama_graphs.stage_graph(
            shape, weights.layers, settings.attention_weights, settings.expert_weights, settings.ffn_form,
            settings.kv_precision,
        )  # fmt: skip
        self.model = mapped.compile_model(build.core, model, settings, build.config)
        del model
        self.request = self.model.create_infer_request()
        layers = [CompiledLayer(shape, layer.index) for layer in weights.layers]
        for layer in layers:
            build.tick(f"layer {layer.index}")
        super().__init__(shape, layers)

    def run(self, io, plan, states, rows_in, trace, logit_rows):
        assert isinstance(plan, StepPlan)
        keys_plan = plan.keys[None]
        inputs = {
            "hidden": rows_in,
            "cell_rows": plan.cell_rows,
            "row_cells": plan.row_cells,
            "key_mask": keys_plan.key_mask,
            "far_mask": keys_plan.far_mask,
            "query_position": plan.row_position.astype(np.float32),
        }
        layers = range(len(self.layers))
        for li in layers:
            keys = growing_caches([st.layers[li].keys for st in states])
            values = growing_caches([st.layers[li].values for st in states])
            inputs.update(io.far_inputs(f"far_k_{li}", f"far_k_{li}", keys, keys_plan, states))
            inputs.update(io.far_inputs(f"far_v_{li}", f"far_v_{li}", values, keys_plan, states))
        wanted = ["hidden_out", *(f"new_{kv}_{li}" for li in layers for kv in "kv")]
        if trace is not None:
            wanted += [f"layer_out_{li}" for li in layers]
        out = infer(self.request, inputs, wanted)
        for b, (seg, st) in enumerate(zip(plan.segments, states, strict=True)):
            first = int(plan.row_offset[b])
            rows = slice(first, first + seg.length)
            positions = plan.row_position[rows]
            for li, ls in enumerate(st.layers):
                write_rows(ls.keys, positions, out[f"new_k_{li}"][rows])
                write_rows(ls.values, positions, out[f"new_v_{li}"][rows])
        if trace is not None:
            trace.extend(out[f"layer_out_{li}"] for li in layers)
        return out["hidden_out"], None


class PagedLlamaRunner(_OneModel):
    """Every layer in one call, PagedAttention writing the step's keys and values into the pool; the first
    stage's call starts from the token ids and the last stage's ends in the logits of the rows asked for."""

    joined = False

    def __init__(self, shape, build: Build, weights: StageWeights, is_first: bool, is_last: bool) -> None:
        settings, again = build.settings, build.again
        self.embeds, self.has_head = is_first, is_last

        def stage(w: StageWeights, layer_outputs: bool) -> ov.Model:
            head = None
            if is_last:
                head = llama_graphs.StageHead(w.final_norm, w.head, settings.head_weights, settings.head_compute)
            embed = llama_graphs.StageEmbed(w.embed, w.embed_norm, settings.head_weights) if is_first else None
            return llama_graphs.paged_stage_graph(
                shape, w.layers, settings.attention_weights, settings.expert_weights, settings.ffn_form,
                settings.kv_precision, layer_outputs, head, embed,
            )  # fmt: skip

        core, config = build.core, build.config
        # the request that also returns every layer's output, compiled when first asked for, so that steps
        # without a trace do not pay for 30 more outputs
        self._compile_traced = lambda: mapped.compile_model(core, stage(again(), True), settings, config)
        self._traced_request: ov.InferRequest | None = None
        model = stage(weights, False)
        self.model = mapped.compile_model(core, model, settings, config)
        del model
        self.request = self.model.create_infer_request()
        a = shape.layer_attention(weights.layers[0].index)
        self.pool: BlockPool | None = BlockPool(
            len(weights.layers), a.num_kv_heads, a.head_dim, STORAGE[settings.kv_precision]
        )
        self._bound_pool: dict[int, int] = {}  # the pool generation each request has bound
        self.layers = [CompiledLayer(shape, layer.index) for layer in weights.layers]
        for layer in self.layers:
            build.tick(f"layer {layer.index}")

    def plan(self, segments: Sequence[Segment], states: list[StreamState]) -> Plan:
        """The step's block tables, after giving each stream the pool blocks its rows will be written to
        (all or none on failure)."""
        assert self.pool is not None
        check_segments(segments)
        pairs = zip(segments, states, strict=True)
        wanted = [max(0, blocks_for(seg.start + seg.length) - len(state.blocks)) for seg, state in pairs]
        fresh = self.pool.allocate(sum(wanted))
        for state, count in zip(states, wanted, strict=True):
            state.blocks.extend(fresh[:count])
            del fresh[:count]
        return paged_tables(segments, [state.blocks for state in states])

    def run(self, io, plan, states, rows_in, trace, logit_rows):
        """`rows_in` holds residual rows, or the token ids on a stage whose graph embeds them."""
        assert isinstance(plan, PagedTables) and self.pool is not None
        request = self.request
        if trace is not None:
            if self._traced_request is None:
                self._traced_request = self._compile_traced().create_infer_request()
            request = self._traced_request
        if self._bound_pool.get(id(request)) != self.pool.generation:
            for n, (keys, values) in enumerate(zip(self.pool.keys, self.pool.values, strict=True)):
                request.set_tensor(f"key_cache_{n}", ov.Tensor(keys, shared_memory=True))
                request.set_tensor(f"value_cache_{n}", ov.Tensor(values, shared_memory=True))
            self._bound_pool[id(request)] = self.pool.generation
        first = "input_ids" if self.embeds else "hidden"
        inputs = {first: rows_in, "query_position": plan.row_position.astype(np.float32), **plan.as_inputs()}
        wanted = ["hidden_out"]
        if logit_rows is not None:
            inputs["logit_rows"] = logit_rows.astype(np.int32)
            wanted.append("logits")
        if trace is not None:
            wanted += [f"layer_out_{li}" for li in range(len(self.layers))]
        out = infer(request, inputs, wanted)
        if trace is not None:
            trace.extend(out[f"layer_out_{li}"] for li in range(len(self.layers)))
        return out["hidden_out"], out.get("logits")


RunnerKind = Literal["paged", "llama", "joined", "per-layer"]


def runner_kind(shape, settings: EngineSettings) -> RunnerKind:
    """How a stage of this model runs in these settings: a pure choice, made once per engine."""
    if shape.family == "llama" and not settings.split_expert_graph:
        return "paged" if settings.paged_attention else "llama"
    # Inkling's layers run as one compiled model unless the experts run apart (`joined_layers`)
    if settings.joined_layers and shape.family != "llama" and not settings.split_expert_graph:
        return "joined"
    return "per-layer"


def build_runner(kind: RunnerKind, shape, build: Build, indices: range, is_first: bool, is_last: bool) -> StageRunner:
    """The runner of `kind`, its models compiled."""
    if kind == "paged":
        return PagedLlamaRunner(shape, build, build.source.weights(), is_first, is_last)
    if kind == "llama":
        return LlamaStageRunner(shape, build, build.source.weights())
    if kind == "joined":
        return JoinedRunner(shape, build, indices)
    return PerLayerRunner(shape, build, indices)
