"""Synthetic Inkling checkpoints at the 975B model's real width, written tensor by tensor.

Every layer has the published dimensions (hidden 6144, 64 query heads of 128, expert width 3072,
dense width 24576); only the number of layers, routed experts and vocabulary rows shrink, so that a
checkpoint fits on a build machine while every matrix a shard multiplies has its deployed size. The
files are sharded with a `model.safetensors.index.json`, as published checkpoints are, and each
tensor is drawn and written piece by piece (one expert, or a few thousand rows, at a time): no
tensor, let alone the model, is ever whole in memory.

Each tensor draws from a generator seeded by the seed and the tensor's transformers name, so both
layouts of one seed hold the same model. `--dtype fp8` stores the projections as FP8 E4M3 with one
f32 scale per 128x128 block (`<name>_scale_inv`), as block-quantised FP8 checkpoints do.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cascadia.model.config import shape_from_config
from cascadia.model.synthetic import ATTENTION_NAMES, BASE_TEXT_CONFIG, write_tokenizer
from cascadia.model.tensor_files import E4M3_VALUES, PlannedTensor, write_streamed

REAL_WIDTH_PRESET = "inkling-975b"
DTYPES = {"bf16": "BF16", "f16": "F16", "f32": "F32", "fp8": "F8_E4M3"}
FP8_BLOCK = 128
CHUNK_VALUES = 1 << 24  # values drawn at a time (64 MB in f32)
DEFAULT_SHARD_BYTES = 2 << 30


def real_width_config(layers: int, experts: int, vocab: int) -> dict[str, Any]:
    """The 975B model's text config with `layers` layers, `experts` routed experts and `vocab` rows.

    The first layer is dense and the rest sparse (the published model has two dense layers of 66),
    every sixth layer is global and, with fewer than six layers, the last one is, so that a short
    checkpoint still has both kinds; log scaling starts at position 16 so that short tests reach it.
    """
    from cascadia.planner import PRESET_CONFIGS

    if layers < 1 or experts < 1 or vocab < 512:
        raise ValueError(f"need at least 1 layer, 1 expert and 512 vocabulary rows (got {layers}, {experts}, {vocab})")
    cfg: dict[str, Any] = {
        **BASE_TEXT_CONFIG,
        "route_scale": 2.5,
        "logits_mup_width_multiplier": 16.0,
        "log_scaling_n_floor": 16,
        "log_scaling_alpha": 0.1,
        "max_position_embeddings": 1048576,
    }
    cfg.update(PRESET_CONFIGS[REAL_WIDTH_PRESET])
    globals_ = [i for i in range(layers) if i % 6 == 5] or [layers - 1]
    cfg.update(
        {
            "num_hidden_layers": layers,
            "dense_mlp_idx": min(cfg["dense_mlp_idx"], max(layers - 1, 1)),
            "local_layer_ids": [i for i in range(layers) if i not in globals_],
            "n_routed_experts": experts,
            "num_experts_per_tok": min(cfg["num_experts_per_tok"], experts),
            "vocab_size": vocab,
            "unpadded_vocab_size": vocab - vocab // 64,
        }
    )
    return cfg


@dataclass(frozen=True)
class Init:
    """How a tensor's values are drawn: normal(std), a norm weight (1 + N(0, 0.1), times `gain`), a scalar."""

    kind: str
    std: float = 1.0
    gain: float = 1.0


