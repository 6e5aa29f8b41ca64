"""The wire's gRPC modules: generated from protos/ when the package is installed, never at import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from cascadia.wire import generated, pb, protoc

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_grpc_modules_are_generated_from_the_protos_as_they_are():
    """After a .proto changes, installing again (`make setup`) brings the modules up to date."""
    assert protoc.proto_digest(protoc.proto_files(ROOT / "protos")) == generated.PROTO_DIGEST
    assert pb.DESCRIPTOR.package == "cascadia.v1"


def test_importing_the_wire_compiles_nothing_and_leaves_the_import_path_alone():
    probe = (
        "import json, sys; before = list(sys.path); import cascadia.wire; "
        "print(json.dumps([sys.path == before, 'grpc_tools.protoc' in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == [True, False]


def test_generating_writes_a_package_whose_stubs_import_their_messages_relatively(tmp_path):
    out = tmp_path / "generated"
    protoc.generate(ROOT / "protos", out)
    stubs = (out / "fleet_pb2_grpc.py").read_text()
    assert "from . import fleet_pb2 as" in stubs and "\nimport fleet_pb2" not in stubs
    assert (out / "__init__.py").read_text().count(generated.PROTO_DIGEST) == 1


def test_residual_rows_cross_the_wire_bit_for_bit_and_a_wrong_shape_is_named():
    from cascadia.wire import rows_array, rows_mismatch, rows_tensor

    rows = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    message = pb.Frame()
    rows_tensor(rows, into=message.hidden)
    again = pb.Frame.FromString(message.SerializeToString())
    assert rows_mismatch(again.hidden, 3, 8) is None
    np.testing.assert_array_equal(rows_array(again.hidden, 8), rows)
    assert rows_mismatch(again.hidden, 4, 8) == "hidden rows of shape (3, 8) with 96 bytes, expected (4, 8) FP32"
    again.hidden.data = again.hidden.data[:-4]
    assert "with 92 bytes" in rows_mismatch(again.hidden, 3, 8)
