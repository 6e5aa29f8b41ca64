"""The `cascadia` command and its groups, the options several commands share, and the choice of CPU
kernels every command makes first."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cascadia.cli.common import fail

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Cascadia: MoE serving across a fleet.")


model_app = typer.Typer(no_args_is_help=True, help="Model files: synthetic checkpoints.")


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that write JSON and PNG.")


app.add_typer(model_app, name="model")


app.add_typer(bench_app, name="bench")


MODEL_HELP = "Checkpoint directory, .gguf file or packaged model (smollm2-135m)"


MtpDepthsOption = Annotated[
    int,
    typer.Option(min=0, help="Draft with this many depths of the model's own MTP head (0: none; needs one)."),
]


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