def _text_tensors(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], Init]]:
    """Every tensor of the checkpoint in transformers' names, with its shape and how it is drawn."""
    shape = shape_from_config(cfg)
    h, k, v = shape.hidden_size, shape.conv_kernel_size, shape.vocab_size
    norm = Init("norm")
    out: list[tuple[str, tuple[int, ...], Init]] = [
        ("model.embed_tokens.weight", (v, h), Init("normal", 1.0)),
        ("model.embed_tokens.embed_norm.weight", (h,), norm),
    ]
    for i in range(shape.num_layers):
        p, a = f"model.layers.{i}.", shape.layer_attention(i)
        out += [
            (p + "input_layernorm.weight", (h,), norm),
            (p + "post_attention_layernorm.weight", (h,), norm),
            (p + "self_attn.q_proj.weight", (a.q_width, h), Init("normal", 1 / math.sqrt(h))),
            (p + "self_attn.k_proj.weight", (a.kv_width, h), Init("normal", 1 / math.sqrt(h))),
            (p + "self_attn.v_proj.weight", (a.kv_width, h), Init("normal", 1 / math.sqrt(h))),
            (p + "self_attn.r_proj.weight", (a.num_heads * shape.d_rel, h), Init("normal", 1 / math.sqrt(h))),
            (p + "self_attn.o_proj.weight", (h, a.q_width), Init("normal", 1 / math.sqrt(a.q_width))),
            (p + "self_attn.q_norm.weight", (a.head_dim,), Init("norm", gain=math.sqrt(a.head_dim))),
            (p + "self_attn.k_norm.weight", (a.head_dim,), norm),
            (p + "self_attn.k_sconv.conv1d.weight", (a.kv_width, 1, k), Init("normal", 0.3)),
            (p + "self_attn.v_sconv.conv1d.weight", (a.kv_width, 1, k), Init("normal", 0.3)),
            (p + "self_attn.rel_logits_proj.proj", (shape.d_rel, a.rel_extent), Init("normal", 0.5)),
            (p + "attn_sconv.conv1d.weight", (h, 1, k), Init("normal", 0.3)),
            (p + "mlp_sconv.conv1d.weight", (h, 1, k), Init("normal", 0.3)),
        ]
        m = p + "mlp."
        if shape.is_dense(i):
            width = shape.intermediate_size
            out += [
                (m + "gate_proj.weight", (width, h), Init("normal", 1 / math.sqrt(h))),
                (m + "up_proj.weight", (width, h), Init("normal", 1 / math.sqrt(h))),
                (m + "down_proj.weight", (h, width), Init("normal", 1 / math.sqrt(width))),
                (m + "global_scale", (1,), Init("scalar")),
            ]
        else:
            e, s, w = shape.n_routed_experts, shape.n_shared_experts, shape.moe_intermediate_size
            out += [
                (m + "gate.weight", (e + s, h), Init("normal", 2 / math.sqrt(h))),
                (m + "gate.global_scale", (1,), Init("scalar")),
                (m + "gate.e_score_correction_bias", (e,), Init("normal", 0.1)),
                (m + "experts.gate_up_proj", (e, 2 * w, h), Init("normal", 1 / math.sqrt(h))),
                (m + "experts.down_proj", (e, h, w), Init("normal", 1 / math.sqrt(w))),
                (m + "shared_experts.gate_proj", (s, w, h), Init("normal", 1 / math.sqrt(h))),
                (m + "shared_experts.up_proj", (s, w, h), Init("normal", 1 / math.sqrt(h))),
                (m + "shared_experts.down_proj", (s, h, w), Init("normal", 1 / math.sqrt(w))),
            ]
    out += [
        ("model.norm.weight", (h,), norm),
        ("lm_head.weight", (v, h), Init("normal", 4 / math.sqrt(h))),
    ]
    return out


