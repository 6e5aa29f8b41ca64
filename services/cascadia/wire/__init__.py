"""What crosses the wire between roles: the gRPC modules (`pb` messages, `rpc` stubs and servicers, generated
from protos/ when the package is installed, `cascadia.wire.protoc`), the channel options every role uses,
mutual TLS (`cascadia.wire.tls`), and the shared messages to and from their wire form, one place for both
ways: sampling parameters (`cascadia.v1.Sampling`) and residual rows (`cascadia.v1.Tensor`).

Roles import these from here, never from each other's services: the router and the gateway load no
engine (no OpenVINO) for them. This package imports no role.
"""

from __future__ import annotations

import numpy as np

from cascadia.sampling_params import SamplingParams

try:
    from cascadia.wire.generated import fleet_pb2 as pb
    from cascadia.wire.generated import fleet_pb2_grpc as rpc
except ImportError as exc:  # a source tree that was never installed
    raise ImportError(
        "cascadia's gRPC modules are generated from protos/ when the package is installed: "
        "run `pip install -e .` (or `make setup`)"
    ) from exc

__all__ = [
    "CHANNEL_OPTIONS",
    "MAX_MESSAGE",
    "pb",
    "rows_array",
    "rows_mismatch",
    "rows_tensor",
    "rpc",
    "sampling_message",
    "sampling_params",
]

MAX_MESSAGE = 256 * 2**20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


def sampling_message(params: SamplingParams):
    return pb.Sampling(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed or 0,
        has_seed=params.seed is not None,
        top_logprobs=params.top_logprobs,
        logprobs=params.logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
        grammar=params.grammar,
        stop_ids=sorted(params.stop_ids),
    )


def sampling_params(message, max_tokens: int = 16, stop_ids: frozenset[int] | None = None) -> SamplingParams:
    """Raises ValueError naming the parameter that is out of range. `stop_ids` default to the message's."""
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p or 1.0,
        seed=message.seed if message.has_seed else None,
        max_tokens=max_tokens,
        stop_ids=frozenset(message.stop_ids) if stop_ids is None else stop_ids,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        top_logprobs=message.top_logprobs,
        logprobs=message.logprobs,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        grammar=message.grammar,
    )


def rows_tensor(rows: np.ndarray, into=None):
    """Residual rows [T, H] in their wire form (`cascadia.v1.Tensor`: the shape, then little-endian f32),
    written into the message `into` when given."""
    data = np.ascontiguousarray(rows, dtype="<f4")
    tensor = into if into is not None else pb.Tensor()
    tensor.shape.extend(data.shape)
    tensor.data = data.tobytes()
    return tensor


def rows_mismatch(tensor, rows: int, width: int) -> str | None:
    """What is wrong with a wire tensor that should carry `rows` rows of `width` f32 values, or None."""
    shape = tuple(tensor.shape)
    if shape != (rows, width) or len(tensor.data) != rows * width * 4:
        return f"hidden rows of shape {shape} with {len(tensor.data)} bytes, expected ({rows}, {width}) FP32"
    return None


def rows_array(tensor, width: int) -> np.ndarray:
    """The rows a wire tensor carries, [T, width] f32, read in place (checked by `rows_mismatch`)."""
    return np.frombuffer(tensor.data, dtype="<f4").reshape(int(tensor.shape[0]), width)
