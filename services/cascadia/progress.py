"""Progress as lines on stderr: what terminals and pod logs alike keep of a long operation."""

from __future__ import annotations

import sys
import time


def log_line(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)
