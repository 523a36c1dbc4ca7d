"""compat_server.sampling.stability over a real SQLite file: session scoping, expiry after the TTL, and use restarting
it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from compat_server.records import Records
from compat_server.sampling.stability import StabilityStore
from shims.errors import UserError
from shims.provenance import Span
from shims.tinker.training_wire import DatumArrays


def datum(sid: str) -> DatumArrays:
    return DatumArrays(
        tokens=np.array([5, 6, 20], dtype=np.int64),
        loss_fn_inputs={"target_tokens": np.array([6, 20, 21]), "logprobs": np.zeros(3, np.float32),
                        "advantages": np.ones(3, np.float32)},
        model_input_spans=[Span("prompt", sid, 0, 2), Span("sampled", sid, 0, 1)],
        loss_fn_input_spans=[Span("prompt", sid, 1, 1), Span("sampled", sid, 0, 2)])


def test_records_are_session_scoped_expire_and_are_kept_alive_by_use(tmp_path):
    records = Records(tmp_path / "r.sqlite3")
    store = StabilityStore(records, ttl_seconds=2.0)
    store.record("owner", "session-a", ["a:0", "a:1"], [5, 6], [([20, 21], [-0.1, -0.2]), ([30], [-0.3])])
    (attached,) = store.attach("owner", "session-a", "stable_reinforce", [datum("a:0")])
    np.testing.assert_allclose(attached.loss_fn_inputs["recorded_logprobs"], [0, -0.1, -0.2], rtol=1e-6)
    np.testing.assert_array_equal(attached.loss_fn_inputs["recorded_mask"], [0, 1, 1])
    assert store.attach("owner", "session-a", "cross_entropy", [datum("a:0")])[0].loss_fn_inputs.keys() == \
        datum("a:0").loss_fn_inputs.keys()  # losses without server inputs are untouched
    with pytest.raises(UserError, match="only within one session"):
        store.attach("owner", "session-b", "stable_reinforce", [datum("a:0")])
    with pytest.raises(UserError, match="no recorded stability info"):
        store.attach("another-owner", "session-a", "stable_reinforce", [datum("a:0")])  # other tenants see nothing
    for _ in range(3):  # each use restarts the TTL: a:0 stays usable well past 2 s, a:1 (never used) does not
        time.sleep(0.8)
        store.attach("owner", "session-a", "stable_reinforce", [datum("a:0")])
    with pytest.raises(UserError, match="expired"):
        store.attach("owner", "session-a", "stable_reinforce", [datum("a:1")])
    store.record("owner", "session-a", ["a:2"], [5], [([1], [-1.0])])  # recording purges what expired
    assert records.samplers.recorded_sequence("a:1", "owner") is None
    assert records.samplers.recorded_sequence("a:0", "owner") is not None
