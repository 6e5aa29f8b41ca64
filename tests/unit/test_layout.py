"""The map does not lie: below its source root (services/ or operator/), every module's file path is its
import path, as the installed package resolves it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = (ROOT / "services", ROOT / "operator")


def _modules() -> list[tuple[str, Path]]:
    found = []
    for root in SOURCE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "generated" in parts or parts[-1] == "__main__":
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.append((name, path))
    return found


def test_every_source_root_holds_only_the_cascadia_package():
    for root in SOURCE_ROOTS:
        # (an editable install keeps its metadata beside the package)
        names = [p.name for p in root.iterdir() if p.name != "__pycache__" and not p.name.endswith(".egg-info")]
        assert names == ["cascadia"], root


@pytest.mark.parametrize(("name", "path"), _modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_module_is_found_at_the_path_its_name_spells(name, path):
    spec = importlib.util.find_spec(name)
    assert spec is not None and Path(spec.origin).resolve() == path.resolve()
