"""The protobuf ``forward_backward`` request ↔ plain arrays, and training results → protobuf output."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from shims.errors import UserError
from shims.tensors import batched_tensor, tensor_from_proto, tokens_from_chunks


@dataclass
class DatumArrays:
    """One training example: input tokens and its named loss inputs, one row per input position."""

    tokens: np.ndarray
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardBatch:
    """A decoded ``ForwardBackwardRequest``: everything the trainer needs, nothing tied to the wire."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[DatumArrays]


def decode_forward_backward(body: bytes) -> ForwardBackwardBatch:
    """Parse a serialized ``tinker_public.ForwardBackwardRequest``.

    ``loss_fn_config`` is read from the v2 map when it is present (it alone carries strings) and from the legacy
    float map otherwise, as the SDK's own comment asks servers to do.
    """
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise UserError(f"body is not a valid ForwardBackwardRequest protobuf: {exc}") from None
    if not msg.model_id:
        raise UserError("model_id is required")
    if not msg.data:
        raise UserError("forward_backward needs at least one datum")
    if msg.loss_fn_config_v2:
        config: dict[str, float | str] = {
            k: (v.text if v.WhichOneof("value") == "text" else v.number) for k, v in msg.loss_fn_config_v2.items()
        }
    else:
        config = dict(msg.loss_fn_config.items())
    data = []
    for i, datum in enumerate(msg.data):
        try:
            tokens = tokens_from_chunks(datum.model_input)
            inputs = {name: tensor_from_proto(t, name) for name, t in datum.loss_fn_inputs.items()}
        except UserError as exc:
            raise UserError(f"datum {i}: {exc}") from None
        data.append(DatumArrays(tokens=tokens, loss_fn_inputs=inputs))
    return ForwardBackwardBatch(
        model_id=msg.model_id, seq_id=msg.seq_id, loss_fn=msg.loss_fn or "cross_entropy", loss_fn_config=config,
        forward_only=msg.forward_only, data=data,
    )


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """Serialize per-datum loss outputs and metrics as a ``tinker_public.ForwardBackwardOutput``.

    Every datum must carry the same output names: a BatchedTensor's offsets span the whole batch.
    """
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        record.fields[name].CopyFrom(batched_tensor([out[name] for out in outputs]))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    return msg.SerializeToString()