def _draws(seed: int, name: str, shape: tuple[int, ...], init: Init) -> Iterator[np.ndarray]:
    """The tensor's f32 values, in pieces along its first axis (whole rows of the rest)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    rest = shape[1:]
    per_row = max(1, math.prod(rest))
    step = max(1, CHUNK_VALUES // per_row)
    if init.kind == "scalar":
        yield np.array([0.8 + 0.4 * rng.random()], dtype=np.float32)
        return
    for start in range(0, shape[0], step):
        piece = rng.standard_normal((min(step, shape[0] - start), *rest), dtype=np.float32)
        if init.kind == "normal":
            yield piece * np.float32(init.std)
        else:
            yield (np.float32(1.0) + piece * np.float32(0.1)) * np.float32(init.gain)


def _rows(draws: Iterator[np.ndarray], rows: int) -> Iterator[np.ndarray]:
    """Regroup pieces along the first axis into pieces of exactly `rows` (an expert, a block of rows)."""
    held: list[np.ndarray] = []
    count = 0
    for piece in draws:
        held.append(piece)
        count += len(piece)
        while count >= rows:
            joined = np.concatenate(held) if len(held) > 1 else held[0]
            yield joined[:rows]
            rest = joined[rows:]
            held, count = ([rest] if len(rest) else []), len(rest)
    if count:
        yield np.concatenate(held)


def _interleaved(gate: Iterator[np.ndarray], up: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """Rows g0, u0, g1, u1, ... from pieces of gate and up rows of equal sizes."""
    for g, u in zip(gate, up, strict=True):
        both = np.empty((2 * len(g), *g.shape[1:]), np.float32)
        both[0::2], both[1::2] = g, u
        yield both


def _split_interleaved(pairs: Iterator[np.ndarray], w: int) -> Iterator[np.ndarray]:
    """Experts [2w, H] as transformers stores them (gate rows, then up rows) -> interleaved rows."""
    for pair in pairs:
        for expert in pair:
            both = np.empty_like(expert)
            both[0::2], both[1::2] = expert[:w], expert[w:]
            yield both[None]


def e4m3_codes(values: np.ndarray) -> np.ndarray:
    """f32 values (already within +-448) -> the nearest FP8 E4M3 codes (ties to the even code)."""
    table = E4M3_VALUES[:127]  # the non-negative finite values, increasing, codes 0..126
    magnitude = np.abs(values)
    upper = np.clip(np.searchsorted(table, magnitude), 1, 126)
    lower = upper - 1
    below, above = magnitude - table[lower], table[upper] - magnitude
    pick = np.where((above < below) | ((above == below) & (upper % 2 == 0)), upper, lower).astype(np.uint8)
    return pick | np.where(values < 0, np.uint8(0x80), np.uint8(0))


def _fp8(pieces: Iterator[np.ndarray], scales: list[np.ndarray]) -> Iterator[np.ndarray]:
    """FP8 codes of 2-D weights in pieces of whole 128-row blocks ([rows, K], or [1, N, K] per expert),
    appending each piece's block scales (amax / 448) to `scales`."""
    for piece in pieces:
        matrix = piece.reshape(-1, piece.shape[-1])
        n, k = matrix.shape
        bn, bk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        padded = np.zeros((bn * FP8_BLOCK, bk * FP8_BLOCK), np.float32)
        padded[:n, :k] = matrix
        blocks = padded.reshape(bn, FP8_BLOCK, bk, FP8_BLOCK)
        scale = np.abs(blocks).max(axis=(1, 3)) / np.float32(448.0)
        scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
        scales.append(scale[None] if piece.ndim == 3 else scale)
        expanded = np.repeat(np.repeat(scale, FP8_BLOCK, 0), FP8_BLOCK, 1)[:n, :k]
        yield e4m3_codes(matrix / expanded).reshape(piece.shape)


def _published_name(name: str) -> str:
    renames = {
        "model.embed_tokens.weight": "model.llm.embed.weight",
        "model.embed_tokens.embed_norm.weight": "model.llm.embed_norm.weight",
        "model.norm.weight": "model.llm.norm.weight",
        "lm_head.weight": "model.llm.unembed.weight",
    }
    if name in renames:
        return renames[name]
    name = name.replace("model.layers.", "model.llm.layers.")
    pairs = [
        ("input_layernorm.", "attn_norm."),
        ("post_attention_layernorm.", "mlp_norm."),
        ("self_attn.k_sconv.conv1d.", "attn.k_sconv."),
        ("self_attn.v_sconv.conv1d.", "attn.v_sconv."),
        ("attn_sconv.conv1d.", "attn_sconv."),
        ("mlp_sconv.conv1d.", "mlp_sconv."),
        ("mlp.down_proj.", "mlp.w2_md."),
        ("mlp.experts.down_proj", "mlp.experts.w2_weight"),
        ("mlp.shared_experts.down_proj", "mlp.shared_experts.shared_w2_weight"),
        ("mlp.gate.e_score_correction_bias", "mlp.gate.bias"),
        *((f"self_attn.{ours}.", f"attn.{theirs}.") for ours, theirs in ATTENTION_NAMES.items()),
        ("self_attn.", "attn."),
    ]
    for ours, theirs in pairs:
        if ours in name:
            return name.replace(ours, theirs)
    return name


Producer = Callable[[], Iterator[np.ndarray]]


