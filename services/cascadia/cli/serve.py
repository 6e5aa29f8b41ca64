"""The roles as commands: `shard`, `router`, `draft`, `gateway`, `operator`, `probe`, and `up` (the whole
fleet on this machine)."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from cascadia import defaults
from cascadia.cli.app import (
    MODEL_HELP,
    ApiKeysFile,
    KvPrecisionOption,
    MaxConcurrentPerKey,
    MaxContext,
    MtpDepthsOption,
    PrecisionOption,
    app,
)
from cascadia.cli.common import (
    check_kv_precision,
    check_precision,
    err,
    fail,
    interrupt_on_signal,
    load_engine,
    parse_layers,
    progress_bar,
    proposer_for,
    resolve_model,
    run_until_signal,
)
from cascadia.gateway.response_store import DEFAULT_CAPACITY, DEFAULT_TTL_S
from cascadia.role_args import RouterArgs, ShardArgs


@app.command()
def shard(
    model: Annotated[str, typer.Option(help=MODEL_HELP)],
    layers: Annotated[str, typer.Option(help="Half-open layer range A:B.")],
    listen: Annotated[str, typer.Option(help="Address to serve on, e.g. 127.0.0.1:7001.")],
    next_addr: Annotated[str | None, typer.Option("--next", help="The next stage's address.")] = None,
    reply_to: Annotated[str | None, typer.Option(help="Where the last stage delivers tokens.")] = None,
    stage: Annotated[int, typer.Option(min=0, help="This stage's index (for error messages).")] = 0,
    precision: PrecisionOption = "f32",
    device: Annotated[str, typer.Option(help="OpenVINO device.")] = "CPU",
    context: Annotated[int | None, typer.Option(help="Global-layer positions per stream.")] = None,
    kv_precision: KvPrecisionOption = "f32",
    memory: Annotated[
        str | None,
        typer.Option(help="Memory this shard may use, e.g. 48Gi: reports (and checks) the context that fits."),
    ] = None,
    streams: Annotated[
        int, typer.Option(min=1, help="Streams the shard is sized for: its ring pools' slots, and the memory check.")
    ] = defaults.PLANNED_STREAMS,
    streams_per_step: Annotated[
        int | None,
        typer.Option(min=1, help="Streams stepped together, for the memory check (the router's rows per group)."),
    ] = None,
    mtp_depths: Annotated[
        int, typer.Option(min=0, help="Last stage: serve this many depths of the model's MTP head as a proposer.")
    ] = 0,
    mtp_vocab: Annotated[
        int, typer.Option(min=0, help="MTP draft logits over the first N token ids only (0: the whole vocabulary).")
    ] = 0,
    threads: Annotated[
        int, typer.Option(min=0, help="Inference threads (0: the plugin's default, every core it sees).")
    ] = 0,
) -> None:
    """Serve one contiguous layer range as a stage of the chain."""
    import logging

    from cascadia.engine.settings import preset

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    start, end = parse_layers(layers)
    try:
        ShardArgs(
            model, (start, end), listen, stage, precision, device, context, streams, next_addr, reply_to,
            kv_precision, mtp_depths or None, threads or None,
        )  # fmt: skip
    except ValueError as exc:
        raise fail(str(exc)) from None
    model_dir = resolve_model(model)
    from cascadia.model.checkpoint import CheckpointError
    from cascadia.model.config import ConfigError
    from cascadia.model.loader import load_shape

    try:
        shape = load_shape(model_dir)
        if (end == shape.num_layers) != (reply_to is not None):
            raise fail(f"--layers {layers}: only the stage ending at layer {shape.num_layers} takes --reply-to")
        overrides = {"kv_precision": kv_precision, "threads": threads, **({"context": context} if context else {})}
        settings = preset(precision, device=device, planned_streams=streams, **overrides)
        engine = load_engine(model_dir, settings, start, end, precision)
        drafter = _mtp_drafter(model_dir, settings, mtp_depths, mtp_vocab) if mtp_depths else None
    except (ConfigError, CheckpointError, ValueError) as exc:
        raise fail(str(exc)) from None
    if memory is not None:
        _check_context_fits(engine, memory, streams, streams_per_step)
    from cascadia.shard.capture import StageInfo
    from cascadia.shard.service import serve

    info = StageInfo(
        stage,
        start,
        end,
        str(model_dir),
        engine.shape.hidden_size,
        {"precision": precision, "device": device, "kv_precision": kv_precision},
    )
    vocabulary = _grammar_vocabulary(model_dir, engine.shape.unpadded_vocab_size) if reply_to else None
    run_until_signal(serve(engine, stage, listen, next_addr, reply_to, drafter, info, vocabulary))


def _grammar_vocabulary(model_dir: Path, sampled_vocab: int):
    """The last stage's tokens for grammars; a model whose tokenizer cannot be read is served without them."""
    from cascadia.grammar import GrammarVocabulary

    log = logging.getLogger("cascadia.shard")
    try:
        vocabulary = GrammarVocabulary.from_model(model_dir, sampled_vocab)
    except Exception as exc:  # the tokenizer is only needed for grammars: serve the model regardless
        log.warning("%s: requests with a grammar are refused (its tokenizer: %s)", model_dir, exc)
        return None
    if vocabulary is None:
        log.warning("%s has no tokenizer: requests with a grammar are refused", model_dir)
    return vocabulary


