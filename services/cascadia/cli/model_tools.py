"""Model tools: `model tiny` (synthetic checkpoints), `generate`, `convert` (a stage's deployment form) and `plan`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cascadia import defaults
from cascadia.cli.app import MODEL_HELP, KvPrecisionOption, MtpDepthsOption, PrecisionOption, app, model_app
from cascadia.cli.common import (
    check_kv_precision,
    check_precision,
    err,
    fail,
    load_engine,
    parse_layers,
    parse_prompt_ids,
    proposer_for,
    resolve_model,
    text_codec_or_none,
)
from cascadia.progress import log_line


@model_app.command("tiny")
def model_tiny(
    out: Annotated[Path, typer.Argument(help="Directory to write the checkpoint to.")],
    preset: Annotated[str, typer.Option(help="tiny (a few MB, every branch) or mini (about 0.9B parameters)")] = "tiny",
    seed: Annotated[int, typer.Option(help="Random seed of the weights.")] = 0,
    layout: Annotated[str, typer.Option(help="inkling_text (transformers) or published (model.llm.*)")] = (
        "inkling_text"
    ),
    mtp_layers: Annotated[
        int, typer.Option(min=0, help="Depths of a multi-token-prediction head (implies --layout published).")
    ] = 0,
    layers: Annotated[int, typer.Option(min=1, help="inkling-975b: decoder layers (the first dense).")] = 2,
    experts: Annotated[int, typer.Option(min=1, help="inkling-975b: routed experts per sparse layer.")] = 8,
    vocab: Annotated[int, typer.Option(min=512, help="inkling-975b: vocabulary rows.")] = 4096,
    dtype: Annotated[str, typer.Option(help="inkling-975b: bf16, f16, f32 or fp8 (E4M3, 128x128 block scales).")] = (
        "bf16"
    ),
    shard_size: Annotated[str, typer.Option(help="inkling-975b: largest safetensors file, e.g. 2Gi.")] = "2Gi",
) -> None:
    """Write a synthetic Inkling checkpoint that InklingForCausalLM.from_pretrained loads.

    `--preset inkling-975b` writes layers at the 975B model's real width, tensor by tensor, sharded
    with an index: --layers, --experts and --vocab shrink it to fit a machine, --dtype picks how it is
    stored."""
    from cascadia.model.synthetic import PRESETS, SyntheticSpec, write_checkpoint
    from cascadia.model.synthetic_real import DTYPES, REAL_WIDTH_PRESET, write_real_width

    if layout not in ("inkling_text", "published"):
        raise fail(f"--layout '{layout}' is not one of inkling_text, published")
    if preset == REAL_WIDTH_PRESET:
        from cascadia.planner import PlanError, parse_size

        if dtype not in DTYPES:
            raise fail(f"--dtype '{dtype}' is not one of {', '.join(DTYPES)}")
        if mtp_layers:
            raise fail(f"--mtp-layers is not written for --preset {REAL_WIDTH_PRESET}")
        try:
            shard_bytes = parse_size(shard_size)
        except PlanError as exc:
            raise fail(f"--shard-size: {exc}") from None
        write_real_width(out, layers, experts, vocab, dtype, layout, seed, shard_bytes, progress=log_line)
        err.print(f"wrote {out}")
        return
    if preset not in PRESETS:
        raise fail(f"--preset '{preset}' is not one of {', '.join((*PRESETS, REAL_WIDTH_PRESET))}")
    if mtp_layers:
        layout = "published"
    spec = SyntheticSpec(preset=preset, seed=seed, layout=layout, mtp_layers=mtp_layers)  # type: ignore[arg-type]
    with err.status(f"writing {preset} checkpoint to {out}"):
        write_checkpoint(out, spec)
    err.print(f"wrote {out}")


@app.command()
def generate(
    model: Annotated[str, typer.Option(help=MODEL_HELP)],
    prompt: Annotated[str | None, typer.Option(help="Prompt text (tokenised, BOS prepended).")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help='Prompt token ids used as given, e.g. "1 2 3".')] = None,
    max_tokens: Annotated[int, typer.Option(min=1)] = 16,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.0,
    seed: Annotated[int | None, typer.Option()] = None,
    precision: PrecisionOption = "f32",
    device: Annotated[str, typer.Option(help="OpenVINO device: CPU here, GPU on the fleet.")] = "CPU",
    context: Annotated[int | None, typer.Option(help="Global-layer positions per stream.")] = None,
    kv_precision: KvPrecisionOption = "f32",
    shards: Annotated[int, typer.Option(min=1, help="Shard processes to run the model across.")] = 1,
    speculation: Annotated[str, typer.Option(help="on or off")] = "off",
    mtp_depths: MtpDepthsOption = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON line.")] = False,
) -> None:
    """Generate a continuation of a prompt (greedy unless a temperature is given)."""
    from cascadia.engine.generate import generate as run
    from cascadia.engine.settings import preset
    from cascadia.sampling_params import SamplingParams

    if (prompt is None) == (prompt_ids is None):
        raise fail("give exactly one of --prompt and --prompt-ids")
    check_precision(precision)
    if speculation not in ("on", "off"):
        raise fail(f"--speculation '{speculation}' is not one of on, off")
    model_dir = resolve_model(model)
    codec = text_codec_or_none(model_dir)
    from cascadia.model.loader import load_shape

    try:
        shape = load_shape(model_dir)
    except ValueError as exc:  # ConfigError, GgufError
        raise fail(str(exc)) from None
    if prompt_ids is not None:
        ids = parse_prompt_ids(prompt_ids)
    else:
        if codec is None:
            raise fail(f"--prompt needs {model_dir}/tokenizer.json; use --prompt-ids instead")
        # Inkling checkpoints always start from BOS; other models say whether their tokenizer adds it
        with_bos = (codec.add_bos or shape.family == "inkling") and shape.bos_token_id is not None
        ids = ([shape.bos_token_id] if with_bos else []) + codec.encode(prompt, add_bos=False)
    bad = [i for i in ids if not 0 <= i < shape.unpadded_vocab_size]
    if bad:
        raise fail(f"--prompt-ids: {bad[0]} is outside the vocabulary [0, {shape.unpadded_vocab_size})")
    try:
        overrides = {"kv_precision": kv_precision, **({"context": context} if context else {})}
        settings = preset(precision, device=device, **overrides)
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if len(ids) + max_tokens > settings.context and any(a.kind == "global" for a in shape.attention):
        raise fail(f"prompt of {len(ids)} tokens + {max_tokens} new tokens exceeds --context {settings.context}")
    if mtp_depths and speculation == "off":
        raise fail("--mtp-depths drafts for speculative rounds: add --speculation on")
    if mtp_depths > (shape.mtp_depths if shape.family == "inkling" else 0):
        raise fail(f"--mtp-depths {mtp_depths}: the model's MTP head has {shape.mtp_depths} depths")
    if shards == 1 and speculation == "off":
        result = run(load_engine(model_dir, settings, precision=precision), ids, params)
    else:
        from cascadia.router.local import local_ranges

        try:
            local_ranges(model_dir, shards)
        except ValueError as exc:
            raise fail(str(exc)) from None
        result = _generate_on_fleet(
            model_dir, shards, precision, ids, params, speculation == "on", settings, mtp_depths
        )
    text = codec.decode(result.token_ids) if codec is not None else ""
    if as_json:
        line = {
            "token_ids": result.token_ids,
            "text": text,
            "ttft_s": round(result.ttft_s, 6),
            "decode_tokens_per_s": round(result.decode_tokens_per_s, 3),
        }
        sys.stdout.write(json.dumps(line) + "\n")
    else:
        sys.stdout.write(text + "\n")
        err.print(
            f"{len(result.token_ids)} tokens, first after {result.ttft_s:.3f} s, "
            f"{result.decode_tokens_per_s:.1f} tok/s decode"
        )


def _generate_on_fleet(
    model_dir: Path,
    shards: int,
    precision: str,
    ids: list[int],
    params,
    speculate: bool,
    settings,
    mtp_depths: int = 0,
):
    import asyncio

    from cascadia.engine.generate import Generation
    from cascadia.router.local import LocalFleet
    from cascadia.router.pipeline import PipelineDriver, RequestFailed
    from cascadia.router.scheduler import Request

    fleet = LocalFleet(
        model_dir,
        shards,
        precision,
        context=settings.context,
        kv_precision=settings.kv_precision,
        mtp_depths=mtp_depths,
    )

    async def go() -> Generation:
        config = fleet.scheduler_config()
        if speculate:
            config = config.speculating(mtp_draft=mtp_depths)
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, config, proposer=proposer_for("local"))
        await driver.start()
        try:
            with err.status(f"starting {shards} shards"):
                ready = asyncio.ensure_future(driver.wait_ready(timeout=300))
                while not ready.done():
                    if fleet.dead():
                        ready.cancel()
                        raise RequestFailed(f"shard processes exited: {fleet.dead()}")
                    await asyncio.sleep(0.2)
                ready.result()
            started = time.perf_counter()
            pending = await driver.generate(Request("generate", tuple(ids), params))
            end = time.perf_counter()
            first = pending.first_token_at or end
            rate = (len(pending.tokens) - 1) / (end - first) if len(pending.tokens) > 1 and end > first else 0.0
            return Generation(pending.tokens, first - started, rate)
        finally:
            await driver.stop()

    fleet.start()
    try:
        return asyncio.run(go())
    except RequestFailed as exc:
        raise fail(str(exc)) from None
    finally:
        fleet.stop()


@app.command()
def convert(
    model: Annotated[str, typer.Option(help=MODEL_HELP)],
    out: Annotated[Path, typer.Option(help="Directory to write the converted stage to.")],
    precision: PrecisionOption = "int4",
    layers: Annotated[str | None, typer.Option(help="Layer range A:B to convert (default: the whole model).")] = None,
    device: Annotated[str, typer.Option(help="OpenVINO device the stage will run on: CPU, or GPU on the fleet.")] = (
        "CPU"
    ),
    kv_precision: KvPrecisionOption = "f32",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON line: bytes, seconds, peak memory.")] = False,
) -> None:
    """Write the deployment form of a stage (or the whole model) once: its graphs as OpenVINO IR with the
    weights already quantised. The output serves as --model for the layers it holds."""
    from dataclasses import asdict

    from cascadia.engine import converted
    from cascadia.engine.settings import preset
    from cascadia.model.checkpoint import CheckpointError
    from cascadia.model.config import ConfigError
    from cascadia.model.loader import is_gguf, load_shape

    check_precision(precision)
    check_kv_precision(kv_precision)
    model_dir = resolve_model(model)
    if converted.is_converted(model_dir):
        raise fail(f"--model {model}: already a converted stage; convert the checkpoint it came from")
    try:
        shape = load_shape(model_dir)
    except (ConfigError, CheckpointError) as exc:
        raise fail(str(exc)) from None
    if shape.family != "inkling" or is_gguf(model_dir):
        raise fail(f"--model {model}: convert writes Inkling checkpoints; Llama-family models load from their files")
    start, end = parse_layers(layers) if layers else (0, shape.num_layers)
    if not 0 <= start < end <= shape.num_layers:
        raise fail(f"--layers {start}:{end} is not inside the model's 0:{shape.num_layers}")
    try:
        settings = preset(precision, device=device, kv_precision=kv_precision)
        result = converted.convert(model_dir, out, settings, precision, start, end, progress=log_line)
    except (ValueError, OSError) as exc:
        raise fail(str(exc)) from None
    if as_json:
        sys.stdout.write(json.dumps(asdict(result)) + "\n")


@app.command()
def plan(
    nodes: Annotated[int, typer.Option(min=1, help="Number of nodes in the fleet.")],
    node_memory: Annotated[str, typer.Option(help="Usable memory per node, e.g. 61Gi.")],
    model: Annotated[Path | None, typer.Option(help="Checkpoint directory to plan for.")] = None,
    preset_name: Annotated[str | None, typer.Option("--preset", help="A model shape: inkling-975b.")] = None,
    layers_per_node: Annotated[int | None, typer.Option(min=1, help="Fixed layers per node.")] = None,
    expert_weights: Annotated[str, typer.Option(help="f32, f16, int8 or int4")] = "int4",
    attention_weights: Annotated[str, typer.Option(help="f32, f16, int8 or int4")] = "int8",
    head_weights: Annotated[str, typer.Option(help="f32, f16, int8 or int4")] = "int8",
    streams: Annotated[int, typer.Option(min=1, help="Streams the KV budget is sized for.")] = defaults.PLANNED_STREAMS,
    streams_per_step: Annotated[
        int | None,
        typer.Option(min=1, help="Streams a shard steps together (the router's rows per group); default all."),
    ] = None,
    context: Annotated[int, typer.Option(min=1, help="Global-layer positions per stream.")] = 1024,
    kv_precision: KvPrecisionOption = "f32",
    node_bandwidth: Annotated[float, typer.Option(help="Memory read bandwidth per node, GB/s.")] = 100.0,
    device: Annotated[
        str, typer.Option(help="Device the shards run on: GPU (the fleet's iGPU) or CPU (int4 scales kept in f32).")
    ] = "GPU",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Place layers on nodes; print memory per node and the bandwidth-floor throughput.

    For a converted stage (`cascadia convert`) the weight formats are those it was converted to."""
    from cascadia.engine.weights import WEIGHT_FORMATS
    from cascadia.model.config import ConfigError
    from cascadia.model.loader import load_shape
    from cascadia.planner import PlanError, PlanRequest, floor_throughput, parse_size, plan_fleet, preset_shape

    if (model is None) == (preset_name is None):
        raise fail("give exactly one of --model and --preset")
    check_kv_precision(kv_precision)
    for flag, value in (
        ("--expert-weights", expert_weights),
        ("--attention-weights", attention_weights),
        ("--head-weights", head_weights),
    ):
        if value not in WEIGHT_FORMATS:
            raise fail(f"{flag} '{value}' is not one of {', '.join(WEIGHT_FORMATS)}")
    if model is not None:
        from cascadia.engine import converted

        if converted.is_converted(model):
            held = converted.read_manifest(model)["settings"]
            expert_weights, attention_weights = held["expert_weights"], held["attention_weights"]
            head_weights, device = held["head_weights"], held["device"]
    try:
        shape = preset_shape(preset_name) if preset_name else load_shape(model)
        request = PlanRequest(
            nodes=tuple(f"node-{i}" for i in range(nodes)),
            node_memory=parse_size(node_memory),
            expert_weights=expert_weights,  # type: ignore[arg-type]
            attention_weights=attention_weights,  # type: ignore[arg-type]
            head_weights=head_weights,  # type: ignore[arg-type]
            layers_per_node=layers_per_node,
            streams=streams,
            streams_per_step=streams_per_step,
            context=context,
            kv_precision=kv_precision,
            device=device,
        )
        fleet = plan_fleet(shape, request)
    except (PlanError, ConfigError) as exc:
        raise fail(str(exc)) from None
    counts = [1, 2, 4, 8, 16, 32, 64, 88, 128, 176]
    floor = {c: floor_throughput(shape, fleet, request, c, node_bandwidth * 1e9) for c in counts}
    if as_json:
        out = {
            "mode": fleet.mode,
            "note": fleet.note,
            "plan": [
                {
                    "node": s.node,
                    "startLayer": s.start_layer,
                    "endLayer": s.end_layer,
                    "weightBytes": s.weight_bytes,
                    "kvBytes": s.kv_bytes,
                    "farStackBytes": s.far_stack_bytes,
                    "pluginCopyBytes": s.plugin_copy_bytes,
                    "overheadBytes": s.overhead_bytes,
                    "totalBytes": s.total_bytes,
                }
                for s in fleet.stages
            ],
            "floorTokensPerS": {str(c): round(v, 2) for c, v in floor.items()},
        }
        sys.stdout.write(json.dumps(out) + "\n")
        return
    from rich.table import Table

    table = Table(title=fleet.note)
    for col in ("node", "layers", "weights GiB", "plugin copies GiB", "KV GiB", "total GiB"):
        table.add_column(col)
    for s in fleet.stages:
        table.add_row(
            s.node,
            f"{s.start_layer}:{s.end_layer}",
            f"{s.weight_bytes / 2**30:.2f}",
            f"{s.plugin_copy_bytes / 2**30:.2f}",
            f"{s.state_bytes / 2**30:.2f}",
            f"{s.total_bytes / 2**30:.2f}",
        )
    Console().print(table)
    floor_table = Table(title=f"bandwidth-floor decode tok/s at {node_bandwidth:g} GB/s per node")
    floor_table.add_column("streams")
    floor_table.add_column("tok/s")
    for c, v in floor.items():
        floor_table.add_row(str(c), f"{v:.1f}")
    Console().print(floor_table)
