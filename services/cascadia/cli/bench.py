"""The benchmarks (`cascadia bench ...`): each parses its options and runs `cascadia.bench`, which writes
JSON and PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from cascadia.cli.app import MODEL_HELP, KvPrecisionOption, bench_app
from cascadia.cli.common import check_precision, err, fail, listed, parse_layers, positive_ints, resolve_model
from cascadia.progress import log_line


@bench_app.command("engine")
def bench_engine(
    model: Annotated[Path | None, typer.Option(help="Checkpoint directory (default: write the mini preset).")] = None,
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out"),
    streams: Annotated[str, typer.Option(help="Stream counts, comma separated.")] = "1,8,32",
    precisions: Annotated[str, typer.Option(help="Precision modes, comma separated.")] = "f32,bf16,int8,int4,w8a8",
    steps: Annotated[int, typer.Option(min=2, help="Decode steps per measurement.")] = 16,
    repeats: Annotated[int, typer.Option(min=1, help="Measurements per point (median reported).")] = 3,
    oracle: Annotated[bool, typer.Option(help="Also time transformers on the same checkpoint.")] = True,
    threads: Annotated[int, typer.Option(help="Threads for both engines (0: all cores).")] = 0,
    expert_kernels: Annotated[
        str,
        typer.Option(
            help="Expert kernels to run each precision with: auto (the device's pick), fused, grouped, "
            "vnni (the project's int8 CPU kernel)."
        ),
    ] = "auto",
    layer_calls: Annotated[
        str,
        typer.Option(
            help="How a stage calls its layers: joined (one model, one call per step), apart (one per layer), or both."
        ),
    ] = "joined",
    op_times: Annotated[
        bool,
        typer.Option(
            help="Also break a decode step down by op kind at each stream count (the plugin's op timing, "
            "which costs a little)."
        ),
    ] = False,
) -> None:
    """Decode and prefill throughput of the engine against transformers and the bandwidth floor."""
    from cascadia.bench.engine import EngineBenchConfig, run_engine_bench
    from cascadia.engine.settings import EXPERT_KERNELS, preset

    kernels = listed(expert_kernels, "--expert-kernels", EXPERT_KERNELS)
    calls = listed(layer_calls, "--layer-calls", ("joined", "apart"))
    modes = tuple(p for p in precisions.split(",") if p)
    for mode in modes:
        for kernel in kernels:
            try:
                preset(mode, expert_kernel=kernel)
            except ValueError as exc:
                raise fail(f"--precisions {mode} with --expert-kernels {kernel}: {exc}") from None

    config = EngineBenchConfig(
        model=model,
        out=out,
        streams=positive_ints(streams, "--streams"),
        precisions=modes,
        steps=steps,
        repeats=repeats,
        oracle=oracle,
        threads=threads,
        expert_kernels=kernels or ("auto",),
        layer_calls=calls or ("joined",),
        op_times=op_times,
    )
    summary = run_engine_bench(config, err)
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")


@bench_app.command("stage")
def bench_stage(
    out: Annotated[Path, typer.Option(help="Directory for stage.json, stage.png and the files it writes.")] = Path(
        "bench-out/stage"
    ),
    model: Annotated[Path | None, typer.Option(help="A real-width checkpoint (default: write one).")] = None,
    layers: Annotated[int, typer.Option(min=1, help="Layers of the checkpoint written when no --model.")] = 2,
    experts: Annotated[int, typer.Option(min=1, help="Routed experts of the checkpoint written.")] = 8,
    vocab: Annotated[int, typer.Option(min=512, help="Vocabulary rows of the checkpoint written.")] = 4096,
    stage_layers: Annotated[str | None, typer.Option("--stage", help="The stage's layers A:B (default: all).")] = None,
    precisions: Annotated[str, typer.Option(help="Comma-separated precisions.")] = "int4,int8",
    rows: Annotated[str, typer.Option(help="Comma-separated rows a decode step.")] = "1,8,32",
    steps: Annotated[int, typer.Option(min=4)] = 16,
) -> None:
    """A stage at the 975B model's real width: conversion, start-up, memory against the plan (in a memory
    cgroup where one can be made), and decode steps against the bandwidth floor (JSON + PNG)."""
    from cascadia.bench.stage import StageBenchConfig, run_stage_bench

    for precision in precisions.split(","):
        check_precision(precision)
    start, end = parse_layers(stage_layers) if stage_layers else (0, None)
    try:
        row_counts = tuple(int(r) for r in rows.split(","))
    except ValueError:
        raise fail(f"--rows '{rows}': expected integers separated by commas") from None
    config = StageBenchConfig(
        out, model, layers, experts, vocab, start, end, tuple(precisions.split(",")), row_counts, steps
    )
    summary = run_stage_bench(config, log_line)
    sys.stdout.write(json.dumps({p: r["within_bound"] for p, r in summary["precisions"].items()}) + "\n")


@bench_app.command("fleet")
def bench_fleet(
    model: Annotated[Path | None, typer.Option(help="Checkpoint directory (default: the mini preset).")] = None,
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out/fleet"),
    shards: Annotated[str, typer.Option(help="Fleet sizes, comma separated.")] = "1,4",
    streams: Annotated[str, typer.Option(help="Stream counts, comma separated.")] = "1,2,4,8,16,32,64,88",
    new_tokens: Annotated[int, typer.Option(min=2)] = 32,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Prompt length of every stream.")] = 16,
    rows_per_group: Annotated[int, typer.Option(min=1, help="Rows per frame (and per prefill window).")] = 8,
    precision: Annotated[str, typer.Option()] = "f32",
    link_rate: Annotated[str | None, typer.Option(help="Shape each shard's link: tc rate, e.g. 1gbit.")] = None,
    link_delay_ms: Annotated[float, typer.Option(min=0.0, help="Added latency per shaped link.")] = 0.0,
    link_loss: Annotated[float, typer.Option(min=0.0, max=99.0, help="Packet loss percent per shaped link.")] = 0.0,
    frames_in_flight: Annotated[
        int,
        typer.Option(
            min=0, help="Frames on each chain at once (1: one group, the pipeline's own cost; 0: one per stage)."
        ),
    ] = 1,
    repeats: Annotated[int, typer.Option(min=1, help="Runs of each stream count on each fleet, taken in turn.")] = 3,
) -> None:
    """Aggregate decode tok/s of local fleets against one process, and the per-hop cost on loopback.

    Without links, every fleet is up at once and each repeat runs them in turn; the efficiency is the
    median of each repeat's decode rate against the first fleet's in the same repeat.

    With --link-rate, every shard runs in its own network namespace behind a veth link shaped by
    tc (needs root), so each hop crosses a link like the fleet's. Latency and loss use netem, or on
    kernels without it iptables and a netfilter-queue delay line (the `netem` extra).
    """
    from cascadia.bench.engine import EngineBenchConfig, ensure_model
    from cascadia.bench.fleet import FleetBenchConfig, run_fleet_bench
    from cascadia.router.netem import LinkShape

    fleet_sizes, stream_counts = positive_ints(shards, "--shards"), positive_ints(streams, "--streams")
    model_dir = ensure_model(EngineBenchConfig(model=model, out=Path("bench-out/engine")), err)
    config = FleetBenchConfig(
        model=model_dir,
        out=out,
        shards=fleet_sizes,
        streams=stream_counts,
        new_tokens=new_tokens,
        prompt_tokens=prompt_tokens,
        rows_per_group=rows_per_group,
        precision=precision,
        link=LinkShape(link_rate, link_delay_ms, link_loss) if link_rate else None,
        frames_in_flight=frames_in_flight,
        repeats=repeats,
    )
    try:
        summary = run_fleet_bench(config, err)
    except RuntimeError as exc:
        raise fail(str(exc)) from None
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")


@bench_app.command("amx")
def bench_amx(
    model: Annotated[str, typer.Option(help=MODEL_HELP)],
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out/amx"),
    streams: Annotated[str, typer.Option(help="Stream counts, comma separated.")] = "1,8,32",
    precisions: Annotated[str, typer.Option(help="Precision modes, comma separated.")] = "bf16",
    rounds: Annotated[int, typer.Option(min=1, help="Pairs of processes, one with AMX and one without.")] = 3,
    steps: Annotated[int, typer.Option(min=2, help="Decode steps per measurement.")] = 16,
    repeats: Annotated[int, typer.Option(min=1, help="Measurements per point in each process.")] = 3,
) -> None:
    """The engine with AMX and without, in alternating processes (oneDNN fixes the choice per process)."""
    from cascadia.bench.amx import AmxBenchConfig, run_amx_bench
    from cascadia.engine.settings import PRECISION_PRESETS

    config = AmxBenchConfig(
        model=resolve_model(model),
        out=out,
        streams=positive_ints(streams, "--streams"),
        precisions=listed(precisions, "--precisions", PRECISION_PRESETS) or ("bf16",),
        rounds=rounds,
        steps=steps,
        repeats=repeats,
    )
    try:
        result = run_amx_bench(config, err)
    except RuntimeError as exc:
        raise fail(str(exc)) from None
    sys.stdout.write(json.dumps(result["points"], indent=2) + "\n")


@bench_app.command("peer")
def bench_peer(
    model: Annotated[str, typer.Option(help="A GGUF model both sides read.")] = "smollm2-135m",
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out/peer"),
    streams: Annotated[str, typer.Option(help="Concurrent streams, comma separated.")] = "1,8",
    new_tokens: Annotated[int, typer.Option(min=2)] = 64,
    repeats: Annotated[int, typer.Option(min=1, help="Measurements per point (median reported).")] = 3,
    shards: Annotated[int, typer.Option(min=0, help="Shard processes of the fleet measured too (0: none).")] = 3,
) -> None:
    """Decode tok/s and time to first token against OpenVINO GenAI on the same GGUF, in one run."""
    from cascadia.bench.peer import PeerBenchConfig, run_peer_bench
    from cascadia.model.loader import is_gguf

    path = resolve_model(model)
    if not is_gguf(path):
        raise fail(f"--model {model}: the peer benchmark needs a GGUF file, which GenAI reads too")
    counts = positive_ints(streams, "--streams")
    summary = run_peer_bench(PeerBenchConfig(path, out, counts, new_tokens, repeats, shards), err)
    sys.stdout.write(json.dumps({"results": summary["results"], "ratios": summary["ratios"]}) + "\n")


@bench_app.command("spec")
def bench_spec(
    model: Annotated[str, typer.Option(help=MODEL_HELP)] = "smollm2-135m",
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out/spec"),
    shards: Annotated[int, typer.Option(min=1)] = 3,
    new_tokens: Annotated[int, typer.Option(min=2)] = 64,
    repeats: Annotated[int, typer.Option(min=1, help="Requests per family and mode (median reported).")] = 3,
    streams: Annotated[int, typer.Option(min=1, help="Concurrent streams for the aggregate rate.")] = 32,
    max_draft: Annotated[
        int | None,
        typer.Option(min=1, max=31, help="Drafted tokens per round (default: as many as --draft-rows allow)."),
    ] = None,
    draft_rows: Annotated[
        int | None,
        typer.Option(min=2, help="Rows of streams and drafts before speculation stops (default: the local fleet's)."),
    ] = None,
    form: Annotated[
        str,
        typer.Option(
            help="chat: each family as a chat message through the model's template, ending with its turn; "
            "completion: raw prompts, --new-tokens each."
        ),
    ] = "chat",
    families: Annotated[
        str, typer.Option(help="Comma-separated families: copy, edit, rewrite, pattern, free, json (default: all).")
    ] = "",
    draft_model: Annotated[
        str | None,
        typer.Option(help=f"A small model drafting where nothing matches (the draft service's --model; {MODEL_HELP})."),
    ] = None,
) -> None:
    """Per-request speedup and acceptance of speculative decoding by prompt family, and the aggregate rate."""
    from cascadia.bench.spec import FAMILIES, FORMS, SpecBenchConfig, run_spec_bench
    from cascadia.router.local import LocalFleet

    if form not in FORMS:
        raise fail(f"--form '{form}' is not one of {', '.join(FORMS)}")
    chosen = listed(families, "--families", FAMILIES) or FAMILIES

    rows = draft_rows or LocalFleet(Path(model), shards).scheduler_config().draft_room
    if max_draft is not None and max_draft >= rows:
        given = "" if draft_rows else " (the local fleet's)"
        raise fail(f"--max-draft {max_draft} must be below --draft-rows {rows}{given}")
    path = resolve_model(model)
    drafter = None if draft_model is None else resolve_model(draft_model)
    config = SpecBenchConfig(
        path, out, shards, new_tokens, repeats, streams, max_draft, draft_rows, form, chosen, drafter
    )
    summary = run_spec_bench(config, err)
    speedups = {f: round(r["speedup"], 3) for f, r in summary["families"].items()}
    sys.stdout.write(json.dumps({"speedup": speedups, "aggregate": summary["aggregate"]}) + "\n")


@bench_app.command("turns")
def bench_turns(
    model: Annotated[str, typer.Option(help=MODEL_HELP)] = "smollm2-135m",
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out/turns"),
    shards: Annotated[int, typer.Option(min=1)] = 2,
    turns: Annotated[int, typer.Option(min=2, help="Turns of the conversation.")] = 4,
    repeats: Annotated[int, typer.Option(min=1, help="Conversations per mode (median reported).")] = 3,
    answer_tokens: Annotated[int, typer.Option(min=1, help="Most tokens of each answer.")] = 32,
    history: Annotated[int, typer.Option(min=1, help="Times the first message says its passage.")] = 4,
) -> None:
    """A conversation's time to first token by turn, with the last turn's state taken over and without."""
    from cascadia.bench.turns import TurnsBenchConfig, run_turns_bench

    config = TurnsBenchConfig(resolve_model(model), out, shards, turns, repeats, answer_tokens, history)
    summary = run_turns_bench(config, err)
    speedups = {t["turn"]: round(t["paired_speedup"], 2) for t in summary["turns"]}
    sys.stdout.write(json.dumps({"ttft_speedup_by_turn": speedups}) + "\n")


@bench_app.command("prefix")
def bench_prefix(
    model: Annotated[str, typer.Option(help=MODEL_HELP)] = "smollm2-135m",
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out/prefix"),
    shards: Annotated[int, typer.Option(min=1)] = 2,
    users: Annotated[int, typer.Option(min=3, help="Users asking after one system prompt, one after another.")] = 6,
    choices: Annotated[int, typer.Option(min=2, help="Sampled choices of one question, asked at once.")] = 4,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds of users per mode (median reported).")] = 3,
    answer_tokens: Annotated[int, typer.Option(min=1, help="Most tokens of each answer.")] = 48,
    system: Annotated[int, typer.Option(min=1, help="Times the system prompt says its passage.")] = 4,
) -> None:
    """Prompts that start alike (users after one system prompt, a question's `n` choices), computed once and
    every time: time to first token, paired within each round."""
    from cascadia.bench.prefix import PrefixBenchConfig, run_prefix_bench

    config = PrefixBenchConfig(resolve_model(model), out, shards, users, choices, repeats, answer_tokens, system)
    summary = run_prefix_bench(config, err)
    speedups = {u["user"]: round(u["paired_speedup"], 2) for u in summary["users"]}
    n = summary["n_choices"]
    both = {"first_token": round(n["paired_first_token_speedup"], 2), "done": round(n["paired_done_speedup"], 2)}
    sys.stdout.write(json.dumps({"ttft_speedup_by_user": speedups, "choices_speedup": both}) + "\n")


@bench_app.command("mtp")
def bench_mtp(
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint with an MTP head (default: write mini, 3 depths).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out/mtp"),
    streams: Annotated[str, typer.Option(help="Stream counts, comma separated.")] = "1,8",
    stage_layers: Annotated[int, typer.Option(min=1, help="Layers of the last stage.")] = 6,
    rounds: Annotated[int, typer.Option(min=1)] = 20,
    sequences: Annotated[int, typer.Option(min=1, help="Greedy sequences scored for agreement.")] = 4,
    new_tokens: Annotated[int, typer.Option(min=2)] = 48,
    vocab_prefix: Annotated[int, typer.Option(min=0, help="Also time draft logits over the first N ids.")] = 0,
) -> None:
    """One MTP chain round against one last-stage decode step; agreement per depth, teacher- vs self-fed."""
    from cascadia.bench.mtp import MtpBenchConfig, run_mtp_bench

    counts = positive_ints(streams, "--streams")
    if model is None:
        from cascadia.model.synthetic import SyntheticSpec, write_checkpoint

        model = out / "mini-mtp-checkpoint"
        if not (model / "config.json").is_file():
            with err.status(f"writing the mini preset with 3 MTP depths to {model}"):
                write_checkpoint(model, SyntheticSpec(preset="mini", seed=0, layout="published", mtp_layers=3))
    config = MtpBenchConfig(
        resolve_model(str(model)), out, counts, stage_layers, rounds, sequences, new_tokens, vocab_prefix=vocab_prefix
    )
    try:
        summary = run_mtp_bench(config, err)
    except ValueError as exc:
        raise fail(str(exc)) from None
    sys.stdout.write(json.dumps({k: v for k, v in summary.items() if k != "agreement"}) + "\n")


@bench_app.command("context")
def bench_context(
    model: Annotated[Path | None, typer.Option(help="Checkpoint (default: write the tiny preset).")] = None,
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out/context"),
    lengths: Annotated[str, typer.Option(help="Prompt lengths, comma separated.")] = "1024,4096,16384",
    prefill_window: Annotated[int, typer.Option(min=1)] = 256,
    kv_precision: KvPrecisionOption = "f32",
    streams: Annotated[int, typer.Option(min=1, help="Streams per length, decoded together.")] = 1,
) -> None:
    """Time to first token and decode time against prompt length (fit aN + bN²), KV bytes per position."""
    from cascadia.bench.context import ContextBenchConfig, run_context_bench

    counts = positive_ints(lengths, "--lengths")
    if len(counts) < 2:
        raise fail("--lengths needs at least two lengths to fit aN + bN²")
    if model is None:
        from cascadia.model.synthetic import SyntheticSpec, write_checkpoint

        model = out / "tiny-checkpoint"
        write_checkpoint(model, SyntheticSpec(preset="tiny", seed=0))
    config = ContextBenchConfig(
        resolve_model(str(model)), out, counts, prefill_window, kv_precision=kv_precision, streams=streams
    )
    summary = run_context_bench(config, err)
    sys.stdout.write(json.dumps({k: v for k, v in summary.items() if k != "rows"}) + "\n")


@bench_app.command("load")
def bench_load(
    model: Annotated[str, typer.Option(help=MODEL_HELP)] = "models/tiny",
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out/load"),
    shards: Annotated[int, typer.Option(min=1)] = 3,
    clients: Annotated[str, typer.Option(help="Concurrent streaming clients per round, comma separated.")] = (
        "1,32,176"
    ),
    rounds: Annotated[int, typer.Option(min=1, help="Rounds per client count (memory growth shows across them).")] = 2,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    prompt_min: Annotated[int, typer.Option(min=1)] = 16,
    prompt_max: Annotated[int, typer.Option(min=1)] = 512,
    cancel_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of clients that hang up early.")] = 0.1,
) -> None:
    """Streaming clients through the gateway of a local fleet: outcomes, tok/s, latency, memory per process."""
    from cascadia.bench.load import LoadBenchConfig, run_load_bench

    counts = positive_ints(clients, "--clients")
    if prompt_max < prompt_min:
        raise fail(f"--prompt-max {prompt_max} is below --prompt-min {prompt_min}")
    model_dir = resolve_model(model)
    config = LoadBenchConfig(model_dir, out, shards, counts, rounds, max_tokens, prompt_min, prompt_max, cancel_share)
    results = run_load_bench(config, err)
    sys.stdout.write(
        json.dumps(
            [
                {k: r[k] for k in ("clients", "round", "completed", "failed", "cancelled", "tokens_per_s")}
                for r in results["rounds"]
            ]
        )
        + "\n"
    )


@bench_app.command("model")
def bench_model(
    engine_json: Annotated[Path, typer.Option(help="Output of cascadia bench engine.")] = Path(
        "docs/bench/engine.json"
    ),
    fleet_json: Annotated[Path, typer.Option(help="Output of cascadia bench fleet.")] = Path("docs/bench/fleet.json"),
    preset_name: Annotated[str, typer.Option("--preset", help="Model shape.")] = "inkling-975b",
    nodes: Annotated[int, typer.Option(min=1)] = 11,
    node_memory: Annotated[str, typer.Option(help="Usable memory per node.")] = "61Gi",
    layers_per_node: Annotated[int | None, typer.Option(min=1)] = 6,
    precision: Annotated[str, typer.Option(help="Engine mode whose measured efficiency applies.")] = "int4",
    node_bandwidth: Annotated[float, typer.Option(help="Memory read bandwidth per node, GB/s.")] = 100.0,
    streams: Annotated[str, typer.Option(help="Stream counts, comma separated.")] = "1,8,16,32,64,88,128,176",
    out: Annotated[Path, typer.Option(help="Directory for JSON and PNG results.")] = Path("bench-out/model"),
    frame_overhead_ms: Annotated[
        float | None, typer.Option(min=0.0, help="Use this per-frame cost instead of the fleet bench's.")
    ] = None,
) -> None:
    """Predict the fleet's decode tok/s from measured stage efficiency and per-frame cost."""
    from dataclasses import replace

    from cascadia.bench.model import measured_from, run_model
    from cascadia.planner import PlanError, PlanRequest, parse_size, plan_fleet, preset_shape

    for path in (engine_json, fleet_json):
        if not path.is_file():
            raise fail(f"{path}: no such file (run cascadia bench engine / fleet first)")
    try:
        shape = preset_shape(preset_name)
        request = PlanRequest(
            tuple(f"node-{i}" for i in range(nodes)),
            parse_size(node_memory),
            layers_per_node=layers_per_node,
            streams=176,
        )
        plan = plan_fleet(shape, request)
        measured = measured_from(engine_json, fleet_json, precision)
        if frame_overhead_ms is not None:
            given = measured.source + ", per-frame cost given"
            measured = replace(measured, frame_overhead_s=frame_overhead_ms / 1e3, source=given)
    except (PlanError, KeyError, ValueError) as exc:
        raise fail(str(exc)) from None
    counts = list(positive_ints(streams, "--streams"))
    result = run_model(shape, plan, request, measured, node_bandwidth * 1e9, counts, out)
    sys.stdout.write(json.dumps(result["rows"]) + "\n")
