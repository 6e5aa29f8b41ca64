"""Generate the gRPC modules from protos/ into cascadia.wire.generated whenever the package is built or
installed (a wheel, or `pip install -e .`): nothing is generated when the package is imported."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _generate(out: Path) -> None:
    spec = importlib.util.spec_from_file_location("cascadia_protoc", ROOT / "services/cascadia/wire/protoc.py")
    protoc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(protoc)
    protoc.generate(ROOT / "protos", out)


class BuildWithProtos(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            # an editable install imports the package from the source tree (the folder is ignored by git)
            _generate(ROOT / "services/cascadia/wire/generated")
        else:
            _generate(Path(self.build_lib) / "cascadia/wire/generated")


setup(cmdclass={"build_py": BuildWithProtos})
