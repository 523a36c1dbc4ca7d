"""Sampling sessions: opening one on a base model or a sampler checkpoint (``create_sampling_session``), or over
unnamed weights just saved (``save_weights_and_get_sampling_client``), and reading one back (``get_sampler``)."""

from __future__ import annotations

import logging
from pathlib import Path

from tinker import types

from compat_server.records import Records
from compat_server.sampling.ephemeral import EphemeralWeights
from compat_server.sampling.weights import SamplerWeights, WeightsKind
from shims.errors import NotFound, UserError

log = logging.getLogger("compat_server.sampling")


def sampler_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


class SamplingSessions:
    def __init__(self, records: Records, weights: SamplerWeights, ephemeral: EphemeralWeights) -> None:
        self.records = records
        self.weights = weights
        self.ephemeral = ephemeral

    def create(self, owner: str, req: types.CreateSamplingSessionRequest) -> str:
        if self.records.sessions.session(req.session_id, owner) is None:
            raise NotFound(f"unknown session_id {req.session_id!r}")
        sampler_id = sampler_id_for(req.session_id, req.sampling_session_seq_id)
        existing = self.records.samplers.sampler(sampler_id, owner)
        if existing is not None:  # a retried request: the same answer, nothing created twice
            changed_base = req.base_model and existing["base_model"] != req.base_model
            if existing["model_path"] != req.model_path or changed_base:
                raise UserError(f"sampling session {sampler_id} already exists with different weights")
            return sampler_id
        if req.model_path:
            ckpt, ref = self.weights.sampler_checkpoint(owner, req.model_path)
            if req.base_model and req.base_model != ckpt["base_model"]:
                raise UserError(f"{req.model_path} was trained on {ckpt['base_model']}, not {req.base_model}")
            self.records.samplers.create_sampler(sampler_id, session_id=req.session_id, owner=owner,
                                                 base_model=ckpt["base_model"], kind=WeightsKind.CHECKPOINT.value,
                                                 model_path=req.model_path, adapter_key=ref.key,
                                                 adapter_dir=ref.directory, checkpoint_uid=ckpt["uid"])
        elif req.base_model:
            self.weights.base(req.base_model)
            self.records.samplers.create_sampler(sampler_id, session_id=req.session_id, owner=owner,
                                                 base_model=req.base_model, kind=WeightsKind.BASE.value)
        else:
            raise UserError("create_sampling_session needs a base_model or a model_path")
        log.info("sampling session created: %s (%s)", sampler_id, req.model_path or req.base_model)
        return sampler_id

    def get(self, owner: str, sampler_id: str) -> types.GetSamplerResponse:
        row = self.records.samplers.sampler(sampler_id, owner)
        if row is None:
            raise NotFound(f"unknown sampling session {sampler_id!r}")
        return types.GetSamplerResponse(sampler_id=sampler_id, base_model=row["base_model"],
                                        model_path=row["model_path"])

    def register_ephemeral(self, owner: str, model_row: dict, sampling_session_seq_id: int | None, kind: str,
                           directory: Path | None = None, tensors: object = None, nbytes: int = 0) -> str:
        """Record a sampling session over weights just saved into ``directory`` (``self.ephemeral.directory``) or
        held in memory as ``tensors`` (of ``nbytes``: the Ray reference the trainer's ``sampler_tensors`` returned);
        ``kind`` is the request's: ``snapshot`` or ``inflight``."""
        if sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler without a name needs sampling_session_seq_id")
        weights_kind = WeightsKind(kind)
        if weights_kind not in (WeightsKind.SNAPSHOT, WeightsKind.INFLIGHT):
            raise UserError(f"unnamed sampler weights are a snapshot or inflight, not {kind!r}")
        ref = self.ephemeral.add(model_row["id"], directory, tensors, nbytes,
                                 inflight=weights_kind is WeightsKind.INFLIGHT)
        sampler_id = sampler_id_for(model_row["session_id"], sampling_session_seq_id)
        self.records.samplers.create_sampler(sampler_id, session_id=model_row["session_id"], owner=owner,
                                             base_model=model_row["base_model"], kind=weights_kind.value,
                                             model_id=model_row["id"], adapter_key=ref.key,
                                             adapter_dir=ref.directory or None)
        log.info("sampler weights saved (%s, %s): %s → sampling session %s", kind, "on disk" if ref.directory else
                 "in memory", model_row["id"], sampler_id)
        return sampler_id
