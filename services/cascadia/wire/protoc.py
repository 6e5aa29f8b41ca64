"""The gRPC modules of `protos/`, generated into `cascadia.wire.generated` when the package is built or
installed (`setup.py`), never when it is imported.

This file imports nothing from the package, so the build can load it before anything is installed.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from pathlib import Path

GENERATED_PACKAGE = "generated"


def proto_files(proto_root: Path) -> list[Path]:
    files = sorted(proto_root.rglob("*.proto"))
    if not files:
        raise RuntimeError(f"no .proto files under {proto_root}")
    return files


def proto_digest(files: list[Path]) -> str:
    """What the generated modules were built from: a stale build shows as another digest."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def generate(proto_root: Path, out: Path) -> None:
    """Compile every .proto under `proto_root` into the package folder `out` (replaced whole)."""
    import grpc_tools
    from grpc_tools import protoc

    files = proto_files(proto_root)
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        # compiled from their own folder, the modules are `fleet_pb2`, not `cascadia.v1.fleet_pb2`
        # (which would collide with this package's import name)
        args = ["protoc", f"-I{files[0].parent}", f"-I{include}", f"--python_out={tmp}", f"--grpc_python_out={tmp}"]
        if protoc.main([*args, *(f.name for f in files)]) != 0:
            raise RuntimeError("protoc failed on " + ", ".join(map(str, files)))
        for stub in Path(tmp).glob("*_pb2_grpc.py"):
            # protoc writes `import fleet_pb2`, found only with its folder on sys.path: made relative
            text = re.sub(r"^import (\w+_pb2) as ", r"from . import \1 as ", stub.read_text(), flags=re.M)
            stub.write_text(text)
        (Path(tmp) / "__init__.py").write_text(
            '"""Generated from protos/ at build time by cascadia.wire.protoc: not edited, not committed."""\n\n'
            f'PROTO_DIGEST = "{proto_digest(files)}"\n'
        )
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(tmp, out)
