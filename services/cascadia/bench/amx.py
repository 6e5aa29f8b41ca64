"""AMX on against AMX off: the engine bench's passes in alternating child processes, paired round by round.

oneDNN fixes its instruction-set cap once per process, so the two choices cannot share one. Each
round runs one process with AMX and one without, back to back, and each point's ratio is the median
of the rounds' own ratios, which keeps the machine's drift between rounds out of it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from cascadia.bench.report import pyplot, write_report
from cascadia.cpu_isa import AMX_VARIABLE, ONEDNN_ISA_VARIABLE

CHOICES = ("on", "off")


@dataclass(frozen=True)
class AmxBenchConfig:
    model: Path
    out: Path
    streams: tuple[int, ...]
    precisions: tuple[str, ...]
    rounds: int
    steps: int
    repeats: int


def engine_rates(summary: dict[str, Any]) -> dict[str, float]:
    """Tokens per second at each point of one engine bench ("bf16 1" streams, "bf16 prefill")."""
    rates = {}
    for label, entry in summary["engine"].items():
        for count, result in entry["decode"].items():
            rates[f"{label} {count}"] = result["tokens_per_s"]
        rates[f"{label} prefill"] = entry["prefill_tokens_per_s"]
    return rates


def paired_rates(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per point: each choice's median and range over the rounds, and the median of the rounds' off/on."""
    points: dict[str, dict[str, Any]] = {}
    for point in rounds[0]["on"]:
        on = [r["on"][point] for r in rounds]
        off = [r["off"][point] for r in rounds]
        points[point] = {
            "on": statistics.median(on),
            "off": statistics.median(off),
            "on_range": [min(on), max(on)],
            "off_range": [min(off), max(off)],
            "off_vs_on": statistics.median(b / a for a, b in zip(on, off, strict=True)),
        }
    return points


def child_command(config: AmxBenchConfig, choice: str, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "cascadia.cli", "--cpu-amx", choice, "bench", "engine",
        "--model", str(config.model), "--out", str(out), "--no-oracle",
        "--streams", ",".join(map(str, config.streams)), "--precisions", ",".join(config.precisions),
        "--steps", str(config.steps), "--repeats", str(config.repeats),
    ]  # fmt: skip


def run_amx_bench(config: AmxBenchConfig, console: Console) -> dict[str, Any]:
    # each child makes its own choice: nothing this process or its caller set may decide it for them
    env = {k: v for k, v in os.environ.items() if k not in (ONEDNN_ISA_VARIABLE, AMX_VARIABLE)}
    rounds: list[dict[str, dict[str, float]]] = []
    caps: dict[str, str | None] = {}
    machine: dict[str, Any] = {}
    for index in range(config.rounds):
        measured = {}
        for choice in CHOICES:
            out = config.out / "runs" / f"round-{index + 1}-amx-{choice}"
            console.print(f"round {index + 1}/{config.rounds}: AMX {choice}")
            done = subprocess.run(child_command(config, choice, out), env=env, stdout=subprocess.DEVNULL)
            if done.returncode != 0:
                raise RuntimeError(f"the engine bench with AMX {choice} exited {done.returncode}")
            summary = json.loads((out / "engine.json").read_text())
            measured[choice] = engine_rates(summary)
            caps[choice] = summary["machine"].get("onednn_max_cpu_isa")
            machine = summary["machine"]
        rounds.append(measured)
    points = paired_rates(rounds)
    for point, entry in points.items():
        console.print(
            f"{point:>16}: AMX on {entry['on']:7.1f} tok/s, off {entry['off']:7.1f} (off/on {entry['off_vs_on']:.2f})"
        )
    result = {
        "model": str(config.model),
        "machine": {k: v for k, v in machine.items() if k != "onednn_max_cpu_isa"},
        "onednn_max_cpu_isa": caps,
        "rounds": rounds,
        "points": points,
    }
    config.out.mkdir(parents=True, exist_ok=True)
    write_report(config.out, "amx", result, plot_amx)
    return result


def plot_amx(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    points = result["points"]
    names = list(points)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names)), 4.5))
    for offset, choice in ((-0.2, "on"), (0.2, "off")):
        ax.bar([i + offset for i in range(len(names))], [points[n][choice] for n in names], 0.4, label=f"AMX {choice}")
    for i, name in enumerate(names):
        top = max(points[name]["on"], points[name]["off"])
        ax.annotate(f"{points[name]['off_vs_on']:.2f}x", (i, top), ha="center", va="bottom")
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("tokens / s (decode; prefill where named)")
    ax.set_title(f"AMX off against on, medians of {len(result['rounds'])} paired rounds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
