"""Fleet tools: `capture` (a running fleet's streams), `replay` and `eval-draft` (offline, on what was captured)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cascadia.cli.app import MODEL_HELP, KvPrecisionOption, PrecisionOption, app
from cascadia.cli.common import check_precision, err, fail, load_engine, parse_layers, progress_bar, resolve_model


@app.command()
def capture(
    directory: Annotated[
        Path | None, typer.Option("--dir", help="Where each shard writes its files (on its machine).")
    ] = None,
    router_addr: Annotated[str | None, typer.Option("--router", help="The router's gRPC address.")] = None,
    stages: Annotated[str | None, typer.Option(help="Or the stages' addresses, comma-separated.")] = None,
    budget: Annotated[str, typer.Option(help="Bytes the capture may hold per shard, e.g. 512Mi.")] = "256Mi",
    request: Annotated[
        list[str] | None, typer.Option("--request", help="Capture only this request id (repeatable).")
    ] = None,
    every_layer: Annotated[bool, typer.Option(help="Each layer's output rows, not only each stage's.")] = False,
    off: Annotated[bool, typer.Option("--off", help="Stop capturing and write what is held.")] = False,
    status: Annotated[bool, typer.Option("--status", help="Report only.")] = False,
) -> None:
    """Record what the fleet's stages compute (FP32 rows, final states, tokens) for replay and draft evaluation."""
    import asyncio

    import grpc

    from cascadia.planner import PlanError, parse_size
    from cascadia.wire import pb, rpc

    if (router_addr is None) == (stages is None):
        raise fail("give exactly one of --router and --stages")
    if not (off or status) and directory is None:
        raise fail("--dir is needed to start a capture")
    try:
        budget_bytes = parse_size(budget)
    except (PlanError, ValueError) as exc:
        raise fail(f"--budget '{budget}': {exc}") from None
    message = pb.CaptureRequest(
        enable=not off,
        directory=str(directory.resolve()) if directory else "",
        budget_bytes=budget_bytes,
        streams=request or [],
        every_layer=every_layer,
        status_only=status,
    )

    async def go() -> list:
        from cascadia.wire import tls

        if router_addr is not None:
            async with tls.channel(router_addr) as channel:
                return list((await rpc.RouterStub(channel).Capture(message, timeout=30)).stages)
        replies = []
        for address in [a for a in (stages or "").split(",") if a]:
            async with tls.channel(address) as channel:
                replies.append(await rpc.ShardStub(channel).Capture(message, timeout=30))
        return replies

    try:
        replies = asyncio.run(go())
    except grpc.RpcError as exc:
        raise fail(exc.details()) from None
    for r in replies:
        state = "full (stopped)" if r.full else ("on" if r.enabled else "off")
        err.print(
            f"stage {r.stage}: {state}, {r.used_bytes}/{r.budget_bytes} bytes, {r.streams} streams, "
            f"{len(r.files)} files"
        )


@app.command("replay")
def replay_command(
    capture_path: Annotated[Path, typer.Argument(help="A capture directory (or one capture file).")],
    layers: Annotated[str, typer.Option(help="Half-open layer range A:B to recompute.")],
    model: Annotated[str | None, typer.Option(help=f"{MODEL_HELP} (default: the one captured).")] = None,
    precision: PrecisionOption = "f32",
    device: Annotated[str, typer.Option(help="OpenVINO device.")] = "CPU",
    kv_precision: KvPrecisionOption = "f32",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON line.")] = False,
) -> None:
    """Recompute a layer range from captured inputs; per-layer deviation from what the fleet computed."""
    from rich.table import Table

    from cascadia.engine.settings import preset
    from cascadia.replay import replay
    from cascadia.shard.capture import CaptureError, read_capture

    check_precision(precision)
    start, end = parse_layers(layers)
    try:
        stages = read_capture(capture_path)
    except (CaptureError, OSError) as exc:
        raise fail(str(exc)) from None
    model_dir = resolve_model(model or next(iter(stages.values())).info.model)
    try:
        engine = load_engine(model_dir, preset(precision, device=device, kv_precision=kv_precision), start, end)
        with progress_bar() as bar:
            task = bar.add_task("replaying frames", total=None)
            report = replay(engine, stages, lambda done, total: bar.update(task, completed=done, total=total))
    except (CaptureError, ValueError) as exc:
        raise fail(str(exc)) from None
    if as_json:
        sys.stdout.write(json.dumps(report.as_dict()) + "\n")
        return
    table = Table(title=f"replay of layers {start}:{end} ({precision} on {device}), {report.frames} frames")
    for column in ("layer", "rows", "rms(diff)/rms", "max|diff|/max|row|"):
        table.add_column(column, justify="right")
    for layer, d in sorted(report.layers.items()):
        table.add_row(str(layer), str(d.rows), f"{d.relative_rms:.3e}", f"{d.relative_max:.3e}")
    Console().print(table)
    if report.argmax_agreement is not None:
        Console().print(f"argmax agreement at the head: {report.argmax_agreement:.4f} over {report.argmax_rows} rows")


