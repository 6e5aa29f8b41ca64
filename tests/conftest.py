"""Shared fixtures: synthetic checkpoints and the transformers oracle."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from cascadia.model.synthetic import SyntheticSpec, write_checkpoint

# the live fleet behind the gateway, shared by the gateway's test modules (one fleet per module)
pytest_plugins = ["tests.live_gateway"]

# Tiny configs chosen to hit every branch: ring wrap-around (window and rel_extent far below the
# test lengths), log scaling, shared experts, dense and MoE layers, sliding and global layers with
# different head counts and head sizes, grouped and ungrouped attention.
TINY_VARIANTS: dict[str, dict] = {
    "tiny": {},
    "tiny-alt": {
        "num_hidden_layers": 4,
        "local_layer_ids": [1, 2],
        "dense_mlp_idx": 2,
        "sliding_window_size": 5,
        "rel_extent": 7,
        "log_scaling_n_floor": 2,
        "n_routed_experts": 6,
        "num_experts_per_tok": 3,
        "n_shared_experts": 1,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_head_dim": 16,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
    },
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for seed, (name, overrides) in enumerate(TINY_VARIANTS.items()):
        spec = SyntheticSpec(preset="tiny", seed=seed, overrides=tuple(overrides.items()))
        out[name] = write_checkpoint(root / name, spec)
        out[name + "-published"] = write_checkpoint(
            root / (name + "-published"),
            SyntheticSpec(preset="tiny", seed=seed, layout="published", overrides=tuple(overrides.items())),
        )
    return out


@pytest.fixture(scope="session")
def tiny(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["tiny"]


@pytest.fixture(scope="session")
def tiny_codec(tiny: Path):
    from cascadia.gateway.text import TextCodec

    return TextCodec.from_directory(tiny)


@pytest.fixture(scope="session")
def tiny_vocabulary(tiny: Path):
    """The tiny model's tokens as grammars see them."""
    from cascadia.grammar import GrammarVocabulary
    from cascadia.model.config import load_shape

    return GrammarVocabulary.from_model(tiny, load_shape(tiny).unpadded_vocab_size)


@pytest.fixture
def redis_server(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing (make setup-services installs it)")
        pytest.skip("redis-server is not installed")
    from cascadia.router.local import free_port

    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    cmd += ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(tmp_path)]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0", process
    process.terminate()
    process.wait(10)
