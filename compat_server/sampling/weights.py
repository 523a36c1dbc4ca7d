"""Which weights a sample request samples: a base model alone, a saved sampler checkpoint, or unnamed sampler weights
(a ``snapshot``, or a training model's shared ``inflight`` weights), resolved from a sampling session, a
``model_path``, a ``base_model`` or an OpenAI ``model`` value, and checked again each time a request runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from tinker import types

from adapters.models.resolve import BaseModelSpec
from adapters.samplers.interface import AdapterRef
from compat_server.records import Records
from compat_server.runs.checkpoint_store import CheckpointStore, parse_path
from compat_server.sampling.ephemeral import EphemeralWeights
from shims.errors import NotFound, UserError
from shims.openai.model_ids import parse_model_id


class WeightsKind(StrEnum):
    """What a sampling session samples from (its records' ``kind``)."""

    BASE = "base"
    """The base model alone."""
    CHECKPOINT = "checkpoint"
    """A sampler checkpoint saved under a name (``save_weights_for_sampler``): one save of it, by uid."""
    SNAPSHOT = "snapshot"
    """Unnamed weights saved by ``save_weights_and_get_sampling_client`` (``EphemeralWeights``)."""
    INFLIGHT = "inflight"
    """The training model's latest unnamed ``inflight`` save: weights that move on with each such save."""


class ModelNotFound(NotFound):
    """A model name or path that names nothing this caller may sample (the OpenAI routes answer 404)."""


def _base_weights() -> AdapterRef | None:
    return None


@dataclass(frozen=True)
class Target:
    """What one request samples from: a base model, and the weights on it. ``weights()`` is called when the request
    runs and checks again, at that moment, that the caller may still use them: a checkpoint unpublished, deleted,
    saved again under its name or expired since the request (or its sampling session) began is refused then."""

    base_model: str
    owner: str
    """The key it samples for: its metrics count the request."""
    weights: Callable[[], AdapterRef | None] = _base_weights
    context: int | None = None
    """The context the model id asked for (``:peft:<n>``), at most the base model's here; None: the base's."""


class SamplerWeights:
    """Resolves what a request, a sampling session or a model name samples, checking the caller may use it."""

    def __init__(self, records: Records, checkpoints: CheckpointStore, ephemeral: EphemeralWeights,
                 base_models: dict[str, BaseModelSpec], contexts: Mapping[str, int]) -> None:
        """``contexts``: each base model's context as its samplers serve it."""
        self.records = records
        self.contexts = contexts
        self.checkpoints = checkpoints
        self.ephemeral = ephemeral
        self.base_models = base_models

    def base(self, name: str) -> BaseModelSpec:
        spec = self.base_models.get(name)
        if spec is None:
            raise UserError(f"unknown base model {name!r}; this server serves: {', '.join(self.base_models)}")
        return spec

    def sampler_checkpoint(self, owner: str, path: str, uid: str | None = None) -> tuple[dict, AdapterRef]:
        """The checkpoint's record and the weights it names, checked now (given ``uid``: still that save). The key
        and directory are the save's own, so weights saved again under a reused name are never mistaken for the
        ones a sampler already holds. Sampler weights sample as saved; external weights (exported or uploaded) by
        the samplers' copy beside them (``CheckpointStore.sampler_copy``)."""
        parsed = parse_path(path)
        if parsed.checkpoint_type == "training":
            raise UserError(f"{path} holds training state (weights/); sample from sampler weights instead: save them "
                            "with save_weights_for_sampler and use the tinker://…/sampler_weights/… path it returns")
        ckpt, directory = self.checkpoints.readable(self.records, owner, path, "sampler checkpoint", uid)
        self.base(ckpt["base_model"])  # trained on a base model this server no longer serves
        if parsed.checkpoint_type == "external":
            directory = self.checkpoints.sampler_copy(directory)
            if not directory.is_dir():
                raise UserError(f"{path} holds exported weights without a copy samplers can load (age-encrypted, or "
                                "saved by an older version of this server); sample from sampler weights instead")
        return ckpt, AdapterRef(f"{path}@{ckpt['uid']}", str(directory))

    def sampleable(self, row: dict) -> bool:
        """Whether a readable checkpoint's record names weights a sampler can load: sampler weights, or external
        ones with their samplers' copy."""
        if row["kind"] != "external":
            return row["kind"] == "sampler"
        return self.checkpoints.sampler_copy(self.checkpoints.directory(row["tinker_path"], row["uid"])).is_dir()

    def checkpoint_target(self, owner: str, path: str) -> Target:
        """A sampler checkpoint readable by ``owner`` now, as a target that stays on this very save."""
        ckpt, _ = self.sampler_checkpoint(owner, path)
        return Target(ckpt["base_model"], owner, lambda: self.sampler_checkpoint(owner, path, ckpt["uid"])[1])

    def of_session(self, owner: str, sampler_id: str) -> AdapterRef | None:
        """The weights of a sampling session, re-read and re-checked at each use (inflight weights may have moved;
        the checkpoint a session was opened on may have been unpublished, deleted, replaced or expired)."""
        row = self.records.samplers.sampler(sampler_id, owner)
        if row is None:
            raise NotFound(f"unknown sampling session {sampler_id!r}")
        kind = WeightsKind(row["kind"])
        if kind is WeightsKind.BASE:
            return None
        if kind is WeightsKind.CHECKPOINT:
            return self.sampler_checkpoint(owner, row["model_path"], row["checkpoint_uid"] or "")[1]
        if kind is WeightsKind.INFLIGHT:
            ref = self.ephemeral.inflight(row["model_id"])
            if ref is None:
                raise UserError(f"the inflight weights of sampling session {row['id']} are gone: the server "
                                f"keeps the last {self.ephemeral.keep} unnamed saves per training model "
                                f"(--ephemeral-keep), those in memory within {self.ephemeral.memory_bytes // 2**20} "
                                "MiB (--ephemeral-memory-mb), and none across restarts; save weights for sampling "
                                "again")
            return ref
        held = self.ephemeral.snapshot(row["adapter_key"]) if not row["adapter_dir"] else None
        if held is None and not (row["adapter_dir"] and Path(row["adapter_dir"]).exists()):
            raise UserError(f"the weights of sampling session {row['id']} are gone: the server keeps the last "
                            f"{self.ephemeral.keep} unnamed saves per training model (--ephemeral-keep), those in "
                            f"memory within {self.ephemeral.memory_bytes // 2**20} MiB (--ephemeral-memory-mb), and "
                            "none across restarts; save weights for sampling again")
        return held or AdapterRef(row["adapter_key"], row["adapter_dir"])

    def for_request(self, owner: str, req: types.SampleRequest) -> tuple[Target, dict | None]:
        """What the request samples from, checked now (and again when it runs), and its sampling session's row
        (None for a request naming base_model / model_path directly)."""
        if req.sampling_session_id is not None:
            row = self.records.samplers.sampler(req.sampling_session_id, owner)
            if row is None:
                raise NotFound(f"unknown sampling session {req.sampling_session_id!r}")
            target = Target(row["base_model"], owner, lambda: self.of_session(owner, row["id"]))
        elif req.model_path:
            target = self.checkpoint_target(owner, req.model_path)
            row = None
        elif req.base_model:
            target, row = Target(self.base(req.base_model).name, owner), None
        else:
            raise UserError("a sample request needs a sampling_session_id, a model_path or a base_model")
        target.weights()
        return target, row

    def for_model(self, owner: str, model: str) -> Target:
        """An OpenAI ``model`` value in any of hosted Tinker's forms (``shims.openai.model_ids``) → what to sample:
        a base model, a ``tinker://…/sampler_weights/…`` path, or ``<base>;<path>``, a base with a ``:peft:<n>``
        context suffix in either. Unknown names raise ``ModelNotFound``; a checkpoint named on a base it was not
        trained on, or a context longer than the base's here, is a ``UserError``."""
        parsed = parse_model_id(model, self.base_models)
        if parsed.path is None:
            if parsed.base not in self.base_models:
                raise ModelNotFound(f"the model {model!r} does not exist; GET /v1/models lists the models you can use")
            target = Target(parsed.base, owner)
        else:
            try:
                target = self.checkpoint_target(owner, parsed.path)
            except UserError as exc:
                raise ModelNotFound(str(exc)) from None
            if parsed.base is not None and parsed.base != target.base_model:
                raise UserError(f"{parsed.path} was trained on {target.base_model}, not {parsed.base}")
        if parsed.context is None:
            return target
        served = self.contexts[target.base_model]
        if parsed.context > served:
            raise UserError(f"{target.base_model} is served here with a context of {served} tokens, shorter than the "
                            f"{parsed.context} that {model!r} asks for: use {target.base_model}:peft:{served} or less")
        return replace(target, context=parsed.context)
