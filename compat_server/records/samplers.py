"""Sampling sessions (the weights each was opened on) and the stability info recorded for what they sample
(stable_reinforce)."""

from __future__ import annotations

import json

from compat_server.records.base import RecordsFile, now


class SamplerRecords:
    def __init__(self, file: RecordsFile) -> None:
        self.file = file
        self.db = file.db

    # ---- sampling sessions ----------------------------------------------------------------------------------------
    def create_sampler(self, sampler_id: str, *, session_id: str, owner: str, base_model: str, kind: str,
                       model_path: str | None = None, model_id: str | None = None, adapter_key: str | None = None,
                       adapter_dir: str | None = None, checkpoint_uid: str | None = None) -> None:
        """``kind`` is ``base``, ``checkpoint`` (a saved sampler checkpoint), ``snapshot`` (ephemeral weights saved
        by save_weights_and_get_sampling_client) or ``inflight`` (the training model's shared, mutable weights):
        ``compat_server.sampling.weights.WeightsKind``."""
        self.file.insert("samplers", {
            "id": sampler_id, "session_id": session_id, "owner": owner, "base_model": base_model, "kind": kind,
            "model_path": model_path, "model_id": model_id, "adapter_key": adapter_key, "adapter_dir": adapter_dir,
            "created": now(), "checkpoint_uid": checkpoint_uid,
        })

    def sampler(self, sampler_id: str, owner: str) -> dict | None:
        return self.file.owned("samplers", sampler_id, owner)

    def join_sampler(self, sampler_id: str, owner: str) -> int | None:
        """The next clone number of a sampling session (``join_sampling_session``; the original client is 0), or
        None if ``owner`` has no such session. Counted in the file, so numbers are never reused, even across
        restarts."""
        with self.db.conn:
            updated = self.db.execute("UPDATE samplers SET clients = coalesce(clients, 0) + 1 WHERE id = ? AND "
                                      "owner = ? RETURNING clients", [sampler_id, owner]).fetchone()
        return None if updated is None else updated[0]

    # ---- stability info (stable_reinforce) -------------------------------------------------------------------------
    def record_sequences(self, owner: str, session_id: str,
                         sequences: list[tuple[str, list[int], list[int], list[float]]]) -> None:
        """Store (sequence_id, prompt, sampled tokens, sampler logprobs) per sampled sequence; a retried request
        replaces its own rows."""
        stamp = now()
        self.db["stability_records"].insert_all(({
            "sequence_id": sequence_id, "session_id": session_id, "owner": owner, "prompt": json.dumps(prompt),
            "tokens": json.dumps(tokens), "logprobs": json.dumps(logprobs), "created": stamp, "last_used": stamp,
        } for sequence_id, prompt, tokens, logprobs in sequences), replace=True)

    def recorded_sequence(self, sequence_id: str, owner: str) -> dict | None:
        row = self.file.owned("stability_records", sequence_id, owner)
        if row is not None:
            row.update({key: json.loads(row[key]) for key in ("prompt", "tokens", "logprobs")})
        return row

    def touch_sequences(self, sequence_ids: list[str]) -> None:
        stamp = now()
        with self.db.conn:
            self.db.conn.executemany("UPDATE stability_records SET last_used = ? WHERE sequence_id = ?",
                                     [(stamp, sid) for sid in sequence_ids])

    def purge_sequences(self, unused_since: str) -> int:
        """Delete stability records not used since ``unused_since``; returns how many."""
        with self.db.conn:
            return self.db.conn.execute("DELETE FROM stability_records WHERE last_used < ?", [unused_since]).rowcount
