"""Tinker ``TensorData`` / protobuf ``Tensor`` and token chunks ↔ numpy arrays."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from shims.errors import UserError

_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


def _frombuffer(raw: bytes, dtype: np.dtype, what: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise UserError(f"{what}: {len(raw)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(raw, dtype=dtype)


@dataclass(frozen=True)
class TensorLimits:
    """What a datum's ``loss_fn_inputs`` may legally be: one row per model_input position (``rows``), at most
    ``max_columns`` columns. Checked on the shape a client states, before anything is allocated from it."""

    rows: int
    max_columns: int


def _check_shape(shape: list[int], name: str, limits: TensorLimits) -> None:
    if len(shape) in (1, 2) and shape[0] == limits.rows and (len(shape) == 1 or 1 <= shape[1] <= limits.max_columns):
        return
    raise UserError(f"{name} has shape {shape}; loss_fn_inputs are [N] or [N, K] with N = {limits.rows} (the datum's "
                    f"model_input length) and 1 ≤ K ≤ {limits.max_columns} (--max-logprobs-k)")


def tensor_from_proto(msg: pb.Tensor, name: str, limits: TensorLimits) -> np.ndarray:
    """Decode a protobuf ``Tensor`` (dense, or sparse CSR with implicit zeros) into a numpy array of its shape.

    The shape is checked against ``limits`` first: a sparse tensor's shape, not its bytes, decides what the dense
    array costs, and a few bytes may state any shape. int32 is widened to int64, as the SDK does on its side.
    """
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(f"loss_fn_inputs[{name!r}]: unsupported dtype enum {msg.dtype}")
    shape = [int(s) for s in msg.shape]
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise UserError(f"loss_fn_inputs[{name!r}]: a sparse CSR tensor needs a 2-D shape, got {shape}")
        _check_shape(shape, name, limits)
        values = _frombuffer(msg.sparse_csr.values, dtype, f"loss_fn_inputs[{name!r}] values")
        crow = _frombuffer(msg.sparse_csr.crow_indices, np.dtype(np.int64), f"loss_fn_inputs[{name!r}] crow_indices")
        col = _frombuffer(msg.sparse_csr.col_indices, np.dtype(np.int64), f"loss_fn_inputs[{name!r}] col_indices")
        rows, cols = shape
        if (len(crow) != rows + 1 or len(col) != len(values) or (len(crow) and (crow[0] != 0 or crow[-1] != len(values)))
                or np.any(np.diff(crow) < 0) or np.any(col < 0) or np.any(col >= max(cols, 1))):
            raise UserError(f"loss_fn_inputs[{name!r}]: inconsistent sparse CSR indices for shape {shape}")
        dense = np.zeros((rows, cols), dtype=dtype)
        row_index = np.repeat(np.arange(rows), np.diff(crow))
        dense[row_index, col] = values
        array = dense
    else:
        flat = _frombuffer(msg.dense, dtype, f"loss_fn_inputs[{name!r}]")
        if not shape:
            shape = [flat.size]
        if math.prod(shape) != flat.size:
            raise UserError(f"loss_fn_inputs[{name!r}]: shape {shape} does not match its {flat.size} values")
        _check_shape(shape, name, limits)
        array = flat.reshape(shape)
    return array.astype(np.int64) if array.dtype == np.int32 else array.copy()


def tokens_from_chunks(chunks) -> np.ndarray:
    """Concatenate a datum's ``model_input`` chunks into one int64 token array.

    Only encoded-text chunks carry tokens on this server; image and audio chunks need a multimodal base model,
    which no served model is, so they are refused rather than silently dropped.
    """
    parts = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"model_input chunk of type {kind!r} is not supported: the served models are text-only")
        parts.append(_frombuffer(chunk.encoded_text.tokens, np.dtype(np.int32), "model_input tokens"))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(parts).astype(np.int64)


def batched_tensor(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    """Pack per-datum arrays (same dtype and trailing shape) into one ``BatchedTensor`` with byte offsets."""
    first = arrays[0]
    dtype = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64}[first.dtype]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    return pb.BatchedTensor(
        data=b"".join(np.ascontiguousarray(a).tobytes() for a in arrays),
        offsets=offsets.tobytes(), dtype=dtype, trailing_shape=list(first.shape[1:]),
    )
