"""What every benchmark leaves behind: its summary as JSON and its figure as PNG, drawn without a display."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def pyplot():
    """matplotlib's pyplot on the file-only backend: benchmarks run where there is no display (pods, CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(out: Path, name: str, summary: Any, plot: Callable[[Any, Path], None]) -> None:
    """`out/name.json` and the figure `plot` draws of it, `out/name.png`."""
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, out / f"{name}.png")
