"""What the commands share: refusals as command-line errors, progress on stderr, checked arguments, a stage's engine."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cascadia.progress import log_line

err = Console(stderr=True, soft_wrap=True)


def fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}")
    return typer.Exit(2)


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


def proposer_for(draft: str):
    from cascadia.draft.client import DraftClient, LocalProposer

    return LocalProposer() if draft == "local" else DraftClient(draft)


def interrupt_on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def text_codec_or_none(model: Path):
    """The model's tokenizer and template, or None for a checkpoint that ships no tokenizer."""
    from cascadia.gateway.text import TextCodec

    try:
        return TextCodec.from_model(model)
    except FileNotFoundError:
        return None
