"""Generated gRPC code for `protos/`, built by grpcio-tools on first use and cached beside the package.

The generated modules are never committed: they are rebuilt whenever the .proto files change.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import sys
from pathlib import Path
from types import ModuleType

# A built wheel carries the .proto files (and their generated modules) inside the package; a
# source checkout has them in the repository's protos/.
_PACKAGED = Path(__file__).resolve().parent / "proto_src"
PROTO_ROOT = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parent.parent / "protos"
OUT_DIR = Path(__file__).resolve().parent / "protos_gen"


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def build() -> Path:
    files = sorted(PROTO_ROOT.rglob("*.proto"))
    if not files:
        raise RuntimeError(f"no .proto files under {PROTO_ROOT}")
    stamp = OUT_DIR / ".digest"
    digest = _digest(files)
    if stamp.is_file() and stamp.read_text() == digest:
        return OUT_DIR
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    # several shard processes may start at once: one builds, the others wait for it
    with open(OUT_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == digest:
            return OUT_DIR
        _compile(files)
        stamp.write_text(digest)
    return OUT_DIR


def _compile(files: list[Path]) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    # files are compiled from their own folder so the modules are `fleet_pb2`, not `cascadia.v1.*`
    # (which would collide with this package's import name)
    args = ["protoc", f"-I{files[0].parent}", f"-I{include}", f"--python_out={OUT_DIR}", f"--grpc_python_out={OUT_DIR}"]
    if protoc.main([*args, *(f.name for f in files)]) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(map(str, files)))


def load() -> tuple[ModuleType, ModuleType]:
    """(messages, services) modules of cascadia/v1/fleet.proto."""
    out = str(build())
    if out not in sys.path:
        sys.path.insert(0, out)
    return importlib.import_module("fleet_pb2"), importlib.import_module("fleet_pb2_grpc")
