"""`cascadia convert`: a converted stage serves exactly what its checkpoint serves, in one process and across
shard processes, for every precision; it refuses what it was not converted for; it is written once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cascadia.engine import converted
from cascadia.engine.settings import PRECISION_PRESETS, preset
from cascadia.model.config import load_shape

PROMPT = ("--prompt-ids", "1 17 250 3 99 480", "--max-tokens", "12", "--json")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cascadia.cli", *args], capture_output=True, text=True, timeout=600)


def _ids(result: subprocess.CompletedProcess) -> list[int]:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISION_PRESETS)
def test_a_converted_model_serves_the_checkpoint_s_ids_in_one_process_and_across_shards(tiny, tmp_path, precision):
    out = tmp_path / "converted"
    assert _cli("convert", "--model", str(tiny), "--out", str(out), "--precision", precision).returncode == 0
    expected = _ids(_cli("generate", "--model", str(tiny), "--precision", precision, *PROMPT))
    assert _ids(_cli("generate", "--model", str(out), "--precision", precision, *PROMPT)) == expected
    shards = ("--shards", "2")
    assert _ids(_cli("generate", "--model", str(out), "--precision", precision, *shards, *PROMPT)) == expected


def test_the_engine_from_a_converted_stage_computes_the_same_logits(tiny, tmp_path):
    from cascadia.engine.engine import StageEngine
    from cascadia.model.checkpoint import StageReader
    from tests.engine.test_engine_numerics import run_prompt

    settings = preset("int4")
    converted.convert(tiny, tmp_path / "c", settings, "int4", 0, 5)
    store = converted.open_converted(tmp_path / "c", settings, 0, 5, "int4")
    shape = load_shape(tiny)
    ids = [1, 17, 250, 3, 99, 480, 12, 7, 300, 45, 45, 46]
    _, from_files = run_prompt(StageEngine(converted.ConvertedLayers(shape, 0, 5), settings, graph_store=store), ids)
    _, direct = run_prompt(StageEngine(StageReader(tiny, 0, 5, settings.stored_forms), settings), ids)
    assert np.array_equal(from_files, direct)


def test_it_refuses_layers_precisions_and_devices_it_was_not_converted_for(tiny, tmp_path):
    out = tmp_path / "part"
    assert (
        _cli("convert", "--model", str(tiny), "--out", str(out), "--precision", "int8", "--layers", "1:3").returncode
        == 0
    )
    manifest = converted.read_manifest(out)
    assert manifest["layers"] == [1, 3] and manifest["graphs"] == ["layer1", "layer2"]
    whole = _cli("generate", "--model", str(out), "--precision", "int8", *PROMPT)
    assert whole.returncode == 2 and "holds layers 1:3 converted at int8 for CPU; asked for layers 0:5" in whole.stderr
    other = converted.open_converted
    with pytest.raises(converted.ConvertedStageError, match="asked for precision int4"):
        other(out, preset("int4"), 1, 3, "int4")
    with pytest.raises(converted.ConvertedStageError, match="kv_precision 'f16'"):
        other(out, preset("int8", kv_precision="f16"), 1, 3)
    with pytest.raises(converted.ConvertedStageError, match="device 'GPU'"):
        other(out, preset("int8", device="GPU"), 2, 3)
    assert isinstance(
        other(out, preset("int8", context=4096), 2, 3), converted.ReadGraphs
    )  # a range inside, run-time settings
    again = _cli("convert", "--model", str(out), "--out", str(tmp_path / "x"), "--precision", "int8")
    assert again.returncode == 2 and "already a converted stage" in again.stderr
    bad = _cli("convert", "--model", str(tiny), "--out", str(tmp_path / "y"), "--layers", "3:9")
    assert bad.returncode == 2 and "--layers 3:9 is not inside the model's 0:5" in bad.stderr


def test_a_second_run_writes_nothing_and_a_changed_input_converts_again(tiny, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    out = tmp_path / "c"
    first = converted.convert(model, out, preset("int4"), "int4", 0, 5)
    again = converted.convert(model, out, preset("int4"), "int4", 0, 5)
    assert not first.up_to_date and again.up_to_date and again.bytes_written == 0
    other_precision = converted.convert(model, out, preset("int8"), "int8", 0, 5)
    assert not other_precision.up_to_date and converted.read_manifest(out)["precision"] == "int8"
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert not converted.convert(model, out, preset("int8"), "int8", 0, 5).up_to_date
    assert converted.convert(model, out, preset("int8"), "int8", 0, 5).up_to_date


def test_a_conversion_made_by_other_graph_code_is_made_again(tiny, tmp_path, monkeypatch):
    code = tmp_path / "graphs.py"
    code.write_text("# one version of the graph code\n")
    monkeypatch.setattr(converted, "_graph_code", lambda: (code,))
    out = tmp_path / "c"
    assert not converted.convert(tiny, out, preset("int4"), "int4", 0, 5).up_to_date
    assert converted.convert(tiny, out, preset("int4"), "int4", 0, 5).up_to_date
    code.write_text("# the graph code changed\n")
    assert not converted.convert(tiny, out, preset("int4"), "int4", 0, 5).up_to_date
    assert converted.code_digest() != converted.code_digest((tmp_path / "graphs.py", code))


def test_an_interrupted_conversion_leaves_nothing_a_shard_would_load(tiny, tmp_path, monkeypatch):
    out = tmp_path / "c"
    calls = []

    def failing_builder(source, settings, name):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_builder(source, settings, name)

    real_builder = converted.graph_builder
    monkeypatch.setattr(converted, "graph_builder", failing_builder)
    with pytest.raises(KeyboardInterrupt):
        converted.convert(tiny, out, preset("int4"), "int4", 0, 5)
    assert not out.exists() and not list(tmp_path.glob(".c.partial-*"))
    # a process killed outright leaves its partial directory: never loadable, and cleared by the next run
    (tmp_path / ".c.partial-999999" / "graphs").mkdir(parents=True)
    assert not converted.is_converted(tmp_path / ".c.partial-999999")
    monkeypatch.setattr(converted, "graph_builder", real_builder)
    converted.convert(tiny, out, preset("int4"), "int4", 0, 5)
    assert converted.is_converted(out) and not list(tmp_path.glob(".c.partial-*"))


def test_plan_of_a_converted_model_takes_the_formats_it_holds(tiny, tmp_path):
    out = tmp_path / "c"
    converted.convert(tiny, out, preset("f16"), "f16", 0, 5)

    def weights(model: Path, *extra: str) -> int:
        done = _cli("plan", "--model", str(model), "--nodes", "1", "--node-memory", "8Gi", "--json", *extra)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["plan"][0]["weightBytes"]

    assert weights(out) == weights(
        tiny, "--expert-weights", "f16", "--attention-weights", "f16", "--head-weights", "f16"
    )
    assert weights(out) != weights(tiny)
