"""The compute core of a shard: a contiguous range of Inkling layers on OpenVINO, many streams at once.

`StageEngine.step` advances any mix of streams (prefill windows, decode rows, verify runs) in one
batched call per layer; stream state lives on the host in `state.StreamState` and is fed to the
compiled models through the index tables of `batch.plan_step`. Llama-family stages run every layer
in one call; on the CPU their keys and values live in a block pool that OpenVINO's PagedAttention op
writes in place, addressed by each stream's block table (`paged`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov

from cascadia.engine import cpu_kernels, graphs, mapped
from cascadia.engine.batch import Segment
from cascadia.engine.compiled import Progress, UnsupportedSettings, compile_config, conv_widths, graph_builder, infer
from cascadia.engine.graph_store import BuiltGraphs, GraphStore
from cascadia.engine.paged import blocks_for
from cascadia.engine.runners import Build, build_runner, runner_kind
from cascadia.engine.settings import EngineSettings
from cascadia.engine.state import (
    BudgetExceeded,
    GrowingRows,
    LayerRings,
    LayerState,
    RingPool,
    RingRows,
    StreamSlots,
    StreamState,
)
from cascadia.engine.step_io import StepIO
from cascadia.kv_layout import STORAGE, bytes_per_element
from cascadia.model.checkpoint import HeldStage, StageReader, StageWeights
from cascadia.model.config import AttentionShape


class StreamError(ValueError):
    """A request about a stream that does not exist, already exists, or is at another position."""


@dataclass(frozen=True)
class StepResult:
    hidden: np.ndarray  # [T, H] residual rows: for the next stage, or on the last one the final states before the norm
    logits: np.ndarray | None  # [rows asked for, V] on the last stage
    logit_rows: np.ndarray | None  # which step rows the logits belong to


class StageEngine:
    """Layers [start, end) of one checkpoint; the first stage also embeds, the last also runs the head.

    How the layers execute is one `runners.StageRunner`, chosen and compiled when the engine is built;
    the engine keeps the streams' state, the embedding and the head."""

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
        kind = runner_kind(self.shape, settings)
        # a paged Llama stage's graph starts from the token ids itself: one call per step, not two
        embeds_in_stage = self.is_first and kind == "paged"
        indices = range(self.start_layer, self.end_layer)
        total = len(indices) + int(self.is_first and not embeds_in_stage) + int(self.is_last) + int(kind == "joined")
        done = 0

        def tick(what: str) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(what, done, total)

        self._embed = self._head = None
        residual_cfg = compile_config(settings, settings.residual_compute)
        if self.is_first and not embeds_in_stage:
            model = store.model("embed", graph_builder(source, settings, "embed"))
            self._embed = core.compile_model(model, settings.device, residual_cfg).create_infer_request()
            del model
            tick("embedding")
        # models compiled later (a trace's per-layer outputs, the head alone) are built from the weights
        # read again when `reload` says how, so that once compiled the engine holds no copy of them
        again: Callable[[], StageWeights] = reload if reload is not None else source.weights
        build = Build(core, source, settings, store, residual_cfg, again, tick)
        self._runner = build_runner(kind, self.shape, build, indices, self.is_first, self.is_last)
        self._layers = self._runner.layers
        self._pool = self._runner.pool
        if self.is_last:
            # the closure kept for a later compile reads these, not `self`: an engine holding a closure over
            # itself sits in a reference cycle and keeps its compiled models until a garbage collection
            shape = self.shape

            def head_model(w: StageWeights) -> ov.CompiledModel:
                model = graphs.head_graph(
                    shape, w.final_norm, w.head, settings.head_weights, compute=settings.head_compute
                )
                return mapped.compile_model(core, model, settings, residual_cfg)

            self._compile_head = lambda: head_model(again())
            if not self._runner.has_head:  # a paged stage's graph has the head; this one serves `head_logits`
                model = store.model("head", graph_builder(source, settings, "head"))
                self._head = core.compile_model(model, settings.device, residual_cfg).create_infer_request()
                del model
            tick("head")
        source.release()
        self._has_global = any(layer.attention.window is None for layer in self._layers)
        self._streams: dict[Hashable, StreamState] = {}
        rings = [] if self._pool is not None else [self._layer_rings(layer.attention) for layer in self._layers]
        self._io = StepIO(self.shape, rings)
        self._ring_slots = StreamSlots([pool for r in rings for pool in r.pools], settings.planned_streams)

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
        return self._runner.joined

    def runtime_ops(self, precisions: bool = False) -> list[dict[str, int]]:
        """Per layer (or for a Llama stage, whose layers share their ops' names, for the whole stage), the
        plugin's executed op types, as "type/precision" with `precisions` (the precision each ran in).

        This is how to check which expert fusion formed, and in which arithmetic.
        """

        def kind_of(op: ov.Node) -> str:
            info = op.get_rt_info()
            kind = info["layerType"].astype(str)
            return f"{kind}/{info['runtimePrecision'].astype(str)}" if precisions else kind

        return self._runner.runtime_ops(kind_of)

    def op_times(self) -> dict[str, float]:
        """Seconds the plugin spent per op kind ("type/implementation", e.g. "FullyConnected/gemm_mlas_f32")
        in the last call of each of the stage's compiled models: for a step, where its time went.

        Needs `EngineSettings.profile_ops`. The step's wall time less these is, roughly, what lies
        outside the ops (the plugin taking in new shapes between them, the host's tables and copies):
        the plugin's timers can also add up to more than the wall time.
        """
        if not self.settings.profile_ops:
            raise ValueError("op times need an engine compiled with profile_ops=True")
        requests = [self._embed, *self._runner.requests(), self._head]
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
        self._io.far_stacks.clear()
        if self._pool is not None:
            self._streams[stream] = StreamState([], 0, slack, context=context)
            return
        kv = STORAGE[self.settings.kv_precision]
        slot = self._ring_slots.take()
        layers = []
        for layer, rings in zip(self._layers, self._io.rings, strict=True):
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
        self._io.far_stacks.clear()  # lists of streams change: the stacks start again at their next step

    def rewind(self, stream: Hashable, position: int) -> None:
        self._stream(stream).rewind(position)

    @property
    def rings(self) -> bool:
        """Whether streams keep rows in rings (sliding windows, conv histories), which drop older rows."""
        return any(rings.pools for rings in self._io.rings)

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
        self._io.far_stacks.clear()  # the lists of streams change, as on open and close

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
            for pool in (pool for rings in self._io.rings for pool in rings.pools):
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
        pooled = sum(pool.nbytes for rings in self._io.rings for pool in rings.pools)
        growing = sum(
            store.nbytes
            for state in list(self._streams.values())
            for layer in state.layers
            for store in (layer.keys, layer.values)
            if isinstance(store, GrowingRows)
        )
        return pooled + growing + sum(stack.nbytes for stack in list(self._io.far_stacks.values()))

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
        plan = self._runner.plan(segments, states)
        rows = len(plan.row_position)
        if self.is_first:
            ids = np.asarray(inputs)
            if ids.shape != (rows,) or not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"expected {rows} integer token ids, got array of shape {ids.shape}")
            if ids.size and (ids.min() < 0 or ids.max() >= self.shape.vocab_size):
                raise ValueError(f"token ids must lie in [0, {self.shape.vocab_size})")
            if self._runner.embeds:
                hidden = ids.astype(np.int32)  # the stage's graph embeds them
            else:
                hidden = infer(self._embed, {"input_ids": ids.astype(np.int32)})["hidden"]
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
        hidden, logits = self._runner.run(self._io, plan, states, hidden, trace, chosen)
        for seg, state in zip(segments, states, strict=True):
            state.advance(seg.length)
        if not self.is_last:
            return StepResult(hidden, None, None)
        if logits is None:
            logits = infer(self._head_request(), {"hidden": np.ascontiguousarray(hidden[chosen])})["logits"]
        return StepResult(hidden, logits, chosen)

    def head_logits(self, final_states: np.ndarray) -> np.ndarray:
        """The last stage's head on final states (before the norm), e.g. captured ones."""
        if not self.is_last:
            raise ValueError("only the last stage holds the head")
        return infer(self._head_request(), {"hidden": np.ascontiguousarray(final_states, dtype=np.float32)})["logits"]

    def _head_request(self) -> ov.InferRequest:
        if self._head is None:
            self._head = self._compile_head().create_infer_request()
        return self._head

    def _global_limit(self, state: StreamState) -> int:
        if self._pool is not None:
            return state.context
        return next(layer.keys.limit for layer in state.layers if isinstance(layer.keys, GrowingRows))
