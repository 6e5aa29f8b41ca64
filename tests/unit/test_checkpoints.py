"""Checkpoint and config reading: both layouts, and clear failures."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cascadia.model.checkpoint import CheckpointError, load_stage
from cascadia.model.config import ConfigError, load_shape, shape_from_config
from cascadia.model.synthetic import text_config


def test_published_config_is_read_like_the_transformers_one(checkpoints):
    hf, pub = load_shape(checkpoints["tiny"]), load_shape(checkpoints["tiny-published"])
    assert pub.layout == "published" and hf.layout == "inkling_text"
    assert pub.attention == hf.attention and pub.mlp_kinds == hf.mlp_kinds


def test_layer_types_follow_the_oracle_rules():
    shape = shape_from_config({"num_hidden_layers": 12, "dense_mlp_idx": 2})
    assert [a.kind for a in shape.attention] == ["sliding"] * 5 + ["global"] + ["sliding"] * 5 + ["global"]
    assert shape.mlp_kinds[:3] == ("dense", "dense", "sparse")
    swapped = shape_from_config({"num_hidden_layers": 2, "intermediate_size": 96, "dense_intermediate_size": 512})
    assert (swapped.intermediate_size, swapped.moe_intermediate_size) == (512, 96)


def test_only_the_requested_layer_range_is_read(tiny):
    stage = load_stage(tiny, 2, 4)
    assert [layer.index for layer in stage.layers] == [2, 3]
    assert stage.embed is None and stage.head is None
    assert load_stage(tiny, 0, 1).embed is not None
    assert load_stage(tiny, 4, 5).head is not None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"shared_expert_sink": False}, "shared_expert_sink"),
        ({"layer_types": ["hybrid"]}, "'layer_types' has 1 entries"),
        ({"num_attention_heads": 3}, "not divisible"),
        ({"hidden_size": -4}, "'hidden_size' must be a positive integer"),
    ],
)
def test_unsupported_config_values_are_named(change, message):
    cfg = text_config("tiny") | change
    with pytest.raises(ConfigError, match=message):
        shape_from_config(cfg)


def _copy_with(tmp_path, src, edit):
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(tmp_path, tiny):
    name = "model.layers.3.self_attn.k_norm.weight"
    broken = _copy_with(tmp_path, tiny, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_stage(broken, 0, 5)
    load_stage(broken, 0, 3)  # a range without that layer still loads


def test_wrong_shape_is_named(tmp_path, tiny):
    name = "model.layers.1.mlp.experts.down_proj"

    def shrink(t):
        t[name] = np.ascontiguousarray(t[name][:, :, :-1])

    broken = _copy_with(tmp_path, tiny, shrink)
    with pytest.raises(CheckpointError, match=f"'{name}' has shape"):
        load_stage(broken, 1, 2)


def test_bad_range_and_missing_files_fail_clearly(tmp_path, tiny):
    with pytest.raises(CheckpointError, match="not inside the model's 0:5"):
        load_stage(tiny, 3, 9)
    with pytest.raises(ConfigError, match="no config.json"):
        load_shape(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(text_config("tiny")))
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        load_stage(tmp_path, 0, 1)
