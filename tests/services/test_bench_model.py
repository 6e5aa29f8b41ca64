"""The analytic fleet model: the bandwidth floor when nothing is lost, and measured losses lower it."""

from __future__ import annotations

import pytest

from cascadia.bench.model import Measured, interpolate, predicted_throughput
from cascadia.planner import GIB, PlanRequest, floor_throughput, plan_fleet, preset_shape


@pytest.fixture(scope="module")
def fleet():
    shape = preset_shape("inkling-975b")
    request = PlanRequest(tuple(f"pc-{i}" for i in range(11)), 61 * GIB, layers_per_node=6, streams=176)
    return shape, plan_fleet(shape, request), request


def test_a_lossless_measurement_gives_back_the_bandwidth_floor(fleet):
    shape, plan, request = fleet
    perfect = Measured({1: 1.0, 32: 1.0}, 0.0, "ideal")
    for streams in (1, 88, 176):
        predicted = predicted_throughput(shape, plan, request, streams, 100e9, perfect, link_latency_s=0.0)
        assert predicted == pytest.approx(floor_throughput(shape, plan, request, streams, 100e9))


def test_measured_losses_lower_the_prediction_in_proportion(fleet):
    shape, plan, request = fleet
    half = Measured({1: 0.5, 32: 0.5}, 0.0, "half")
    overhead = Measured({1: 1.0, 32: 1.0}, 0.005, "overhead")
    floor = floor_throughput(shape, plan, request, 88, 100e9)
    assert predicted_throughput(shape, plan, request, 88, 100e9, half, link_latency_s=0.0) < floor
    assert predicted_throughput(shape, plan, request, 88, 100e9, overhead, link_latency_s=0.0) < floor
    assert predicted_throughput(shape, plan, request, 88, 100e9, half, link_latency_s=0.0) > floor / 2


def test_efficiency_is_interpolated_in_log_rows_and_flat_outside():
    at = interpolate({1: 0.5, 8: 0.8, 32: 0.4})
    assert at(1) == 0.5 and at(8) == 0.8 and at(64) == 0.4 and at(0) == 0.5
    assert 0.5 < at(2) < 0.8 and 0.4 < at(16) < 0.8
