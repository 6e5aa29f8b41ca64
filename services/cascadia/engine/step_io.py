"""A step's inputs and outputs for a stage's compiled models: the streams' cached rows gathered from ring
pools, block caches and far stacks into the tables the graphs read, and the new rows written back."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov

from cascadia.engine import stage_graph
from cascadia.engine.batch import KeyPlan, StepPlan
from cascadia.engine.compiled import CompiledLayer
from cascadia.engine.far_stack import FarStack
from cascadia.engine.state import (
    GrowingRows,
    HistorySlots,
    LayerRings,
    RingPool,
    RingRows,
    Rows,
    StreamState,
    conv_histories,
    history_slots,
)
from cascadia.model.config import ModelShape

CONV_INPUTS = stage_graph.CONV_INPUTS  # as their histories lie in a stream's ring


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


def growing_caches(stores: Sequence[Rows]) -> list[GrowingRows]:
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
class StepRings:
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


def write_rows(store: RingRows | GrowingRows, positions: np.ndarray, rows: np.ndarray) -> None:
    if isinstance(store, RingRows) and len(positions) > store.capacity:
        positions, rows = positions[-store.capacity :], rows[-store.capacity :]
    store.write(positions, rows)


class StepIO:
    """The stage's stream state as its compiled models read and write it: a ring pool per sliding layer's
    keys and values and per layer's conv histories (`rings`, one slot per stream), and the far blocks of
    the last step's streams kept between steps (`far_stacks`)."""

    def __init__(self, shape: ModelShape, rings: list[LayerRings]) -> None:
        self.shape = shape
        self.rings = rings
        # far blocks of the last step's streams, per global-layer input, kept until a stream opens or
        # closes. One list of streams only: a shard taking its pipeline's groups in turn starts the
        # stack again at each group, as the copy of every step did, rather than holding a second copy
        # of every group's far blocks
        self.far_stacks: dict[str, FarStack] = {}

    def step_rings(self, plan: StepPlan, states: list[StreamState]) -> StepRings:
        streams = np.array([state.ring_slot for state in states], dtype=np.int64)
        ends = np.array([seg.start + seg.length for seg in plan.segments], dtype=np.int64)
        history = None
        if self.shape.has_convs:
            convs = self.rings[0].convs  # every conv ring of a stage has one capacity
            assert convs is not None
            history = history_slots([seg.start for seg in plan.segments], self.shape.conv_kernel_size, convs.capacity)
        return StepRings(streams, streams[plan.row_stream], ends[plan.row_stream], history)

    def layer_inputs(
        self,
        li: int,
        layer: CompiledLayer,
        plan: StepPlan,
        states: list[StreamState],
        step_rings: StepRings,
        joined: bool = False,
    ) -> tuple[dict[str, np.ndarray | ov.Tensor], np.ndarray | None]:
        """Layer `li`'s inputs but the residual rows: the step's tables and the streams' cached rows,
        and the MLP-output conv history (for a layer whose experts run apart). `joined`: as a joined
        stage takes them, the ring pools whole with the cells to read (`stage_graph.join_layers`)."""
        keys_plan = plan.keys[layer.attention.window]
        rings = self.rings[li]
        past = keys_plan.past_positions
        # a global layer's caches grow per stream; a sliding layer's rows are in its ring pools
        pooled = rings.keys is not None and rings.values is not None
        keys = [] if pooled else growing_caches([st.layers[li].keys for st in states])
        values = [] if pooled else growing_caches([st.layers[li].values for st in states])
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
            inputs.update(self.far_inputs("far_k", f"far_k_{li}", keys, keys_plan, states))
            inputs.update(self.far_inputs("far_v", f"far_v_{li}", values, keys_plan, states))
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

    def keep_layer_outputs(
        self, li: int, plan: StepPlan, states: list[StreamState], step_rings: StepRings, out: dict[str, np.ndarray]
    ) -> None:
        """Layer `li`'s new keys, values and convolution inputs (`conv_in` side by side, or each of
        `CONV_INPUTS`) into the streams' rings and caches."""
        rings = self.rings[li]
        if rings.convs is not None:
            joint = out.get("conv_in")
            if joint is None:
                joint = np.concatenate([out[name] for name in CONV_INPUTS], 1)
            step_rings.write(rings.convs, plan.row_position, joint)
        if rings.keys is not None and rings.values is not None:
            step_rings.write(rings.keys, plan.row_position, out["new_k"])
            step_rings.write(rings.values, plan.row_position, out["new_v"])
            return
        keys = growing_caches([st.layers[li].keys for st in states])
        values = growing_caches([st.layers[li].values for st in states])
        for b, (seg, stream_keys, stream_values) in enumerate(zip(plan.segments, keys, values, strict=True)):
            first = int(plan.row_offset[b])
            rows = slice(first, first + seg.length)
            write_rows(stream_keys, plan.row_position[rows], out["new_k"][rows])
            write_rows(stream_values, plan.row_position[rows], out["new_v"][rows])

    def far_inputs(
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
        stack = self.far_stacks.setdefault(key, FarStack())
        return stack.gather(owners, blocks, plan.far_blocks, plan.far_keys, fixed)
