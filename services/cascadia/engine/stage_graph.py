"""A stage's layer graphs joined into one model, so that a step is one call instead of one per layer.

Each layer's graph (`graphs.attention_graph` with its experts) reads the step's tables, its cached
rows and histories, and the residual rows `hidden`. Joined, layer n's `hidden` is layer n-1's output;
the tables every layer reads alike are one input; the key tables, which depend on a layer's window,
are one input per window; every other input and output carries the layer's number (`stage_name`).

A joined model also reads the rows a step needs from the stage's ring pools itself: a sliding layer's
cached band and every layer's convolution histories are gathered in the graph from the pools, handed
over whole and uncopied, at the cells the host works out once per step for all layers. At one row a
layer call costs the host a few hundred microseconds around the plugin's own work, and at 32 streams
the host's per-layer gathers took about a twentieth of a step of the mini preset.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np
import openvino as ov
import openvino.opset16 as ops

from cascadia.engine.graphs import graph_input, i64_constant

# a layer's four convolution histories, and its four convolution inputs, as they lie side by side in
# its stream rings: the joined model reads the histories from the ring and gives one output per layer
CONV_HISTORIES = ("conv_hist_k", "conv_hist_v", "conv_hist_o", "conv_hist_m")
CONV_INPUTS = ("k_conv_in", "v_conv_in", "o_conv_in", "m_conv_in")
# a sliding layer's cached band, read from its ring pools: each input of the layer graph by its pool
RING_INPUTS = {
    "past_k": "ring_k",
    "past_v": "ring_v",
    "past_k_params": "ring_k_params",
    "past_v_params": "ring_v_params",
}
# tables every layer of a step reads alike: `history_cells` [S * (K - 1)] the flat ring cells (slot *
# capacity + cell) of the streams' convolution histories, `history_keep` [S * (K - 1), 1] zero for
# rows before a stream's first position
SHARED_INPUTS = frozenset({"cell_rows", "row_cells", "conv_index", "query_position", "history_cells", "history_keep"})
# tables of the keys a row sees, one set per window (sliding layers of one width see the same keys);
# `band_cells` [S, L] the flat ring cells of each stream's cached band
WINDOW_INPUTS = frozenset({"key_mask", "key_distance", "far_mask", "band_cells"})
_LAYER_PREFIX = re.compile(r"^l(\d+)/")


def window_tag(window: int | None) -> str:
    return "global" if window is None else f"w{window}"


@functools.cache  # asked for every input and output of every step
def stage_name(name: str, layer: int, window: int | None) -> str:
    """The joined model's name for input or output `name` of the stage's `layer`-th graph."""
    if name in SHARED_INPUTS:
        return name
    if name in WINDOW_INPUTS:
        return f"{name}_{window_tag(window)}"
    return f"{name}_{layer}"


def ring_cells(slots: np.ndarray, positions: np.ndarray, capacity: int) -> np.ndarray:
    """Flat cells of a ring pool [slots * capacity, ...]: stream slot `slots[b]` at `positions[b]`."""
    return (slots.reshape(-1, *([1] * (positions.ndim - 1))) * capacity + positions % capacity).astype(np.int32)


def layer_of(op_name: str) -> int | None:
    """Which of the stage's layers a joined model's op came from (by the prefix `join_layers` gives it)."""
    match = _LAYER_PREFIX.match(op_name)
    return int(match.group(1)) if match else None


def join_layers(layers: Sequence[ov.Model], windows: Sequence[int | None]) -> ov.Model:
    """One model running `layers` in turn: input `hidden`, outputs each layer's outputs by `stage_name`,
    `layer_out_{n}` after each layer, and `hidden_out` after the last.

    A sliding layer (one with a window) reads its cached band from its ring pools `ring_k_{n}`,
    `ring_v_{n}` [slots, capacity, Hkv, D] (and `ring_*_params_{n}` for u8) at `band_cells`; every
    layer reads its convolution histories from its ring `conv_ring_{n}` [slots, capacity, widths] at
    `history_cells`, and gives its four convolution inputs as one output `conv_in_{n}`, in the ring's
    layout (`CONV_HISTORIES`, `CONV_INPUTS`).

    The layers' models are consumed (their ops move into the joined model). Their ops' names take the
    prefix `l{n}/`, so a compiled model's ops can still be told apart by layer (`layer_of`).
    """
    if len(layers) != len(windows) or not layers:
        raise ValueError("join_layers needs one window per layer, and at least one layer")
    params: list[ov.Node] = []
    results: list[ov.Node] = []
    shared: dict[str, ov.Node] = {}
    previous: ov.Output | None = None
    last = len(layers) - 1

    def shared_input(name: str, shape: list[int], dtype: str) -> ov.Node:
        if name not in shared:
            shared[name] = graph_input(name, shape, dtype)
            params.append(shared[name])
        return shared[name]

    for n, (model, window) in enumerate(zip(layers, windows, strict=True)):
        for op in model.get_ops():
            op.set_friendly_name(f"l{n}/{op.get_friendly_name()}")
        by_name = {param.get_output_tensor(0).get_any_name(): param for param in model.get_parameters()}
        read_from_rings: set[str] = set()
        if all(name in by_name for name in CONV_HISTORIES):
            cells = shared_input("history_cells", [-1], "i32")
            keep = shared_input("history_keep", [-1, 1], "f32")
            ring = graph_input(stage_name("conv_ring", n, window), [-1, -1, _joint_width(by_name)])
            params.append(ring)
            _split_histories([by_name[name] for name in CONV_HISTORIES], ops.multiply(_gathered(ring, cells), keep))
            read_from_rings.update(CONV_HISTORIES)
        if window is not None:
            cells = shared_input(stage_name("band_cells", n, window), [-1, -1], "i32")
            for name, pool in RING_INPUTS.items():
                if name in by_name:
                    band = by_name[name]
                    row = [dim.get_length() for dim in list(band.get_output_partial_shape(0))[2:]]
                    dtype = band.get_output_element_type(0).get_type_name()
                    ring = graph_input(stage_name(pool, n, window), [-1, -1, *row], dtype)
                    params.append(ring)
                    band.output(0).replace(_gathered(ring, cells).output(0))
                    read_from_rings.add(name)
        conv_inputs: dict[str, ov.Output] = {}
        for param in model.get_parameters():
            name = param.get_output_tensor(0).get_any_name()
            if name in read_from_rings:
                continue
            if name == "hidden" and previous is not None:
                param.output(0).replace(previous)
                continue
            joined = name if name == "hidden" else stage_name(name, n, window)
            if joined in shared:
                param.output(0).replace(shared[joined].output(0))
                continue
            param.get_output_tensor(0).set_names({joined})
            param.set_friendly_name(joined)
            params.append(param)
            if name in SHARED_INPUTS or name in WINDOW_INPUTS:
                shared[joined] = param
        for result in model.get_results():
            output = result.input_value(0)
            name = output.get_any_name()
            if name in CONV_INPUTS:
                conv_inputs[name] = output
                continue
            if name == "hidden_out":
                previous = output
                names = {f"layer_out_{n}", "hidden_out"} if n == last else {f"layer_out_{n}"}
            else:
                names = {stage_name(name, n, window)}
            output.get_tensor().set_names(names)
            results.append(ops.result(output))
        if conv_inputs:
            joint = ops.concat([conv_inputs[name] for name in CONV_INPUTS], 1)
            joint.output(0).get_tensor().set_names({f"conv_in_{n}"})
            results.append(ops.result(joint))
    return ov.Model(results, params, "stage")


def _gathered(ring: ov.Node, cells: ov.Node) -> ov.Node:
    """Rows of a ring pool [slots, capacity, *row] at flat cells [...]: [..., *row]."""
    row = [dim.get_length() for dim in list(ring.get_output_partial_shape(0))[2:]]
    return ops.gather(ops.reshape(ring, i64_constant(-1, *row), False), cells, ops.constant(np.int64(0)))


def _joint_width(by_name: dict[str, ov.Node]) -> int:
    return sum(by_name[name].get_output_partial_shape(0)[1].get_length() for name in CONV_HISTORIES)


def _split_histories(histories: list[ov.Node], joint: ov.Node) -> None:
    """The four convolution histories read from one joint [R, sum of widths], split in the graph."""
    widths = [history.get_output_partial_shape(0)[1].get_length() for history in histories]
    parts = ops.variadic_split(joint, ops.constant(np.int64(1)), i64_constant(*widths))
    for history, part in zip(histories, parts.outputs(), strict=True):
        history.output(0).replace(part)
