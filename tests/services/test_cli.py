"""The command-line contract, through real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cascadia.model.config import load_shape
from tests.oracle import greedy, load_oracle


def cascadia(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cascadia.cli", *args], capture_output=True, text=True, timeout=300)


def test_model_tiny_writes_a_checkpoint_transformers_loads(tmp_path):
    out = tmp_path / "m"
    done = cascadia("model", "tiny", str(out), "--seed", "7")
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert load_oracle(out).config.num_hidden_layers == 5


def test_generate_json_line_matches_the_oracle(tiny):
    ids = [1, 40, 41, 42, 300, 7]
    done = cascadia(
        "generate",
        "--model",
        str(tiny),
        "--prompt-ids",
        " ".join(map(str, ids)),
        "--max-tokens",
        "12",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(line) == {"token_ids", "text", "ttft_s", "decode_tokens_per_s"}
    assert line["token_ids"] == greedy(load_oracle(tiny), ids, 12)
    assert line["ttft_s"] > 0 and line["decode_tokens_per_s"] > 0


def test_the_amx_choice_is_checked_before_a_command_runs_and_bf16_runs_without_amx(tiny):
    args = ("generate", "--model", str(tiny), "--prompt-ids", "1 40 41", "--max-tokens", "4", "--precision", "bf16")
    bad = cascadia("--cpu-amx", "sometimes", *args)
    assert bad.returncode == 2 and "--cpu-amx: CPU AMX choice 'sometimes' is not one of auto, on, off" in bad.stderr
    done = cascadia("--cpu-amx", "off", *args, "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 4


@pytest.mark.parametrize("precision", ["int4", "w8a8"])
def test_generate_with_text_prompt_and_quantised_weights(tiny, precision):
    done = cascadia(
        "generate",
        "--model",
        str(tiny),
        "--prompt",
        "hello",
        "--max-tokens",
        "4",
        "--precision",
        precision,
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-ids", "1 x"], "--prompt-ids '1 x'"),
        (["--prompt-ids", "1 99999"], "99999 is outside the vocabulary"),
        (["--prompt-ids", "1", "--precision", "f8"], "--precision 'f8'"),
        (["--prompt-ids", "1", "--context", "4", "--max-tokens", "8"], "exceeds --context 4"),
        (["--prompt", "a", "--prompt-ids", "1"], "exactly one of"),
    ],
)
def test_generate_names_the_bad_value(tiny, args, message):
    done = cascadia("generate", "--model", str(tiny), *args)
    assert done.returncode == 2
    assert message in done.stderr.replace("\n", " ")


def test_unknown_model_path_is_named(tmp_path):
    done = cascadia("generate", "--model", str(tmp_path / "none"), "--prompt-ids", "1")
    assert done.returncode == 2 and "no such checkpoint directory" in done.stderr


def test_shard_memory_probe_refuses_a_context_that_cannot_fit(tiny):
    # the first stage holds global layers: 100k streams of 1024 positions cannot fit in 1 GiB
    done = cascadia(
        "shard", "--model", str(tiny), "--layers", "0:3", "--listen", "127.0.0.1:1", "--next", "127.0.0.1:2",
        "--memory", "1Gi", "--streams", "100000", "--context", "1024", "--kv-precision", "f16",
    )  # fmt: skip
    assert done.returncode == 2
    assert "--context 1024 does not fit" in done.stderr and "for 100000 streams in --memory 1Gi" in done.stderr
    # the probe's context is the largest whose planned state fits; f16 keys and values about double it
    from dataclasses import replace

    from cascadia.planner import PlanRequest, context_that_fits, stage_state_bytes

    shape = load_shape(tiny)
    span = (shape, 0, shape.num_layers)
    free = 8 << 20
    fits = {}
    for kv in ("f32", "f16"):
        request = PlanRequest(("shard",), free, streams=8, kv_precision=kv)
        fits[kv] = fit = context_that_fits(*span, request, free, 1 << 20)
        assert stage_state_bytes(*span, replace(request, context=fit)) <= free
        assert stage_state_bytes(*span, replace(request, context=fit + 1)) > free
    assert 1.8 * fits["f32"] < fits["f16"] < 2.2 * fits["f32"]
    assert context_that_fits(*span, PlanRequest(("shard",), 1, streams=8), 1, 1 << 20) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-draft", "16", "--draft-rows", "16"], "--max-draft 16 must be below --draft-rows 16"),
        (["--max-draft", "20"], "--max-draft 20 must be below --draft-rows 16 (the local fleet's)"),
        (["--form", "json"], "--form 'json' is not one of chat, completion"),
        (["--families", "edit,poems"], "--families: 'poems' is not one of copy, edit, rewrite, pattern, free"),
    ],
)
def test_bench_spec_refuses_a_draft_that_does_not_fit_its_rows(tmp_path, args, message):
    done = cascadia("bench", "spec", "--out", str(tmp_path), *args)
    assert done.returncode == 2
    assert message in done.stderr.replace("\n", " ")
    assert not any(tmp_path.iterdir())  # refused before any fleet started


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fleet", "--streams", "1,x"], "--streams '1,x': expected positive integers separated by commas"),
        (["fleet", "--shards", "0,4"], "--shards '0,4': expected positive integers"),
        (["context", "--lengths", "1k,4k"], "--lengths '1k,4k': expected positive integers"),
        (["load", "--clients", ""], "--clients '': expected positive integers"),
    ],
)
def test_bench_names_a_bad_count_list_before_starting_anything(tmp_path, args, message):
    done = cascadia("bench", *args, "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert message in done.stderr.replace("\n", " ")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_bench_fleet_pairs_the_fleets_and_accounts_each_frame(tiny, tmp_path):
    done = cascadia(
        "bench", "fleet", "--model", str(tiny), "--out", str(tmp_path), "--shards", "1,2",
        "--streams", "1,3", "--repeats", "2", "--new-tokens", "6",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "fleet.json").read_text())
    assert (summary["frames_in_flight"], summary["repeats"]) == (1, 2)
    assert (tmp_path / "fleet.png").stat().st_size > 0
    for shards, results in summary["fleets"].items():
        assert set(results) == {"1", "3"}
        for result in results.values():
            assert result["decode_tokens_per_s"] > 0
            assert result["frame_ms"] >= result["stages_busy_ms"] > 0  # the stages' busy time is part of the frame's
            assert ("pipeline_efficiency" in result) == (shards == "2")
