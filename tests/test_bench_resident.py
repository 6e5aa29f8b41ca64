"""Resident memory of a stage, measured in a fresh process per range."""

from __future__ import annotations

from cascadia.bench.resident import measure_resident, model_bytes
from cascadia.model.config import load_shape


def test_each_range_is_measured_in_its_own_process_and_a_whole_model_holds_more_than_a_part(tiny):
    layers = load_shape(tiny).num_layers
    out = measure_resident(tiny, [(0, layers), (1, 2)])
    assert out["file_mib"] * 2**20 == model_bytes(tiny) > 0
    whole, middle = out["ranges"]
    assert whole["layers"] == [0, layers] and middle["layers"] == [1, 2]
    assert whole["serving_mib"] >= whole["loaded_mib"] > 0
    assert whole["loaded_mib"] > middle["loaded_mib"] > 0


def test_genai_is_measured_the_same_way_on_a_gguf_file():
    from cascadia.model.loader import resolve

    out = measure_resident(resolve("smollm2-135m"), [], genai=True)
    genai = out["genai"]
    assert out["ranges"] == [] and genai["layers"] == "genai"
    # the pipeline holds at least the file's weights once it has generated
    assert genai["serving_mib"] >= genai["loaded_mib"] > 0.5 * out["file_mib"]
    assert 0 < genai["serving_anon_mib"] <= genai["serving_mib"] + 1