def _planned(cfg: dict[str, Any], seed: int, dtype: str, layout: str) -> list[tuple[PlannedTensor, Producer]]:
    """Each tensor the files hold, in order, with what produces its pieces."""
    stored = DTYPES[dtype]
    fp8 = stored == "F8_E4M3"
    text = _text_tensors(cfg)
    shapes = {name: (shape, init) for name, shape, init in text}
    w = cfg["moe_intermediate_size"]
    planned: list[tuple[PlannedTensor, Producer]] = []

    def draws(name: str, rows: int | None = None) -> Iterator[np.ndarray]:
        shape, init = shapes[name]
        pieces = _draws(seed, name, shape, init)
        return _rows(pieces, rows) if rows else pieces

    def add(name: str, shape: tuple[int, ...], produce: Producer, projection: bool) -> None:
        if fp8 and projection:
            scales: list[np.ndarray] = []
            planned.append((PlannedTensor(name, "F8_E4M3", shape), lambda: _fp8(produce(), scales)))
            grid = (*shape[:-2], -(-shape[-2] // FP8_BLOCK), -(-shape[-1] // FP8_BLOCK))
            scale_name = (
                name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"
            )
            planned.append((PlannedTensor(scale_name, "F32", grid), lambda: iter([np.concatenate(scales)])))
            return
        kind = "BF16" if stored == "F8_E4M3" else stored  # FP8 checkpoints keep the rest in bf16
        planned.append((PlannedTensor(name, kind, shape), produce))

    def is_projection(name: str, shape: tuple[int, ...]) -> bool:
        return len(shape) >= 2 and ("_proj" in name) and "sconv" not in name and "rel_logits" not in name

    done: set[str] = set()
    for name, shape, _init in text:
        if name in done:
            continue
        block = FP8_BLOCK if fp8 else None
        if layout == "published" and name.endswith("mlp.gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            rows = FP8_BLOCK // 2 if fp8 else None
            target = name.replace("model.layers.", "model.llm.layers.").replace("mlp.gate_proj.", "mlp.w13_dn.")
            add(
                target,
                (2 * shape[0], shape[1]),
                lambda g=name, u=up, r=rows: _interleaved(draws(g, r or 2048), draws(u, r or 2048)),
                True,
            )
            done |= {name, up}
            continue
        if layout == "published" and name.endswith("experts.gate_up_proj"):
            target = _published_name(name).replace("experts.gate_up_proj", "experts.w13_weight")
            add(target, shape, lambda n=name: _split_interleaved(draws(n, 1), w), True)
            continue
        if layout == "published" and name.endswith("shared_experts.gate_proj"):
            up = name.replace("gate_proj", "up_proj")
            target = _published_name(name).replace("shared_experts.gate_proj", "shared_experts.shared_w13_weight")

            def shared(g: str = name, u: str = up) -> Iterator[np.ndarray]:
                for gate, upper in zip(draws(g, 1), draws(u, 1), strict=True):
                    both = np.empty((1, 2 * w, gate.shape[-1]), np.float32)
                    both[0, 0::2], both[0, 1::2] = gate[0], upper[0]
                    yield both

            add(target, (shape[0], 2 * w, shape[2]), shared, True)
            done |= {name, up}
            continue
        target = _published_name(name) if layout == "published" else name
        rows = 1 if len(shape) == 3 else block
        add(target, shape, lambda n=name, r=rows: draws(n, r), is_projection(name, shape))
    return planned


def write_real_width(
    out_dir: Path,
    layers: int = 2,
    experts: int = 8,
    vocab: int = 4096,
    dtype: str = "bf16",
    layout: str = "inkling_text",
    seed: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a real-width checkpoint (see the module's text) to `out_dir`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    if layout not in ("inkling_text", "published"):
        raise ValueError(f"layout '{layout}' is not one of inkling_text, published")
    cfg = real_width_config(layers, experts, vocab)
    cfg["torch_dtype"] = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "fp8": "bfloat16"}[dtype]
    if dtype == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    planned = _planned(cfg, seed, dtype, layout)
    files: list[list[tuple[PlannedTensor, Producer]]] = [[]]
    size = 0
    for item in planned:
        if files[-1] and size + item[0].nbytes > shard_bytes and not item[0].name.endswith("_scale_inv"):
            files.append([])
            size = 0
        files[-1].append(item)
        size += item[0].nbytes
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    producers = {t.name: produce for t, produce in planned}
    total = 0
    for n, group in enumerate(files, 1):
        name = f"model-{n:05d}-of-{len(files):05d}.safetensors"
        tensors = [t for t, _ in group]
        write_streamed(out_dir / name, tensors, lambda t: producers[t.name]())
        for t in tensors:
            weight_map[t.name] = name
        total += sum(t.nbytes for t in tensors)
        if progress is not None:
            progress(f"wrote {name} ({n}/{len(files)}): {sum(t.nbytes for t in tensors) / 2**30:.2f} GiB")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config: dict[str, Any] = cfg
    if layout == "published":
        text = {key: value for key, value in cfg.items() if key not in ("architectures", "torch_dtype")}
        text["sconv_kernel_size"] = text.pop("conv_kernel_size")
        config = {"model_type": "inkling_mm_model", "architectures": ["InklingForConditionalGeneration"]}
        config["text_config"] = text
        if "quantization_config" in text:
            config["quantization_config"] = text.pop("quantization_config")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(out_dir, cfg)
    return out_dir
