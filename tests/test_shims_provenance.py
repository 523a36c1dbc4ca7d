"""shims.provenance and the span / loss_fn_config parts of the forward_backward wire, against the SDK's encoder."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from shims.errors import UserError
from shims.provenance import RecordedSequence, Span, recorded_logprobs
from shims.tinker.training_wire import DatumLimits, decode_forward_backward
from tests.test_shims_wire import sdk_bytes

LIMITS = DatumLimits(max_context=2048, max_columns=64, max_datums=32768)

PROMPT, SAMPLED, LOGPROBS = [5, 6, 7, 8], [20, 21, 22], [-0.5, -1.5, -2.5]
RECORDS = {"s:sample:0:1:0": RecordedSequence(PROMPT, SAMPLED, LOGPROBS)}


def single_turn(sid: str = "s:sample:0:1:0") -> types.Datum:
    """The cookbook's canonical single-turn datum: input = prompt + sampled[:-1], placeholder targets on the prompt."""
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + SAMPLED[:-1]), loss_fn_inputs={
        "target_tokens": [0] * (len(PROMPT) - 1) + SAMPLED, "logprobs": [0.0] * 6, "advantages": [1.0] * 6})
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=4),
                     types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=2)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=3),
                        types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=3)])


def resolve(datum_arrays, records=RECORDS):
    def lookup(sid):
        if sid not in records:
            raise UserError(f"unknown {sid}")
        return records[sid]
    return recorded_logprobs(datum_arrays.tokens, datum_arrays.loss_fn_inputs["target_tokens"],
                             datum_arrays.model_input_spans, datum_arrays.loss_fn_input_spans, lookup, "datum 0")


def test_spans_survive_the_wire_and_find_the_recorded_logprobs():
    batch = decode_forward_backward(sdk_bytes([single_turn()], loss_fn="stable_reinforce"), LIMITS)
    datum = batch.data[0]
    assert datum.model_input_spans == [Span("prompt", "s:sample:0:1:0", 0, 4), Span("sampled", "s:sample:0:1:0", 0, 2)]
    assert datum.loss_fn_input_spans[1] == Span("sampled", "s:sample:0:1:0", 0, 3)
    values, mask = resolve(datum)
    np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 1])
    np.testing.assert_allclose(values, [0, 0, 0, *LOGPROBS])


def test_datums_without_spans_decode_to_none():
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
    decoded = decode_forward_backward(sdk_bytes([datum]), LIMITS).data[0]
    assert decoded.model_input_spans is None and decoded.loss_fn_input_spans is None
    with pytest.raises(UserError, match="stable_reinforce needs provenance"):
        resolve(decoded)


def _edit(body: bytes, change) -> bytes:
    msg = pb.ForwardBackwardRequest.FromString(body)
    change(msg.data[0])
    return msg.SerializeToString()


@pytest.mark.parametrize("change, message", [
    (lambda d: d.ClearField("loss_fn_input_spans"), "come as a pair"),
    (lambda d: setattr(d.model_input_spans[1].sampled_tokens, "length", 3), "must tile it exactly"),
    (lambda d: setattr(d.loss_fn_input_spans[0].prompt_tokens, "length", 1), "must tile it exactly"),
    (lambda d: d.model_input_spans[0].prompt_tokens.ClearField("sequence_id"), "needs a sequence_id"),
])
def test_malformed_provenance_is_rejected_naming_the_field(change, message):
    body = _edit(sdk_bytes([single_turn()], loss_fn="stable_reinforce"), change)
    with pytest.raises(UserError, match=f"datum 0: .*{message}"):
        decode_forward_backward(body, LIMITS)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.tokens.__setitem__(5, 99), r"model_input_spans\[1\] claims positions 4..6 are sampled tokens"),
    (lambda d: d.tokens.__setitem__(0, 99), r"model_input_spans\[0\] claims positions 0..4 are prompt tokens"),
    (lambda d: d.loss_fn_inputs["target_tokens"].__setitem__(5, 1), r"loss_fn_input_spans\[1\] claims target"),
    (lambda d: d.model_input_spans.__setitem__(1, Span("sampled", "s:sample:0:1:0", 2, 2)), "lie beyond the 3"),
    (lambda d: d.model_input_spans.__setitem__(0, Span("prompt", "other", 0, 4)), "unknown other"),
])
def test_spans_that_disagree_with_the_record_are_user_errors(edit, message):
    datum = decode_forward_backward(sdk_bytes([single_turn()], loss_fn="stable_reinforce"), LIMITS).data[0]
    edit(datum)
    with pytest.raises(UserError, match=message):
        resolve(datum)


def test_prompt_span_targets_are_placeholders_not_compared():
    datum = decode_forward_backward(sdk_bytes([single_turn()], loss_fn="stable_reinforce"), LIMITS).data[0]
    datum.loss_fn_inputs["target_tokens"][:3] = [9, 9, 9]  # not the prompt's tokens: weight-0 placeholders
    _, mask = resolve(datum)
    assert mask.sum() == 3


@pytest.mark.parametrize("fill, expected", [
    (lambda m: m.loss_fn_config.update({"beta": 0.2}), {"beta": 0.2}),  # an older client: legacy map only
    (lambda m: m.loss_fn_config_v2["loss_id"].__setattr__("text", "abc"), {"loss_id": "abc"}),
    # both present and disagreeing: v2 wins, as the SDK's comment says servers do
    (lambda m: (m.loss_fn_config.update({"beta": 0.2}), m.loss_fn_config_v2["beta"].__setattr__("number", 0.3)),
     {"beta": 0.3}),
])
def test_loss_fn_config_maps(fill, expected):
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
    msg = pb.ForwardBackwardRequest.FromString(sdk_bytes([datum]))
    fill(msg)
    assert decode_forward_backward(msg.SerializeToString(), LIMITS).loss_fn_config == pytest.approx(expected)
