"""Generate the gRPC modules from protos/ into cascadia.wire.generated whenever the package is built or
installed (a wheel, or `pip install -e .`): nothing is generated when the package is imported."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithProtos(build_py):
    def run(self) -> None:
        spec = importlib.util.spec_from_file_location("cascadia_protoc", ROOT / "services/wire/protoc.py")
        protoc = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(protoc)
        protoc.generate(ROOT / "protos", ROOT / "services/wire/generated")
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
