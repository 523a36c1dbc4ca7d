"""The protobuf ``forward_backward`` request ↔ plain arrays, and training results → protobuf output."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from shims.errors import UserError
from shims.provenance import Span, check_tiling, spans_from_proto
from shims.tinker.tensors import TensorLimits, batched_tensor, tensor_from_proto, tokens_from_chunks


class RejectedRequest(UserError):
    """A request whose ids could be read but whose content is wrong.

    The SDK has already spent its ``seq_id``, so the rejection must take that slot in the model's queue (as a failed
    future) rather than be a bare HTTP 400 — otherwise the model's next request would wait for a number that never
    comes.
    """

    def __init__(self, message: str, model_id: str, seq_id: int, forward_only: bool) -> None:
        super().__init__(message)
        self.model_id, self.seq_id, self.forward_only = model_id, seq_id, forward_only


@dataclass
class DatumArrays:
    """One training example: input tokens and its named loss inputs, one row per input position."""

    tokens: np.ndarray
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    model_input_spans: list[Span] | None = None
    loss_fn_input_spans: list[Span] | None = None
    """Provenance (see ``shims.provenance``): both lists or neither."""


@dataclass
class ForwardBackwardBatch:
    """A decoded ``ForwardBackwardRequest``: everything the trainer needs, nothing tied to the wire."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[DatumArrays]


@dataclass(frozen=True)
class DatumLimits:
    """What any datum may be on this server: at most ``max_context`` tokens (the longest context of the served base
    models; each model's own is checked by the trainer) and ``max_columns`` per loss input row; and how many datums
    one request may hold."""

    max_context: int
    max_columns: int
    max_datums: int
    """Most datums in one request (``--max-batch-datums``): refused by count before any datum is decoded."""


def decode_forward_backward(body: bytes, limits: DatumLimits) -> ForwardBackwardBatch:
    """Parse a serialized ``tinker_public.ForwardBackwardRequest``, checking every stated size against ``limits``
    before allocating from it.

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
        raise RejectedRequest("forward_backward needs at least one datum", msg.model_id, msg.seq_id, msg.forward_only)
    if len(msg.data) > limits.max_datums:  # before decoding each one: 200k datums took ~10 s of Python
        raise RejectedRequest(f"this request holds {len(msg.data)} datums, more than one batch may (--max-batch-datums "
                              f"{limits.max_datums}); send fewer per call", msg.model_id, msg.seq_id, msg.forward_only)
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
            if tokens.size > limits.max_context:
                raise UserError(f"{tokens.size} input tokens exceed the model's maximum context length of "
                                f"{limits.max_context}")
            shape_limits = TensorLimits(rows=tokens.size, max_columns=limits.max_columns)
            inputs = {name: _loss_input(t, name, shape_limits, msg.loss_fn == "custom")
                      for name, t in datum.loss_fn_inputs.items()}
            model_spans, target_spans = _provenance(datum, tokens, inputs)
        except UserError as exc:
            raise RejectedRequest(f"datum {i}: {exc}", msg.model_id, msg.seq_id, msg.forward_only) from None
        data.append(DatumArrays(tokens=tokens, loss_fn_inputs=inputs, model_input_spans=model_spans,
                                loss_fn_input_spans=target_spans))
    return ForwardBackwardBatch(
        model_id=msg.model_id, seq_id=msg.seq_id, loss_fn=msg.loss_fn or "cross_entropy", loss_fn_config=config,
        forward_only=msg.forward_only, data=data,
    )


def _loss_input(tensor: pb.Tensor, name: str, limits: TensorLimits, custom: bool) -> np.ndarray:
    """One ``loss_fn_inputs`` tensor. A custom loss may also take scalars (rank 0): a dense tensor with no stated
    shape and one value, which the SDK sends for ``shape=[]`` (and for a one-value ``[T]`` with no shape, which
    ``shims.custom_loss.run`` reads at the loss's declared rank)."""
    if (custom and name != "target_tokens" and not tensor.shape and not tensor.HasField("sparse_csr")
            and limits.rows != 1 and len(tensor.dense) <= 8):  # one value is at most 8 bytes
        try:
            return tensor_from_proto(tensor, name, TensorLimits(1, limits.max_columns)).reshape(())
        except UserError:
            pass  # not one value: the ordinary rules say what is wrong with it
    return tensor_from_proto(tensor, name, limits)


def _provenance(datum: pb.Datum, tokens: np.ndarray,
                inputs: dict[str, np.ndarray]) -> tuple[list[Span] | None, list[Span] | None]:
    if not datum.model_input_spans and not datum.loss_fn_input_spans:
        return None, None
    if not datum.model_input_spans or not datum.loss_fn_input_spans:
        raise UserError("model_input_spans and loss_fn_input_spans come as a pair: send both or neither")
    model_spans = spans_from_proto(datum.model_input_spans, "model_input_spans")
    target_spans = spans_from_proto(datum.loss_fn_input_spans, "loss_fn_input_spans")
    check_tiling(model_spans, tokens.size, "model_input_spans", "model_input")
    if "target_tokens" in inputs:
        check_tiling(target_spans, inputs["target_tokens"].shape[0], "loss_fn_input_spans", "target_tokens")
    return model_spans, target_spans


def _layout(output: dict[str, np.ndarray]) -> tuple:
    return tuple((name, a.dtype.str, a.shape[1:]) for name, a in sorted(output.items()))


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """Serialize per-datum loss outputs and metrics as a ``tinker_public.ForwardBackwardOutput``.

    A BatchedTensor holds one dtype and trailing shape, so datums with different ``(N, K)`` layouts go into separate
    ArrayRecords (the SDK concatenates them); every datum must carry the same output names.
    """
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    start = 0
    while start < len(outputs):  # one record per run of datums whose fields share dtype and trailing shape
        layout = _layout(outputs[start])
        end = start + 1
        while end < len(outputs) and _layout(outputs[end]) == layout:
            end += 1
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=end - start)
        for name in outputs[start]:
            record.fields[name].CopyFrom(batched_tensor([out[name] for out in outputs[start:end]]))
        start = end
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    return msg.SerializeToString()
