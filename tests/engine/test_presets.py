"""The precision modes, as the shard, the CLI and the CRD name them, and the engine settings behind each."""

from __future__ import annotations

import pytest

from cascadia.engine.settings import PRECISION_PRESETS, preset
from cascadia.operator.crd import crd


def test_the_crd_takes_every_precision_mode_a_shard_takes():
    mode = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["precision"]
    assert mode["properties"]["mode"]["enum"] == list(PRECISION_PRESETS)


@pytest.mark.parametrize("name", PRECISION_PRESETS)
def test_every_mode_has_settings_on_the_cpu_and_the_igpu(name):
    cpu, gpu = preset(name), preset(name, device="GPU")
    assert cpu.device == "CPU" and gpu.device == "GPU"
    # the iGPU computes low-precision experts in f16, the CPU in f32 (or bf16 where asked)
    assert gpu.expert_compute in ("f16", "f32", "bf16") and cpu.expert_compute in ("f32", "bf16")


def test_w4a8_keeps_attention_unquantised_in_the_arithmetic_of_each_device():
    assert preset("w4a8").attention_weights == "f32" and preset("w4a8", device="GPU").attention_weights == "f16"
    assert preset("w4a8").activation_quant_group == preset("w8a8").activation_quant_group == 32
    with pytest.raises(ValueError, match="precision 'w2a8' is not one of"):
        preset("w2a8")
