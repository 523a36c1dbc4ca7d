"""shims.tinker.tensors / shims.tinker.training_wire against the SDK's own encoder and decoder."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from shims.errors import UserError
from shims.losses import check_datum
from shims.tinker.tensors import TensorLimits, tensor_from_proto, tokens_from_chunks
from shims.tinker.training_wire import (
    DatumLimits,
    RejectedRequest,
    decode_forward_backward,
    encode_forward_backward_output,
)

LIMITS = DatumLimits(max_context=2048, max_columns=64, max_datums=32768)


def sdk_bytes(data: list[types.Datum], loss_fn="cross_entropy", config=None, seq_id=7) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0", seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_sdk_encoded_request_decodes_to_the_same_arrays():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 500, size=9).tolist()
    targets = rng.integers(0, 500, size=9)
    weights = rng.normal(size=9).astype(np.float32)
    sparse_targets = torch.zeros((3, 8), dtype=torch.int64)
    sparse_targets[0, 1], sparse_targets[2, 5] = 3, 4
    sparse_weights = torch.zeros((3, 8))
    sparse_weights[0, 1], sparse_weights[2, 5] = 0.5, 1.0
    data = [
        types.Datum(model_input=types.ModelInput.from_ints(tokens),
                    loss_fn_inputs={"target_tokens": targets, "weights": weights}),
        types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]),
                                                         types.EncodedTextChunk(tokens=[3])]),
                    loss_fn_inputs={"target_tokens": types.TensorData.from_torch_sparse(sparse_targets),
                                    "weights": types.TensorData.from_torch_sparse(sparse_weights)}),
    ]
    body = sdk_bytes(data, config={"clip_low_threshold": 0.8, "mode": "x"})
    wire = pb.ForwardBackwardRequest.FromString(body)
    assert wire.data[1].loss_fn_inputs["weights"].HasField("sparse_csr"), "the SDK should have sent CSR here"
    batch = decode_forward_backward(body, LIMITS)
    assert (batch.model_id, batch.seq_id, batch.loss_fn, batch.forward_only) == ("s:train:0", 7, "cross_entropy", False)
    assert batch.loss_fn_config == {"clip_low_threshold": 0.8, "mode": "x"}
    np.testing.assert_array_equal(batch.data[0].tokens, tokens)
    np.testing.assert_array_equal(batch.data[0].loss_fn_inputs["target_tokens"], targets)
    assert batch.data[0].loss_fn_inputs["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(batch.data[0].loss_fn_inputs["weights"], weights)
    np.testing.assert_array_equal(batch.data[1].tokens, [1, 2, 3])
    np.testing.assert_array_equal(batch.data[1].loss_fn_inputs["target_tokens"], sparse_targets.numpy())
    np.testing.assert_array_equal(batch.data[1].loss_fn_inputs["weights"], sparse_weights.numpy())


def test_output_encoding_round_trips_through_the_sdk_decoder():
    rng = np.random.default_rng(1)
    outputs = [{"logprobs": rng.normal(size=n).astype(np.float32)} for n in (3, 1, 5)]
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(outputs, {"loss:sum": 2.5}))
    assert decoded.metrics == {"loss:sum": 2.5}
    for sent, got in zip(outputs, decoded.loss_fn_outputs):
        np.testing.assert_array_equal(got["logprobs"].to_numpy(), sent["logprobs"])
    two_d = [{"logprobs": rng.normal(size=(n, 3)).astype(np.float32)} for n in (2, 4)]
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(two_d, {}))
    for sent, got in zip(two_d, decoded.loss_fn_outputs):
        assert got["logprobs"].shape == [sent["logprobs"].shape[0], 3]
        np.testing.assert_array_equal(got["logprobs"].to_numpy(), sent["logprobs"])


def test_outputs_of_different_layouts_in_one_batch_reach_the_sdk_intact():
    outputs = [{"logprobs": np.arange(3, dtype=np.float32)}, {"logprobs": np.ones((2, 2), np.float32)},
               {"logprobs": np.zeros((4, 2), np.float32)}, {"logprobs": np.full(1, 7, np.float32)}]
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(outputs, {}))
    assert [o["logprobs"].shape for o in decoded.loss_fn_outputs] == [[3], [2, 2], [4, 2], [1]]
    for sent, got in zip(outputs, decoded.loss_fn_outputs):
        np.testing.assert_array_equal(got["logprobs"].to_numpy().reshape(sent["logprobs"].shape), sent["logprobs"])


@pytest.mark.parametrize("tensor, message", [
    (pb.Tensor(dense=np.ones(3, np.float32).tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[4]), "does not match"),
    (pb.Tensor(dense=b"\x00" * 5, dtype=pb.DTYPE_FLOAT32, shape=[1]), "not a whole number"),
    (pb.Tensor(dense=b"", dtype=pb.DTYPE_BFLOAT16), "unsupported dtype"),
    (pb.Tensor(sparse_csr=pb.SparseCsr(values=np.ones(2, np.float32).tobytes(),
                                       crow_indices=np.array([0, 1, 3], np.int64).tobytes(),
                                       col_indices=np.array([0, 1], np.int64).tobytes()),
               dtype=pb.DTYPE_FLOAT32, shape=[2, 2]), "inconsistent sparse CSR"),
    (pb.Tensor(sparse_csr=pb.SparseCsr(values=np.ones(1, np.float32).tobytes(),
                                       crow_indices=np.array([0, 1], np.int64).tobytes(),
                                       col_indices=np.array([9], np.int64).tobytes()),
               dtype=pb.DTYPE_FLOAT32, shape=[1, 2]), "inconsistent sparse CSR"),
])
def test_malformed_tensors_are_user_errors(tensor, message):
    with pytest.raises(UserError, match=message):
        tensor_from_proto(tensor, "weights", TensorLimits(rows=tensor.shape[0] if tensor.shape else 3, max_columns=4))


def test_int32_tensors_widen_to_int64():
    array = tensor_from_proto(pb.Tensor(dense=np.array([1, 2], np.int32).tobytes(), dtype=pb.DTYPE_INT32), "t",
                              TensorLimits(rows=2, max_columns=1))
    assert array.dtype == np.int64 and array.tolist() == [1, 2]


def test_non_text_chunks_and_garbage_are_refused():
    image = pb.Chunk(image=pb.ImageChunk(data=b"png", format="png"))
    with pytest.raises(UserError, match="'image' is not supported"):
        tokens_from_chunks([image])
    with pytest.raises(UserError, match="not a valid ForwardBackwardRequest"):
        decode_forward_backward(b"\x0a\xff\xff\xff", LIMITS)
    with pytest.raises(UserError, match="at least one datum"):
        decode_forward_backward(pb.ForwardBackwardRequest(model_id="m").SerializeToString(), LIMITS)


def sparse_request(shape: list[int], tokens: int = 1) -> bytes:
    """A ~100-byte ForwardBackwardRequest whose one sparse tensor states ``shape`` (no stored values)."""
    weights = pb.Tensor(sparse_csr=pb.SparseCsr(values=b"", crow_indices=np.zeros(2, np.int64).tobytes(),
                                                col_indices=b""), dtype=pb.DTYPE_FLOAT32, shape=shape)
    datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(
        tokens=np.arange(tokens, dtype=np.int32).tobytes()))], loss_fn_inputs={"weights": weights})
    return pb.ForwardBackwardRequest(model_id="s:train:0", data=[datum]).SerializeToString()


@pytest.mark.parametrize("shape, tokens, message", [
    ([1, 2**28], 1, r"1 ≤ K ≤ 64 \(--max-logprobs-k\)"),  # 1 GiB dense, once
    ([1, 2**40], 1, r"1 ≤ K ≤ 64"),  # more than any machine has: once a MemoryError (500)
    ([2**31, 1], 1, r"N = 1 \(the datum's model_input length\)"),
    ([4, 0], 4, r"1 ≤ K ≤ 64"),
    ([3, 2], 3000, "maximum context length of 2048"),
])
def test_a_stated_shape_is_checked_before_anything_is_allocated_from_it(shape, tokens, message):
    body = sparse_request(shape, tokens)
    assert len(body) < 12_100
    tracemalloc.start()
    try:
        with pytest.raises(RejectedRequest, match=message):
            decode_forward_backward(body, LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing near the stated size was allocated


def test_float_inputs_sent_as_integers_are_refused_like_integer_inputs_sent_as_floats():
    tokens, inputs = np.arange(4, dtype=np.int64), {"target_tokens": np.arange(4, dtype=np.int64)}
    with pytest.raises(UserError, match="weights must be float32, got int64"):
        check_datum("cross_entropy", 0, tokens, {**inputs, "weights": np.ones(4, np.int64)}, vocab_size=512,
                    max_context=2048)
    with pytest.raises(UserError, match="target_tokens must be int64, got float32"):
        check_datum("cross_entropy", 0, tokens, {"target_tokens": np.arange(4, dtype=np.float32),
                                                 "weights": np.ones(4, np.float32)}, vocab_size=512, max_context=2048)


def test_a_request_of_more_datums_than_a_batch_may_hold_is_refused_before_they_are_decoded(monkeypatch):
    """200,000 one-token datums (14 MB) took ~10 s of Python to decode, holding the GIL the event loop needs: a
    request over --max-batch-datums is refused by its count alone, and not one datum is decoded."""
    import shims.tinker.training_wire as wire

    data = [types.Datum(model_input=types.ModelInput.from_ints([5]),
                        loss_fn_inputs={"target_tokens": np.array([6], np.int64)}) for _ in range(101)]
    decoded = []
    original = wire.tokens_from_chunks
    monkeypatch.setattr(wire, "tokens_from_chunks", lambda chunks: decoded.append(1) or original(chunks))
    limits = DatumLimits(max_context=2048, max_columns=64, max_datums=100)
    with pytest.raises(RejectedRequest, match=r"holds 101 datums, more than one batch may \(--max-batch-datums 100\)"):
        decode_forward_backward(sdk_bytes(data), limits)
    assert not decoded
    assert len(decode_forward_backward(sdk_bytes(data[:100]), limits).data) == 100
    assert len(decoded) == 100
