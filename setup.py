"""Generate the gRPC modules from protos/ when a wheel is built (editable installs build them on first use)."""

import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProtos(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        package = Path(self.build_lib) / "cascadia"
        source = package / "proto_src"
        source.mkdir(parents=True, exist_ok=True)
        for proto in Path("protos").rglob("*.proto"):
            shutil.copy2(proto, source / proto.name)
        sys.path.insert(0, str(Path(self.build_lib)))
        from cascadia import protos  # the copy in build_lib, whose paths point inside it

        protos.build()


setup(cmdclass={"build_py": BuildWithProtos})
