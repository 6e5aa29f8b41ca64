"""Weight formats: stacking weights for one matmul keeps every row's stored values."""

from __future__ import annotations

import numpy as np
import pytest

from cascadia.model.formats import Quantized, dequantize, quantize, stack_output_rows


def _weights(rows: tuple[int, ...], k: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(len(rows))
    return [rng.standard_normal((n, k)).astype(np.float32) for n in rows]


@pytest.mark.parametrize("fmt", ["f32", "f16", "int8", "int4"])
def test_stacked_rows_dequantise_to_the_rows_of_each_weight(fmt):
    weights = [quantize(w, fmt) for w in _weights((96, 32, 32))]
    stacked = stack_output_rows(weights)
    assert isinstance(stacked, Quantized) and stacked.shape == (160, 64)
    np.testing.assert_array_equal(dequantize(stacked), np.concatenate([dequantize(w) for w in weights]))


def test_gguf_blocks_stack_with_their_zero_points():
    rng = np.random.default_rng(3)

    def block(n: int) -> Quantized:
        values = rng.integers(0, 16, size=(n, 2, 32), dtype=np.uint8)
        scale = rng.random((n, 2, 1)).astype(np.float16)
        return Quantized("u4", values, scale, rng.integers(0, 16, size=(n, 2, 1), dtype=np.uint8))

    parts = [block(8), block(4)]
    stacked = stack_output_rows(parts)
    assert stacked is not None
    np.testing.assert_array_equal(dequantize(stacked), np.concatenate([dequantize(p) for p in parts]))


def test_plain_arrays_stack_and_unlike_weights_do_not():
    a, b = _weights((8, 4))
    np.testing.assert_array_equal(stack_output_rows([a, b]), np.concatenate([a, b]))
    assert stack_output_rows([quantize(a, "int8"), quantize(b, "int4")]) is None
    assert stack_output_rows([a, quantize(b, "int8")]) is None
    assert stack_output_rows([a, _weights((4,), k=32)[0]]) is None