@app.command("eval-draft")
def eval_draft(
    capture_path: Annotated[Path, typer.Argument(help="A capture directory holding the last stage's files.")],
    model: Annotated[str | None, typer.Option(help=f"{MODEL_HELP} (default: the one captured).")] = None,
    depths: Annotated[int, typer.Option(min=1, help="Tokens drafted after each emitted one.")] = 3,
    vocab_prefix: Annotated[
        int, typer.Option(min=0, help="Also score the MTP head with logits over the first N ids only.")
    ] = 0,
    redis_url: Annotated[
        str | None, typer.Option("--redis", help="Score shared contexts too, through this Redis.")
    ] = None,
    draft_model: Annotated[str | None, typer.Option(help="Score this small draft model too.")] = None,
    out: Annotated[Path, typer.Option(help="Directory for eval-draft.json and eval-draft.png.")] = Path(
        "bench-out/eval-draft"
    ),
) -> None:
    """Score draft sources on captured sequences: the MTP head (teacher- and self-fed), suffix, shared, model."""
    from rich.table import Table

    from cascadia.bench import draft_eval as evaluate
    from cascadia.engine.settings import EngineSettings
    from cascadia.shard.capture import CaptureError, confirmed_streams, read_capture

    try:
        stages = read_capture(capture_path)
    except (CaptureError, OSError) as exc:
        raise fail(str(exc)) from None
    last = max(stages.values(), key=lambda s: s.info.end_layer)
    model_dir = resolve_model(model or last.info.model)
    from cascadia.model.loader import load_shape

    shape = load_shape(model_dir)
    if last.info.end_layer != shape.num_layers:
        raise fail(f"{capture_path}: no capture of the last stage (layers ending at {shape.num_layers})")
    streams = confirmed_streams(last)
    if not streams:
        raise fail(f"{capture_path}: no captured stream was followed from its first row to a sampled token")
    sources: dict[str, evaluate.SourceScore] = {}
    with err.status("scoring request-local suffix matches"):
        sources["suffix"] = evaluate.score_proposer(streams, evaluate.suffix_proposer(), depths)
    if redis_url:
        with err.status("scoring shared contexts"):
            proposer = evaluate.shared_proposer(redis_url, streams)
            sources["shared"] = evaluate.score_proposer(streams, proposer, depths)
    if draft_model:
        from cascadia.draft.model import EngineDrafter
        from cascadia.gateway.text import TextCodec

        with err.status("scoring the draft model"):
            drafter_path = resolve_model(draft_model)
            drafter = EngineDrafter(drafter_path, TextCodec.from_model(model_dir), TextCodec.from_model(drafter_path))
            sources["model"] = evaluate.score_proposer(
                streams, lambda s, context, k: drafter.draft(context, k, s), depths
            )
    if shape.mtp_depths:
        from cascadia.engine.mtp import MtpHead
        from cascadia.model.checkpoint import load_mtp

        heads = {"": None, f" (first {vocab_prefix} ids)": vocab_prefix} if vocab_prefix else {"": None}
        weights = load_mtp(model_dir, min(depths, shape.mtp_depths))
        for label, vocab in heads.items():
            head = MtpHead(weights, EngineSettings(), vocab)
            with err.status(f"scoring the MTP head{label}"):
                sources[f"mtp teacher-fed{label}"] = evaluate.mtp_teacher_fed(head, streams)
                sources[f"mtp self-fed{label}"] = evaluate.mtp_self_fed(head, streams)
    else:
        err.print(f"{model_dir.name} has no MTP head: scoring the other sources")
    summary = {
        "capture": str(capture_path),
        "model": str(model_dir),
        "streams": len(streams),
        "generated_tokens": sum(len(s.tokens) - s.prompt_length for s in streams.values()),
        "depths": depths,
        "sources": {name: score.as_dict() for name, score in sources.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval-draft.json").write_text(json.dumps(summary, indent=2) + "\n")
    evaluate.plot(summary, out / "eval-draft.png")
    table = Table(title=f"draft agreement per depth, {len(streams)} captured streams")
    table.add_column("source")
    for d in range(depths):
        table.add_column(f"depth {d}", justify="right")
    table.add_column("accepted / draft", justify="right")
    for name, score in summary["sources"].items():
        cells = [f"{v:.3f}" if v is not None else "-" for v in score["agreement_per_depth"]]
        cells += ["-"] * (depths - len(cells))
        mean = score["mean_accepted"]
        table.add_row(name, *cells, f"{mean:.2f}" if mean is not None else "-")
    Console().print(table)
    err.print(f"wrote {out / 'eval-draft.json'} and {out / 'eval-draft.png'}")
