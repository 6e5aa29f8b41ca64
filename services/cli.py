"""The `cascadia` command line."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cascadia import defaults
from cascadia.gateway.response_store import DEFAULT_CAPACITY, DEFAULT_TTL_S
from cascadia.progress import log_line
from cascadia.role_args import RouterArgs, ShardArgs

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Cascadia: MoE serving across a fleet.")
model_app = typer.Typer(no_args_is_help=True, help="Model files: synthetic checkpoints.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that write JSON and PNG.")
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")
err = Console(stderr=True, soft_wrap=True)
MODEL_HELP = "Checkpoint directory, .gguf file or packaged model (smollm2-135m)"
MtpDepthsOption = Annotated[
    int,
    typer.Option(min=0, help="Draft with this many depths of the model's own MTP head (0: none; needs one)."),
]


def fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}")
    return typer.Exit(2)


@app.callback()
def choose_cpu_kernels(
    cpu_amx: Annotated[
        str,
        typer.Option(
            envvar="CASCADIA_CPU_AMX",
            help="Whether the CPU plugin may run matmuls on AMX tiles: auto (not for decode-bound serving), on, off. "
            "Fixed per process and inherited by the processes it starts.",
        ),
    ] = "auto",
) -> None:
    from cascadia.cpu_isa import apply_amx_choice

    try:
        apply_amx_choice(cpu_amx)
    except (ValueError, RuntimeError) as exc:
        raise fail(f"--cpu-amx: {exc}") from None


def listed(value: str, option: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated list of names from `allowed`, or an error naming the option and the first other."""
    names = tuple(item for item in value.split(",") if item)
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise fail(f"{option}: '{unknown[0]}' is not one of {', '.join(allowed)}")
    return names


def positive_ints(value: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, or an error naming the option and the value."""
    try:
        parsed = tuple(int(item) for item in value.split(",") if item.strip())
    except ValueError:
        parsed = ()
    if not parsed or min(parsed) < 1:
        raise fail(f"{option} '{value}': expected positive integers separated by commas")
    return parsed


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


def log_progress(line: str) -> None:
    """A progress line that a pod log keeps: printed where stderr is not a terminal (there the bar shows it)."""
    if not err.is_terminal:
        log_line(line)


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


def check_precision(precision: str) -> None:
    from cascadia.engine.settings import PRECISION_PRESETS

    if precision not in PRECISION_PRESETS:
        raise fail(f"--precision '{precision}' is not one of {', '.join(PRECISION_PRESETS)}")


def check_kv_precision(kv_precision: str) -> None:
    from cascadia.engine.settings import KV_PRECISIONS

    if kv_precision not in KV_PRECISIONS:
        raise fail(f"--kv-precision '{kv_precision}' is not one of {', '.join(KV_PRECISIONS)}")


def parse_layers(layers: str) -> tuple[int, int]:
    try:
        start, end = (int(x) for x in layers.split(":"))
    except ValueError:
        raise fail(f"--layers '{layers}': expected A:B") from None
    return start, end


def resolve_model(model: str) -> Path:
    """The checkpoint directory or GGUF file behind --model (a packaged model's name resolves to its file)."""
    from cascadia.model.loader import ModelNotFound, resolve

    try:
        return resolve(model)
    except ModelNotFound as exc:
        raise fail(str(exc)) from None


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(tok) for tok in text.replace(",", " ").split()]
    except ValueError:
        raise fail(f"--prompt-ids '{text}': expected integers separated by spaces") from None
    if not ids:
        raise fail("--prompt-ids is empty")
    return ids


def load_engine(
    model_dir: Path, settings, start: int | None = None, end: int | None = None, precision: str | None = None
):
    """`cascadia.engine.loading.load_engine` with a progress bar (lines where stderr is a log) and its
    refusals as command-line errors."""
    from cascadia.engine.loading import StageLoadError
    from cascadia.engine.loading import load_engine as load

    with progress_bar() as bar:
        task = bar.add_task("reading weights", total=None)
        where = "stage" if start is None or end is None else f"stage {start}:{end}"

        def tick(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total)
            if done:
                log_progress(f"{where}: {what} ({done}/{total})")

        try:
            return load(model_dir, settings, start, end, precision, progress=tick, log=log_progress)
        except StageLoadError as exc:
            raise fail(str(exc)) from None


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
    codec = _text_codec(model_dir)
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
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, config, proposer=_proposer("local"))
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


def run_until_signal(server) -> None:
    """Run a server coroutine until SIGTERM or SIGINT, then let it stop gracefully."""
    import asyncio
    import signal

    async def main_task() -> None:
        task = asyncio.ensure_future(server)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main_task())


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
    driver = PipelineDriver(addrs, collect, config, frame_timeout, _proposer(draft) if max_draft else None)

    run_until_signal(serve(driver, listen))


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


def _proposer(draft: str):
    from cascadia.draft.client import DraftClient, LocalProposer

    return LocalProposer() if draft == "local" else DraftClient(draft)


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


# Options the gateway and `up` share, spelled once.
ApiKeysFile = Annotated[
    Path | None,
    typer.Option(exists=True, dir_okay=False, help="File of API keys, one per line (also $CASCADIA_API_KEYS)."),
]
MaxContext = Annotated[int, typer.Option(min=2, help="Positions per request: prompt plus generated tokens.")]
PrecisionOption = Annotated[str, typer.Option(help="f32, bf16, f16, int8, int4, w8a8 or w4a8")]
KvPrecisionOption = Annotated[
    str, typer.Option(help="Keys and values kept as f32, f16 (half the memory) or u8 (about a quarter).")
]
MaxConcurrentPerKey = Annotated[int, typer.Option(min=0, help="Requests in flight per API key (0: no limit).")]


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
    signal.signal(signal.SIGTERM, _interrupt)
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


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _text_codec(model: Path):
    """The model's tokenizer and template, or None for a checkpoint that ships no tokenizer."""
    from cascadia.gateway.text import TextCodec

    try:
        return TextCodec.from_model(model)
    except FileNotFoundError:
        return None


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


def main() -> None:
    from cascadia.parent import follow_parent

    follow_parent()
    app()


if __name__ == "__main__":
    main()
