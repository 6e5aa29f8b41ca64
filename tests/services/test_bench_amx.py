"""`cascadia bench amx`: the engine with AMX and without, in alternating processes, paired by round."""

from __future__ import annotations

import json

import pytest

from cascadia.bench.amx import engine_rates, paired_rates
from cascadia.cpu_isa import BELOW_AMX
from tests.services.test_cli import cascadia


def test_each_point_is_read_from_an_engine_bench():
    summary = {
        "engine": {
            "bf16": {
                "decode": {"1": {"tokens_per_s": 20.0}, "8": {"tokens_per_s": 70.0}},
                "prefill_tokens_per_s": 290.0,
            }
        }
    }
    assert engine_rates(summary) == {"bf16 1": 20.0, "bf16 8": 70.0, "bf16 prefill": 290.0}


def test_the_ratio_is_paired_by_round_not_taken_between_medians():
    # the machine slows down in round 2: each round's own ratio is 1.5, though the medians differ by less
    rounds = [
        {"on": {"bf16 1": 20.0}, "off": {"bf16 1": 30.0}},
        {"on": {"bf16 1": 10.0}, "off": {"bf16 1": 15.0}},
        {"on": {"bf16 1": 40.0}, "off": {"bf16 1": 60.0}},
    ]
    point = paired_rates(rounds)["bf16 1"]
    assert point["off_vs_on"] == pytest.approx(1.5)
    assert point["on"] == 20.0 and point["off"] == 30.0
    assert point["on_range"] == [10.0, 40.0] and point["off_range"] == [15.0, 60.0]


def test_the_two_choices_run_in_their_own_processes_under_their_own_caps(tiny, tmp_path):
    done = cascadia(
        "bench", "amx", "--model", str(tiny), "--out", str(tmp_path), "--streams", "1,2", "--precisions", "bf16",
        "--rounds", "1", "--steps", "2", "--repeats", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "amx.json").read_text())
    assert result["onednn_max_cpu_isa"] == {"on": None, "off": BELOW_AMX}
    assert set(result["points"]) == {"bf16 1", "bf16 2", "bf16 prefill"}
    for point in result["points"].values():
        assert point["on"] > 0 and point["off"] > 0
        assert point["off_vs_on"] == pytest.approx(point["off"] / point["on"])
    printed = json.loads(done.stdout)
    assert printed == result["points"]
    assert (tmp_path / "amx.png").stat().st_size > 0
    for choice in ("on", "off"):
        assert (tmp_path / "runs" / f"round-1-amx-{choice}" / "engine.json").exists()


def test_a_bad_precision_is_named(tiny, tmp_path):
    done = cascadia("bench", "amx", "--model", str(tiny), "--out", str(tmp_path), "--precisions", "bf17")
    assert done.returncode == 2 and "bf17" in done.stderr
