"""The pure tier: no OpenVINO, no processes, no servers; `make test-fast` runs it alone, in seconds.

Run alone, the tier fails if anything it imported brought OpenVINO in, so a test that needs the engine
cannot settle here unnoticed (it belongs in tests/engine).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    items = getattr(session, "items", [])
    alone = items and all(Path(str(item.path)).resolve().is_relative_to(UNIT) for item in items)
    if alone and "openvino" in sys.modules:
        sys.stderr.write("\ntests/unit loaded OpenVINO: a test that needs the engine belongs in tests/engine\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
