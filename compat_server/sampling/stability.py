"""Stability info for ``stable_reinforce``: what the sampler produced, recorded per sequence and found again by the
provenance spans of training datums.

A sampling client made with ``record_stability_info=True`` has every sampled sequence recorded (prompt, sampled
tokens, the sampler's logprobs) under its ``sequence_id``. As Tinker documents, the records belong to the session
that sampled them and can be trained on for a day after sampling, each training request that uses one restarting
that day (``--stability-ttl``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from compat_server.records import Records
from shims.errors import UserError
from shims.losses import LOSSES
from shims.provenance import RecordedSequence, recorded_logprobs
from shims.tinker.training_wire import DatumArrays

log = logging.getLogger("compat_server.stability")


class StabilityStore:
    def __init__(self, records: Records, ttl_seconds: float) -> None:
        self.records = records
        self.ttl = timedelta(seconds=ttl_seconds)

    def _cutoff(self) -> str:
        return (datetime.now(UTC) - self.ttl).isoformat()

    def record(self, owner: str, session_id: str, sequence_ids: list[str], prompt: list[int],
               sequences: list[tuple[list[int], list[float]]]) -> None:
        """Record one sample request's sequences (and drop records nobody used for a whole TTL)."""
        self.records.samplers.record_sequences(owner, session_id, [
            (sid, prompt, tokens, logprobs) for sid, (tokens, logprobs) in zip(sequence_ids, sequences)])
        purged = self.records.samplers.purge_sequences(self._cutoff())
        if purged:
            log.info("stability records expired: %d sequences unused for %s", purged, self.ttl)

    def attach(self, owner: str, session_id: str, loss_fn: str, data: list[DatumArrays]) -> list[DatumArrays]:
        """Each datum with the server inputs of ``loss_fn`` added from the records its spans name; the datums are
        unchanged for losses that need none."""
        server_inputs = LOSSES[loss_fn].server_inputs if loss_fn in LOSSES else ()
        if not server_inputs:
            return data
        cutoff = self._cutoff()
        found: dict[str, RecordedSequence] = {}

        def lookup(sequence_id: str) -> RecordedSequence:
            if sequence_id not in found:
                row = self.records.samplers.recorded_sequence(sequence_id, owner)
                if row is None:
                    raise UserError(f"sequence {sequence_id!r} has no recorded stability info: sample it with a "
                                    "client created with record_stability_info=True")
                if row["session_id"] != session_id:
                    raise UserError(f"sequence {sequence_id!r} was sampled in session {row['session_id']}; provenance "
                                    "works only within one session: sample and train in the same session")
                if row["last_used"] < cutoff:
                    raise UserError(f"the stability info of sequence {sequence_id!r} expired: it was last used "
                                    f"{row['last_used']}, more than {self.ttl} ago")
                found[sequence_id] = RecordedSequence(row["prompt"], row["tokens"], row["logprobs"])
            return found[sequence_id]

        out = []
        for i, datum in enumerate(data):
            sent = sorted(set(server_inputs) & set(datum.loss_fn_inputs))
            if sent:
                raise UserError(f"datum {i}: loss_fn_inputs {sent} are filled in by the server from its records; "
                                "do not send them")
            if "target_tokens" not in datum.loss_fn_inputs:
                raise UserError(f"datum {i}: loss {loss_fn!r} needs loss_fn_inputs ['target_tokens']")
            values, mask = recorded_logprobs(datum.tokens, datum.loss_fn_inputs["target_tokens"],
                                             datum.model_input_spans, datum.loss_fn_input_spans, lookup, f"datum {i}")
            out.append(replace(datum, loss_fn_inputs={**datum.loss_fn_inputs, "recorded_logprobs": values,
                                                      "recorded_mask": mask}))
        self.records.samplers.touch_sequences(sorted(found))
        return out