def _mtp_drafter(model_dir: Path, settings, depths: int, vocab: int):
    from cascadia.engine.mtp import MtpDrafter, MtpHead
    from cascadia.model.checkpoint import load_mtp

    with progress_bar() as bar:
        task = bar.add_task("reading the MTP head", total=None)
        weights = load_mtp(model_dir, depths)

        def tick(what: str, done: int, total: int) -> None:
            bar.update(task, description=f"compiling {what}", completed=done, total=total)

        return MtpDrafter(MtpHead(weights, settings, vocab or None, progress=tick))


@app.command()
def router(
    listen: Annotated[str, typer.Option(help="Address of the router's gRPC API.")],
    stages: Annotated[str, typer.Option(help="Comma-separated stage addresses, first stage first.")],
    collect: Annotated[str, typer.Option(help="Address the last stage delivers tokens to (--reply-to).")],
    rows_per_group: Annotated[int, typer.Option(min=1)] = defaults.ROWS_PER_GROUP,
    prefill_window: Annotated[int, typer.Option(min=1)] = defaults.PREFILL_WINDOW,
    max_streams: Annotated[int, typer.Option(min=1)] = defaults.MAX_STREAMS,
    max_queue: Annotated[int, typer.Option(min=0)] = defaults.MAX_QUEUE,
    frame_timeout: Annotated[float, typer.Option(min=0.1, help="Seconds before a frame counts as lost.")] = 30.0,
    max_draft: Annotated[
        int, typer.Option(min=0, max=31, help="Drafted tokens per speculative round (0: no speculation).")
    ] = 0,
    draft: Annotated[
        str, typer.Option(help="Where drafts come from: 'local' (in this process) or a draft service address.")
    ] = "local",
    mtp_draft: Annotated[
        int, typer.Option(min=0, help="Tokens the last stage's MTP head drafts per round (its --mtp-depths).")
    ] = 0,
    frames_in_flight: Annotated[
        int,
        typer.Option(min=0, help="Frames on the chain at once (0: one per stage; 1 when the stages share cores)."),
    ] = 0,
    draft_rows: Annotated[
        int, typer.Option(min=0, help="Rows of streams and drafts before speculation stops (0: --rows-per-group).")
    ] = 0,
    keep_finished: Annotated[
        int,
        typer.Option(
            min=0,
            help="Finished streams whose state the stages keep for a prompt that starts the same way, such as "
            "a conversation's next turn or another user's question after the same system prompt (0: none).",
        ),
    ] = 8,
    min_shared_prefix: Annotated[
        int,
        typer.Option(
            min=0,
            help="Tokens a prompt must share with a finished or recent one, and go on differently (one system "
            "prompt, other questions), to start as a copy of the finished stream, or to leave a kept copy of its "
            "own where they part for later prompts that start alike (0: neither).",
        ),
    ] = 32,
) -> None:
    """Admission, pipeline groups, sampling parameters and speculative rounds over a chain of shards."""
    import logging

    from cascadia.router.pipeline import PipelineDriver
    from cascadia.router.scheduler import SchedulerConfig
    from cascadia.router.service import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    addrs = [a for a in stages.split(",") if a]
    try:
        RouterArgs(listen, tuple(addrs), collect, rows_per_group, max_draft=max_draft, mtp_draft=mtp_draft)
    except ValueError as exc:
        raise fail(str(exc)) from None
    config = SchedulerConfig(
        len(addrs),
        rows_per_group,
        prefill_window,
        max_streams,
        max_queue,
        max_draft,
        mtp_draft,
        frames_in_flight,
        draft_rows,
        keep_finished,
        min_shared_prefix,
    )
    driver = PipelineDriver(addrs, collect, config, frame_timeout, proposer_for(draft) if max_draft else None)

    run_until_signal(serve(driver, listen))


