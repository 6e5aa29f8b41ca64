"""Reading checkpoints as their files define them: dtypes, FP8 scales, sharded indexes, and the errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from cascadia.model.checkpoint import CheckpointError, StageReader, TensorSource, load_stage
from cascadia.model.synthetic_real import e4m3_codes
from cascadia.model.tensor_files import E4M3_VALUES, PlannedTensor, bf16_bits, write_streamed


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_bf16_f16_f32_decode_exactly_as_torch_does(tmp_path):
    values = torch.randn(64, 96) * 3
    tensors = {"b": values.to(torch.bfloat16), "h": values.to(torch.float16), "f": values}
    source = TensorSource(_write(tmp_path, tensors))
    for name, tensor in tensors.items():
        expected = tensor.to(torch.float32).numpy()
        assert np.array_equal(source.get(name, (64, 96)), expected), name
        assert np.array_equal(source.get_block(name, (64, 96), slice(8, 40)), expected[8:40]), name
        assert np.array_equal(source.get_block(name, (64, 96), slice(None), slice(32, 64)), expected[:, 32:64])


def test_every_fp8_e4m3_code_decodes_as_torch_does():
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).to(torch.float32).numpy()
    finite = ~np.isnan(expected)
    assert np.array_equal(E4M3_VALUES[finite], expected[finite])
    assert np.isnan(E4M3_VALUES[~finite]).all()


def test_fp8_codes_round_to_the_nearest_value_as_torch_does():
    values = torch.randn(4096) * 100
    ours = e4m3_codes(values.numpy())
    theirs = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(ours, theirs)


def test_fp8_block_and_row_scales_dequantise_exactly(tmp_path):
    rng = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 126, (3, 200, 300), generator=rng, dtype=torch.uint8)
    fp8 = codes.view(torch.float8_e4m3fn)
    block_scale = torch.rand(3, 2, 3, generator=rng) + 0.5  # 128x128 blocks over 200x300
    row_scale = torch.rand(256, 1, generator=rng) + 0.5
    row_codes = torch.randint(0, 126, (256, 64), generator=rng, dtype=torch.uint8).view(torch.float8_e4m3fn)
    tensors = {
        "bank": fp8,
        "bank_scale_inv": block_scale,
        "proj.weight": row_codes,
        "proj.weight_scale": row_scale,
    }
    source = TensorSource(_write(tmp_path, tensors))
    expanded = block_scale.repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2)[:, :, :300]
    expected_bank = (fp8.to(torch.float32) * expanded).numpy()
    for e in range(3):
        assert np.array_equal(source.get_one("bank", (3, 200, 300), e), expected_bank[e])
    expected_rows = (row_codes.to(torch.float32) * row_scale).numpy()
    assert np.array_equal(source.get("proj.weight", (256, 64)), expected_rows)
    assert np.array_equal(source.get_block("proj.weight", (256, 64), slice(128, 256)), expected_rows[128:])


def test_fp8_without_its_scale_is_an_error_naming_it(tmp_path):
    source = TensorSource(_write(tmp_path, {"w.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match="w.weight_scale_inv"):
        source.get("w.weight", (4, 4))


def test_unsupported_dtype_is_an_error_naming_tensor_and_dtype(tmp_path):
    source = TensorSource(_write(tmp_path, {"w": torch.zeros(4, 4, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"tensor 'w' is I32"):
        source.get("w", (4, 4))


def test_streamed_writer_writes_what_safetensors_reads(tmp_path):
    from safetensors.torch import load_file

    values = np.random.default_rng(0).standard_normal((10, 7)).astype(np.float32)
    planned = [PlannedTensor("a", "F32", (10, 7)), PlannedTensor("b", "BF16", (10, 7))]
    write_streamed(tmp_path / "x.safetensors", planned, lambda t: iter([values[:4], values[4:]]))
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert np.array_equal(loaded["a"].numpy(), values)
    rounded = torch.from_numpy(values).to(torch.bfloat16)
    assert torch.equal(loaded["b"], rounded)
    assert np.array_equal(bf16_bits(values), rounded.view(torch.int16).numpy().view(np.uint16))


@pytest.fixture
def sharded(tmp_path, checkpoints) -> Path:
    """The tiny checkpoint split across two files with an index, as published checkpoints come."""
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file as save_numpy

    out = tmp_path / "sharded"
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoints["tiny"] / name, out / name)
    tensors = load_file(str(checkpoints["tiny"] / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file_name, part in halves.items():
        save_numpy({n: tensors[n] for n in part}, str(out / file_name))
        weight_map.update(dict.fromkeys(part, file_name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_a_sharded_checkpoint_reads_as_the_single_file(sharded, checkpoints):
    whole = load_stage(checkpoints["tiny"], 0, 5)
    split = load_stage(sharded, 0, 5)
    for a, b in zip(whole.layers, split.layers, strict=True):
        assert np.array_equal(a.experts.gate, b.experts.gate)
        assert np.array_equal(a.attention.q_proj, b.attention.q_proj)
    assert np.array_equal(whole.head, split.head)


def test_a_truncated_file_is_an_error_naming_it(sharded):
    path = sharded / "model-00002-of-00002.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors: truncated"):
        StageReader(sharded, 0, 5)


def test_an_index_naming_a_missing_file_is_an_error(sharded):
    (sharded / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002.safetensors: listed in the index but missing"):
        StageReader(sharded, 0, 5)


def test_a_missing_tensor_is_an_error_naming_it(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.self_attn.q_proj.weight"]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    reader = StageReader(sharded, 0, 5)
    reader.layer(1)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.2.self_attn.q_proj.weight'"):
        reader.layer(2)
