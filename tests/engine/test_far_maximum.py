"""The far keys' row maximum is exact whatever the masked slots hold."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset16 as ops

from cascadia.engine.graphs import _far_maximum

BLOCK = 4


def _compiled() -> ov.CompiledModel:
    scores = ops.parameter([-1, -1, 2, 1, 3, BLOCK], ov.Type.f32, name="scores")
    mask = ops.parameter([-1, -1], ov.Type.f32, name="mask")
    slot_mask = ops.reshape(mask, ops.constant(np.array([0, -1, 1, 1, 1, BLOCK], np.int64)), True)
    model = ov.Model([_far_maximum(scores, slot_mask, BLOCK)], [scores, mask])
    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def test_masked_slots_with_huge_scores_do_not_move_the_maximum():
    """Streams with 6, 1, 8 and 0 far keys over 3 blocks: the masked slots score 1e4, far above any
    far key, as a band key or a rewound one might; the maximum must be that of the far keys alone."""
    rng = np.random.default_rng(0)
    far_keys = np.array([6, 1, 8, 0])
    scores = rng.standard_normal((4, 3, 2, 1, 3, BLOCK)).astype(np.float32)
    position = np.arange(3 * BLOCK)
    visible = position[None, :] < far_keys[:, None]
    mask = np.where(visible, 0.0, -np.inf).astype(np.float32)
    flat = scores.transpose(0, 2, 3, 4, 1, 5).reshape(4, 2, 1, 3, 3 * BLOCK)
    flat[~np.broadcast_to(visible[:, None, None, None, :], flat.shape)] = 1e4
    scores = flat.reshape(4, 2, 1, 3, 3, BLOCK).transpose(0, 4, 1, 2, 3, 5).copy()

    top = _compiled()({"scores": scores, "mask": mask})[0]

    expected = np.where(visible[:, None, None, None, :], flat, -np.inf).max(axis=-1, keepdims=True)
    assert top.shape == (4, 2, 1, 3, 1)
    np.testing.assert_array_equal(top[:3], expected[:3])
    assert (top[3] < -1e30).all()  # no far key: below any score, so the band's maximum is taken