@app.command("draft")
def draft_command(
    listen: Annotated[str, typer.Option(help="Address of the draft service, e.g. 127.0.0.1:7100.")],
    redis_url: Annotated[
        str | None, typer.Option("--redis", help="Redis URL of the shared-context index (none: local sources only).")
    ] = None,
    trust: Annotated[float, typer.Option(min=0.0, max=1.0, help="Agreement a shared context needs.")] = 0.9,
    warmup: Annotated[int, typer.Option(min=0, help="Proposals from a shared context before trust applies.")] = 16,
    ngram: Annotated[int, typer.Option(min=1, help="Suffix length matched in shared contexts.")] = 4,
    ttl: Annotated[int, typer.Option(min=1, help="Seconds a shared context is kept.")] = 3600,
    draft_model: Annotated[
        str | None, typer.Option("--model", help=f"A small draft model when nothing matches ({MODEL_HELP}).")
    ] = None,
    target: Annotated[
        str | None, typer.Option(help="The served model, whose tokenizer the draft model's text is re-encoded with.")
    ] = None,
    device: Annotated[str, typer.Option(help="OpenVINO device of the draft model.")] = "CPU",
) -> None:
    """The draft service: request-local suffix matches, shared contexts in Redis, a small draft model."""
    import logging

    from cascadia.draft.proposer import HybridProposer
    from cascadia.draft.service import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    shared = None
    if redis_url:
        from cascadia.draft.shared import RedisContexts

        shared = RedisContexts(redis_url, ngram=ngram, ttl_s=ttl, trust=trust, warmup=warmup)
        if not shared.available:
            err.print(f"Redis at {redis_url} is not answering: local proposals until it does")
    else:
        err.print("no --redis: proposing from each request's own tokens only")
    drafter = None
    if draft_model is not None:
        if target is None:
            raise fail("--model needs --target: the draft model's text is re-encoded with the target's tokenizer")
        from cascadia.draft.model import EngineDrafter
        from cascadia.gateway.text import TextCodec

        with err.status(f"loading the draft model {draft_model}"):
            drafter_path = resolve_model(draft_model)
            target_codec = TextCodec.from_model(resolve_model(target))
            drafter = EngineDrafter(drafter_path, target_codec, TextCodec.from_model(drafter_path), device)
    run_until_signal(serve(HybridProposer(shared=shared, model=drafter, shared_ngram=ngram), listen))


@app.command()
def gateway(
    router: Annotated[str, typer.Option(help="Address of the router's gRPC API.")],
    model: Annotated[str, typer.Option(help=f"{MODEL_HELP} (tokenizer, chat template, limits).")],
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients ask for (default: the directory name).")
    ] = None,
    api_keys_file: ApiKeysFile = None,
    max_context: MaxContext = 1024,
    max_prompt_tokens: Annotated[
        int, typer.Option(min=0, help="Longest prompt accepted (0: the context less one).")
    ] = 0,
    max_concurrent_per_key: MaxConcurrentPerKey = 64,
    max_body_bytes: Annotated[int, typer.Option(min=1024, help="Largest request body accepted.")] = 8 << 20,
    redis_url: Annotated[
        str | None,
        typer.Option("--redis", help="Keep /v1/responses in this Redis, shared by every gateway (none: in memory)."),
    ] = None,
    response_ttl: Annotated[
        int, typer.Option(min=1, help="Seconds a response stays in Redis after it was last read.")
    ] = DEFAULT_TTL_S,
    stored_responses: Annotated[
        int, typer.Option(min=1, help="Responses kept in memory without --redis, the least recently used given up.")
    ] = DEFAULT_CAPACITY,
) -> None:
    """The OpenAI-compatible REST API in front of a router."""
    import logging

    from cascadia.gateway.server import build_app, response_store, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model_dir = resolve_model(model)
    from cascadia.model.loader import served_name

    name = served_model_name or served_name(model_dir)
    try:
        store = response_store(redis_url, response_ttl, stored_responses)
    except ValueError as exc:
        raise fail(f"--redis {redis_url}: {exc}") from None
    try:
        app_ = build_app(
            router,
            model_dir,
            name,
            api_keys_file,
            max_context,
            max_prompt_tokens,
            max_concurrent_per_key,
            max_body_bytes,
            store,
        )
    except FileNotFoundError as exc:
        raise fail(f"--model {model}: {exc}") from None
    serve(app_, host, port)


