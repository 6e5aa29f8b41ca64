"""A stage's layer graphs joined into one model, so that a step is one call instead of one per layer.

Each layer's graph (`graphs.attention_graph` with its experts) reads the step's tables, its own cached
rows and histories, and the residual rows `hidden`. Joined, layer n's `hidden` is layer n-1's output;
the tables every layer reads alike are one input; the key tables, which depend on a layer's window,
are one input per window; every other input and output carries the layer's number (`stage_name`).

At one row a layer call costs the host a few hundred microseconds around the plugin's own work
(handing over a dozen inputs, starting the request, copying its outputs): about a tenth of a
one-stream step of the mini preset.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import openvino as ov
import openvino.opset16 as ops

# a layer's four convolution histories, and its four convolution inputs, as they lie side by side in
# its stream rings: the joined model takes one history input and gives one output per layer
CONV_HISTORIES = ("conv_hist_k", "conv_hist_v", "conv_hist_o", "conv_hist_m")
CONV_INPUTS = ("k_conv_in", "v_conv_in", "o_conv_in", "m_conv_in")
# tables every layer of a step reads alike
SHARED_INPUTS = frozenset({"cell_rows", "row_cells", "conv_index", "query_position"})
# tables of the keys a row sees, one set per window (sliding layers of one width see the same keys)
WINDOW_INPUTS = frozenset({"key_mask", "key_distance", "far_mask"})
_LAYER_PREFIX = re.compile(r"^l(\d+)/")


def window_tag(window: int | None) -> str:
    return "global" if window is None else f"w{window}"


def stage_name(name: str, layer: int, window: int | None) -> str:
    """The joined model's name for input or output `name` of the stage's `layer`-th graph."""
    if name in SHARED_INPUTS:
        return name
    if name in WINDOW_INPUTS:
        return f"{name}_{window_tag(window)}"
    return f"{name}_{layer}"


def layer_of(op_name: str) -> int | None:
    """Which of the stage's layers a joined model's op came from (by the prefix `join_layers` gives it)."""
    match = _LAYER_PREFIX.match(op_name)
    return int(match.group(1)) if match else None


def join_layers(layers: Sequence[ov.Model], windows: Sequence[int | None]) -> ov.Model:
    """One model running `layers` in turn: input `hidden`, outputs each layer's outputs by `stage_name`,
    `layer_out_{n}` after each layer, and `hidden_out` after the last. A layer's four convolution
    histories are one input `conv_hist_{n}` and its four convolution inputs one output `conv_in_{n}`,
    each in the layout of its stream rings (`CONV_HISTORIES`, `CONV_INPUTS`).

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
    for n, (model, window) in enumerate(zip(layers, windows, strict=True)):
        for op in model.get_ops():
            op.set_friendly_name(f"l{n}/{op.get_friendly_name()}")
        by_name = {param.get_output_tensor(0).get_any_name(): param for param in model.get_parameters()}
        joint_history = all(name in by_name for name in CONV_HISTORIES)
        if joint_history:
            params.append(_joint_histories([by_name[name] for name in CONV_HISTORIES], f"conv_hist_{n}"))
        conv_inputs: dict[str, ov.Output] = {}
        for param in model.get_parameters():
            name = param.get_output_tensor(0).get_any_name()
            if joint_history and name in CONV_HISTORIES:
                continue  # read from the joint history
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


def _joint_histories(histories: list[ov.Node], name: str) -> ov.Node:
    """One input [R, sum of widths] in place of a layer's four convolution histories, split in the graph:
    the host gathers them from the ring in this layout, and need not copy out each one."""
    widths = [history.get_output_partial_shape(0)[1].get_length() for history in histories]
    joint = ops.parameter(ov.PartialShape([-1, sum(widths)]), ov.Type.f32, name=name)
    joint.output(0).get_tensor().set_names({name})
    parts = ops.variadic_split(joint, ops.constant(np.int64(1)), ops.constant(np.array(widths, dtype=np.int64)))
    for history, part in zip(histories, parts.outputs(), strict=True):
        history.output(0).replace(part)
    return joint
