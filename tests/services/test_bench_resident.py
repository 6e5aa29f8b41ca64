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


def test_mapped_weights_hold_less_anonymous_memory_than_weights_in_memory():
    import json
    import subprocess
    import sys

    from cascadia.model.loader import resolve

    def anonymous(*flags: str) -> float:
        cmd = [sys.executable, "-m", "cascadia.bench.resident", str(resolve("smollm2-135m")), "0:30", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
        return json.loads(done.stdout.strip().splitlines()[-1])["serving_anon_mib"]

    # the constants (about 90 MiB of SmolLM2's blocks) move from anonymous memory to file pages
    assert anonymous("--weights-in-memory") - anonymous() > 50