@app.command("operator")
def operator_command(
    namespace: Annotated[list[str] | None, typer.Option(help="Watch only these namespaces (default: all).")] = None,
    liveness_port: Annotated[int, typer.Option(min=0, max=65535, help="Port of /healthz (0: none).")] = 8080,
    print_crd: Annotated[bool, typer.Option(help="Print the InklingFleet CRD as YAML and exit.")] = False,
    verbose: Annotated[bool, typer.Option(help="Log every event and API call.")] = False,
) -> None:
    """The kopf operator: reconciles InklingFleet resources into shards, router, gateway and Redis."""
    if print_crd:
        import yaml

        from cascadia.operator.crd import crd

        sys.stdout.write(yaml.safe_dump(crd(), sort_keys=False, width=120))
        return
    import kopf

    import cascadia.operator.handlers  # noqa: F401 (registers the handlers)

    kopf.configure(verbose=verbose)
    liveness = f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None
    kopf.run(standalone=True, clusterwide=not namespace, namespaces=namespace or [], liveness_endpoint=liveness)


@app.command()
def probe(
    address: Annotated[str, typer.Option(help="gRPC address whose standard health service is asked.")],
    timeout: Annotated[float, typer.Option(min=0.1)] = 3.0,
) -> None:
    """Exit 0 when the gRPC health service at ADDRESS reports SERVING (a readiness probe)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from cascadia.wire import tls

    with tls.blocking_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            err.print(f"{address}: {exc.code().name}")
            raise typer.Exit(1) from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        err.print(f"{address}: {status}")
        raise typer.Exit(1)
    err.print(f"{address}: {status}")


@app.command()
def up(
    model: Annotated[str, typer.Option(help=MODEL_HELP)] = "smollm2-135m",
    shards: Annotated[int, typer.Option(min=1)] = 3,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port of the OpenAI API.")] = 8000,
    precision: PrecisionOption = "f32",
    router_port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port of the router's gRPC API (0: any free).")
    ] = 0,
    api_keys_file: ApiKeysFile = None,
    max_context: MaxContext = 1024,
    max_concurrent_per_key: MaxConcurrentPerKey = 64,
    log_dir: Annotated[Path | None, typer.Option(help="Write each process's log here.")] = None,
    speculation: Annotated[
        str, typer.Option(help="on: the draft service (and Redis, when installed) and speculative rounds; off.")
    ] = "on",
    draft_model: Annotated[
        str | None, typer.Option(help="A small draft model for the draft service (pays when far smaller).")
    ] = None,
    tls_dir: Annotated[
        Path | None,
        typer.Option(help="Mutual TLS between every role: a directory with ca.pem, cert.pem, key.pem."),
    ] = None,
    kv_precision: KvPrecisionOption = "f32",
    mtp_depths: MtpDepthsOption = 0,
) -> None:
    """The whole fleet on this machine: shard processes, router, draft service, Redis and gateway, until Ctrl-C."""
    import signal
    import subprocess

    from cascadia.parent import child_env
    from cascadia.role_args import GatewayArgs
    from cascadia.router.local import LocalFleet, free_port, local_ranges, reserve_port

    model_dir = resolve_model(model)
    for chosen in (port, router_port):
        reserve_port(chosen)
    check_precision(precision)
    if speculation not in ("on", "off"):
        raise fail(f"--speculation '{speculation}' is not one of on, off")
    check_kv_precision(kv_precision)
    if tls_dir is not None:
        import os

        from cascadia.wire.tls import ENV, Tls, TlsError

        try:
            Tls.from_dir(tls_dir)
        except TlsError as exc:
            raise fail(str(exc)) from None
        os.environ[ENV] = str(tls_dir.resolve())  # every child reads it
    try:
        local_ranges(model_dir, shards)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM (a service manager, a test) stops the fleet like Ctrl-C: children must not outlive us
    signal.signal(signal.SIGTERM, interrupt_on_signal)
    # the shards hold what the gateway admits: prompt plus generated tokens per stream
    if mtp_depths and speculation == "off":
        raise fail("--mtp-depths drafts for speculative rounds: it needs --speculation on")
    fleet = LocalFleet(
        model_dir, shards, precision, context=max_context, kv_precision=kv_precision, mtp_depths=mtp_depths
    )
    gateway_proc: subprocess.Popen | None = None
    reported: list[subprocess.Popen] = []
    code = 0
    try:
        fleet.start(log_dir)
        router_port = router_port or free_port()
        drafting: dict[str, object] = {}
        if speculation == "on":
            address = fleet.start_draft(log_dir, str(resolve_model(draft_model)) if draft_model else None)
            drafting = {"max_draft": fleet.scheduler_config().longest_draft, "draft": address}
            drafting |= {"mtp_draft": mtp_depths} if mtp_depths else {}
        router_proc = fleet.start_router(router_port, log_dir / "router.log" if log_dir else None, **drafting)
        gateway_args = GatewayArgs(
            f"127.0.0.1:{router_port}",
            str(model_dir),
            port=port,
            max_context=max_context,
            max_concurrent_per_key=max_concurrent_per_key,
            api_keys_file=str(api_keys_file) if api_keys_file is not None else None,
        )
        cmd = [sys.executable, "-m", "cascadia.cli", *gateway_args.to_argv()]
        gateway_log = open(log_dir / "gateway.log", "w") if log_dir else None  # noqa: SIM115
        gateway_proc = subprocess.Popen(
            cmd, stdout=gateway_log, stderr=subprocess.STDOUT if gateway_log else None, env=child_env()
        )
        err.print(
            f"{shards} shards on {', '.join(fleet.stage_addrs)}; router on 127.0.0.1:{router_port}; "
            f"OpenAI API on http://127.0.0.1:{port}/v1 (Ctrl-C stops)"
        )
        while True:
            dead = fleet.dead()
            for helper in fleet.helpers:  # drafts are an optimisation: serving goes on without them
                if helper.poll() is not None and helper not in reported:
                    err.print(f"[yellow]{helper.args[0]} exited ({helper.returncode}); decoding without it[/yellow]")
                    reported.append(helper)
            if dead or router_proc.poll() is not None or gateway_proc.poll() is not None:
                err.print(
                    f"[red]a fleet process exited:[/red] shards {dead}, router {router_proc.poll()}, "
                    f"gateway {gateway_proc.poll()}"
                )
                code = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        err.print("stopping")
    finally:
        if gateway_proc is not None and gateway_proc.poll() is None:
            gateway_proc.terminate()
            try:
                gateway_proc.wait(10)
            except subprocess.TimeoutExpired:
                gateway_proc.kill()
        fleet.stop()
    raise typer.Exit(code)


def _check_context_fits(engine, memory: str, streams: int, streams_per_step: int | None) -> None:
    """The start-up probe: the context per stream whose state the memory left after loading holds.

    The state is counted as the planner counts it (ring pools by their slots, global caches in whole
    blocks, far stacks of the streams stepped together), so that a shard refuses what a plan would."""
    import logging

    from cascadia.engine.memory import resident_in_use
    from cascadia.engine.settings import MAX_CONTEXT
    from cascadia.planner import PlanError, PlanRequest, context_that_fits, parse_size, stage_state_bytes

    try:
        budget = parse_size(memory)
    except PlanError as exc:
        raise fail(f"--memory: {exc}") from None
    used = resident_in_use()
    request = PlanRequest.from_settings(
        ("shard",), budget, engine.settings, streams=streams, streams_per_step=streams_per_step
    )
    span = (engine.shape, engine.start_layer, engine.end_layer)
    needed = stage_state_bytes(*span, request)
    fit = context_that_fits(*span, request, budget - used, MAX_CONTEXT)
    logging.getLogger("cascadia.shard").info(
        "stream state: %.2f GiB for %d streams at %d positions (%s KV); %d positions per stream fit in %s "
        "beside the %.2f GiB in use",
        needed / 2**30, streams, engine.settings.context, engine.settings.kv_precision, fit, memory, used / 2**30,
    )  # fmt: skip
    if needed > budget - used:
        raise fail(
            f"--context {engine.settings.context} does not fit: {fit} positions per stream for {streams} streams "
            f"in --memory {memory} ({used / 2**30:.1f} GiB already used by the weights and runtime, "
            f"{needed / 2**30:.2f} GiB of stream state needed)"
        )
