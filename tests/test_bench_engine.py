"""`cascadia bench engine`: each precision with each expert kernel asked for, through the real command."""

from __future__ import annotations

import json

import pytest

from cascadia.engine.settings import EngineSettings
from tests.test_cli import cascadia


def test_each_expert_kernel_is_measured_under_its_own_label(tiny, tmp_path):
    done = cascadia(
        "bench", "engine", "--model", str(tiny), "--out", str(tmp_path), "--streams", "1,4",
        "--precisions", "f32,int8", "--expert-kernels", "auto,fused", "--steps", "2", "--repeats", "1", "--no-oracle",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "engine.json").read_text())
    kernels = {label: entry["expert_kernel"] for label, entry in summary["engine"].items()}
    assert kernels == {"f32": "grouped", "f32 fused": "fused", "int8": "fused", "int8 fused": "fused"}
    assert "GatherMatmul" not in summary["engine"]["f32"]["fused_ops"]
    assert summary["engine"]["f32 fused"]["fused_ops"].get("GatherMatmul") == 3
    for entry in summary["engine"].values():
        assert set(entry["decode"]) == {"1", "4"} and all(r["tokens_per_s"] > 0 for r in entry["decode"].values())
    # the kernels of one precision are timed in turn, and each after the first against it, round by round
    for count in ("1", "4"):
        base, other = summary["engine"]["f32"]["decode"][count], summary["engine"]["f32 fused"]["decode"][count]
        assert len(base["rounds_s"]) == len(other["rounds_s"]) == 1
        assert other["paired_vs_f32"] == pytest.approx(base["rounds_s"][0] / other["rounds_s"][0])
        assert "paired_vs_f32" not in base
    # both floors divide the same step bytes: their fractions differ by the two rates' ratio
    assert set(summary["matvec_bytes_per_s"]) == {"f32", "int8"}
    for label, entry in summary["engine"].items():
        matvec = summary["matvec_bytes_per_s"][label.split()[0]]
        assert matvec > 0
        for result in entry["decode"].values():
            ratio = result["fraction_of_matvec_floor"] / result["fraction_of_floor"]
            assert ratio == pytest.approx(summary["read_bandwidth_bytes_per_s"] / matvec)
    assert (tmp_path / "engine.png").stat().st_size > 0


def test_an_unknown_expert_kernel_is_named_in_the_error(tmp_path):
    done = cascadia("bench", "engine", "--out", str(tmp_path), "--expert-kernels", "fused,gemv")
    assert done.returncode == 2
    assert "'gemv' is not one of auto, fused, grouped" in done.stderr


def test_the_device_picks_the_expert_kernel_unless_told():
    assert EngineSettings().expert_kernel_path == "grouped"
    assert EngineSettings(expert_weights="int8").expert_kernel_path == "fused"
    assert EngineSettings(device="GPU").expert_kernel_path == "fused"
    assert EngineSettings(expert_kernel="fused").expert_kernel_path == "fused"
    assert EngineSettings(device="GPU", expert_kernel="grouped").ffn_form.experts == "grouped"


def test_an_unknown_expert_kernel_setting_is_refused():
    with pytest.raises(ValueError, match="expert_kernel 'gemv' is not one of auto, fused, grouped"):
        EngineSettings(expert_kernel="gemv")  # type: ignore[arg-type]
