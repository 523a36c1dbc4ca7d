"""The training operations behind the Tinker routes: what each request does to records, checkpoints and trainers.

Routes parse HTTP and call one method here; each method checks what it can at once and hands the rest to the
scheduler as a job, returning the future's JSON (``{"request_id", "model_id"}``) immediately.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from dataclasses import asdict
from datetime import UTC, datetime, timedelta

from tinker import types
from tinker.types.optimizer import OptimizerConfigBase, OptimParamsBase

from adapters.models.resolve import BaseModelSpec
from adapters.trainer.interface import AdamHyper, DimuonHyper, LoraSpec, StepRequest
from compat_server.jobs.futures import PROTOBUF, Payload
from compat_server.jobs.scheduler import Scheduler
from compat_server.records import Records
from compat_server.runs.checkpoint_store import CheckpointStore
from compat_server.sampling.service import SamplingService
from compat_server.telemetry import TOKENS_TRAINED
from compat_server.training.checkpoints import CheckpointCalls
from compat_server.training.core import TrainingCore, json_payload, model_id_for
from compat_server.training.custom_losses import CustomLossStore
from shims.custom_loss.graph import CustomLoss
from shims.errors import NotFound, UserError
from shims.tinker.training_wire import ForwardBackwardBatch, encode_forward_backward_output

log = logging.getLogger("compat_server.training")


def optimizer_family(config: OptimizerConfigBase) -> str:
    """``create_model``'s ``optimizer_config`` → the family the run trains with (``adamw`` or ``dimuon`` v1)."""
    fields = config.model_dump(exclude={"type"})
    if config.type == "adamw" and not fields:
        return "adamw"
    if config.type == "dimuon" and fields == {"version": 1}:
        return "dimuon"
    raise UserError(f"optimizer_config {config.model_dump()} is not supported; use AdamOptimizerConfig() or "
                    "DimuonOptimizerConfig() (version 1)")


def optimizer_hyper(params: types.AdamParams | OptimParamsBase) -> AdamHyper | DimuonHyper:
    """``optim_step``'s parameters → the trainer's, refusing unknown families and fields by name."""
    if isinstance(params, types.AdamParams):
        return AdamHyper(**params.model_dump())
    if params.type != "dimuon":
        raise UserError(f"optimizer params of type {params.type!r} are not supported; use AdamParams or DimuonParams")
    try:
        return DimuonHyper(**params.model_dump(exclude={"type"}))
    except TypeError as exc:
        raise UserError(f"DimuonParams takes learning_rate, beta1 and grad_clip_norm: {exc}") from None


class TrainingService:
    """Tinker training calls for one server: create, train, save, load and unload LoRA models. The checkpoint calls
    are its ``CheckpointCalls``' (it hands them on); what both share — the runs' lookups, ordering, limits and steps
    — is one ``TrainingCore``."""

    def __init__(self, records: Records, scheduler: Scheduler, checkpoints: CheckpointStore,
                 base_models: dict[str, BaseModelSpec], sampling: SamplingService,
                 max_adapters_per_key: int | None, max_lora_rank: int) -> None:
        """``max_lora_rank``: the vLLM samplers' (``--max-lora-rank``), at most the trainer's own ``MAX_LORA_RANK``."""
        self.core = TrainingCore(records, scheduler, base_models, max_adapters_per_key)
        self.checkpoint_calls = CheckpointCalls(self.core, checkpoints, sampling)
        self.records = records
        self.scheduler = scheduler
        self.base_models = base_models
        self.sampling = sampling
        self.max_lora_rank = max_lora_rank
        self.custom_losses = CustomLossStore()

    # ---- checkpoints (``CheckpointCalls``) ------------------------------------------------------------------------
    def save_weights(self, owner: str, req: types.SaveWeightsRequest, idem: str | None) -> dict:
        return self.checkpoint_calls.save_weights(owner, req, idem)

    def save_weights_for_sampler(self, owner: str, req: types.SaveWeightsForSamplerRequest, idem: str | None) -> dict:
        return self.checkpoint_calls.save_weights_for_sampler(owner, req, idem)

    def save_weights_external(self, owner: str, req: types.SaveWeightsExternalRequest, idem: str | None) -> dict:
        return self.checkpoint_calls.save_weights_external(owner, req, idem)

    def load_weights(self, owner: str, req: types.LoadWeightsRequest, idem: str | None) -> dict:
        return self.checkpoint_calls.load_weights(owner, req, idem)

    async def reload_after_restart(self, base_model: str) -> None:
        await self.checkpoint_calls.reload_after_restart(base_model)

    def metrics(self) -> dict:
        """Per base model: how many forward / forward_backward requests the trainer ran, in how many batches, and
        how many optim steps, in how many trainer calls; where its processes are (each shard of a sharded one, with
        the bytes of base weights it holds, which routed experts it holds (expert parallel; "" for all), its runs and
        the bytes of their adapter state — weights, gradients and optimizer state —, and the torch threads it runs,
        read in it every 2 s), and how often it restarted."""
        trainers = self.scheduler.trainers
        return {name: {**counts, "mean_requests_per_batch": counts["requests"] / counts["batches"] if counts["batches"]
                       else None, "node": trainers.facts[name].node, "pid": trainers.facts[name].pid,
                       "torch_threads": trainers.facts[name].threads, "restarts": trainers.groups[name].restarts,
                       "shards": [{"rank": f.shard, "pid": f.pid, "node": f.node, "device": f.device,
                                   "backend": f.backend, "base_bytes": f.base_bytes, "torch_threads": f.threads,
                                   "runs": f.runs, "adapter_bytes": f.adapter_bytes, "experts": f.experts}
                                  for f in trainers.groups[name].facts]}
                for name, counts in trainers.batch_counts.items()}

    # ---- create / info / unload -----------------------------------------------------------------------------------
    def create_model(self, owner: str, req: types.CreateModelRequest, idem: str | None) -> dict:
        model_id = model_id_for(req.session_id, req.model_seq_id)

        async def job() -> Payload:
            if self.records.sessions.session(req.session_id, owner) is None:
                raise NotFound(f"unknown session_id {req.session_id!r}")
            base = self.core.base(req.base_model)
            if req.lora_config is None:
                raise UserError("lora_config is required: this server trains LoRA adapters")
            optimizer = optimizer_family(req.optimizer_config)
            if self.records.runs.model(model_id, owner) is not None:
                raise UserError(f"model {model_id} already exists")
            lora = req.lora_config
            spec = LoraSpec(rank=lora.rank, seed=lora.seed if lora.seed is not None else secrets.randbelow(2**31),
                            train_mlp=lora.train_mlp, train_attn=lora.train_attn, train_unembed=lora.train_unembed,
                            optimizer=optimizer)
            spec.validate()
            if spec.rank > self.max_lora_rank:
                raise UserError(f"LoRA rank {spec.rank} is above this server's --max-lora-rank {self.max_lora_rank} "
                                "(the samplers are started for ranks up to it); ask for a smaller rank")
            if refusal := self.sampling.samplers.adapter_refusal(base.name, spec.groups()):
                raise UserError(refusal)
            with self.core.new_model_slot(owner):
                await self.scheduler.trainer_for(base.name).create(model_id, spec)
                self.records.runs.create_model(model_id, session_id=req.session_id, owner=owner, base_model=base.name,
                                               lora=asdict(spec), user_metadata=req.user_metadata)
            log.info("model created: %s on %s (LoRA rank %d)", model_id, base.name, spec.rank,
                     extra={"event": "model_created", "model_id": model_id, "base_model": base.name,
                            "lora_rank": spec.rank})
            return json_payload(types.CreateModelResponse(model_id=model_id))

        return self.core.future(self.scheduler.submit(owner=owner, kind="create_model", job=job, model_id=model_id,
                                                      idempotency_key=idem), model_id)

    def get_info(self, owner: str, model_id: str) -> dict:
        """The SDK's ``GetInfoResponse``; ``model_data`` also says what this run's LoRA adapts (a field the SDK
        ignores): the base model's weights in the groups the run trains."""
        row = self.records.runs.model(model_id, owner)
        if row is None:
            raise NotFound(f"unknown model_id {model_id!r}")
        base = self.base_models[row["base_model"]]
        facts = self.scheduler.trainers.facts[base.name]
        info = types.GetInfoResponse(
            type="get_info", model_id=model_id, is_lora=True, lora_rank=row["lora_rank"], model_name=base.name,
            model_data=types.ModelData(arch=facts.arch, model_name=base.name, tokenizer_id=base.tokenizer_id),
        ).model_dump(mode="json")
        lora = json.loads(row["lora_config"]) if row.get("lora_config") else {}
        trained = {group for group, flag in (("attn", "train_attn"), ("mlp", "train_mlp"), ("unembed", "train_unembed"))
                   if lora.get(flag, True)}
        info["model_data"]["lora_targets"] = {group: names for group, names in facts.lora_targets.items()
                                              if group in trained}
        return info

    def unload_model(self, owner: str, model_id: str, idem: str | None) -> dict:
        async def job(row: dict) -> Payload:
            await self.scheduler.trainer_for(row["base_model"]).unload(model_id)
            self.records.runs.set_model_status(model_id, "unloaded")
            log.info("model unloaded: %s", model_id)
            return json_payload(types.UnloadModelResponse(model_id=model_id, type="unload_model"))

        return self.core.ordered(owner, "unload_model", model_id, None, idem, job)

    def reject(self, owner: str, kind: str, model_id: str, seq_id: int | None, message: str, idem: str | None) -> dict:
        """Fail a request with a user error in its model's turn, so later requests of that model are not held up."""
        async def job(row: dict) -> Payload:
            raise UserError(message)

        return self.core.ordered(owner, kind, model_id, seq_id, idem, job)

    # ---- training -------------------------------------------------------------------------------------------------
    def forward_backward(self, owner: str, batch: ForwardBackwardBatch, idem: str | None) -> dict:
        kind = "forward" if batch.forward_only else "forward_backward"

        async def job(row: dict) -> Payload:
            custom = self.custom_losses.resolve(owner, row["session_id"], batch.loss_fn_config) \
                if batch.loss_fn == "custom" else None
            data = self.sampling.stability.attach(owner, row["session_id"], batch.loss_fn, batch.data)
            config = batch.loss_fn_config if custom is None else {}
            result = await self.scheduler.trainers.forward_backward(row["base_model"], StepRequest(
                batch.model_id, data, batch.loss_fn, config, batch.forward_only, custom_loss=custom))
            speed = result.num_tokens / max(result.seconds, 1e-9)
            TOKENS_TRAINED.add(result.num_tokens, {"base_model": row["base_model"], "kind": kind})
            self.records.runs.add_step(batch.model_id, seq_id=batch.seq_id, kind=kind, loss_fn=batch.loss_fn,
                                       metrics=result.metrics, num_tokens=result.num_tokens, tokens_per_s=speed)
            log.info("%s done: %s seq %d, %s %s, %d tokens, %.0f tokens/s", kind, batch.model_id, batch.seq_id,
                     batch.loss_fn, " ".join(f"{k}={v:.4f}" for k, v in result.metrics.items()), result.num_tokens,
                     speed, extra={"event": f"{kind}_done", "model_id": batch.model_id, "seq_id": batch.seq_id,
                                   "loss_fn": batch.loss_fn, "metrics": result.metrics,
                                   "tokens": result.num_tokens, "tokens_per_s": round(speed, 1)})
            return Payload(PROTOBUF, encode_forward_backward_output(result.outputs, result.metrics))

        return self.core.ordered(owner, kind, batch.model_id, batch.seq_id, idem, job)

    def check_loss_session(self, owner: str, session_id: str) -> None:
        """A custom loss is created in a live session of the caller's (404 for an unknown one or another key's)."""
        session = self.records.sessions.session(session_id, owner)
        if session is None:
            raise NotFound(f"unknown session_id {session_id!r}")
        if session["finished"]:
            raise UserError(f"session {session_id} has ended; create the loss in a live session")

    def create_custom_loss(self, owner: str, req: types.CreateCustomLossRequest, loss: CustomLoss, max_per_key: int,
                           idem: str | None) -> dict:
        """Store a traced loss (``loss``: ``req``'s graph, checked) at once (anything wrong is a 400 naming it); the
        future answers its id."""
        self.check_loss_session(owner, req.session_id)  # again: the session may have ended while the graph was read
        digest = hashlib.sha256(req.model_dump_json().encode()).hexdigest()
        loss_id = self.custom_losses.add(owner, req.session_id, req.custom_loss_seq_id, loss, digest, max_per_key)

        async def job() -> Payload:
            return json_payload(types.CreateCustomLossResponse(loss_id=loss_id))

        return self.core.future(self.scheduler.submit(owner=owner, kind="create_custom_loss", job=job,
                                                      idempotency_key=idem))

    def optim_step(self, owner: str, req: types.OptimStepRequest, idem: str | None) -> dict:
        async def job(row: dict) -> Payload:
            hyper = optimizer_hyper(req.optim_params)
            metrics = await self.scheduler.trainers.optim_step(row["base_model"], req.model_id, hyper)
            self.core.last_step[req.model_id] = int(metrics["step"])
            log.info("optim_step done: %s step %d (lr %g, grad_norm %.4f)", req.model_id, int(metrics["step"]),
                     hyper.learning_rate, metrics["grad_norm"],
                     extra={"event": "optim_step_done", "model_id": req.model_id, "step": int(metrics["step"]),
                            "learning_rate": hyper.learning_rate, "grad_norm": metrics["grad_norm"]})
            return json_payload(types.OptimStepResponse(metrics=metrics))

        return self.core.ordered(owner, "optim_step", req.model_id, req.seq_id, idem, job)

    # ---- ending sessions (here: it unloads their runs; the rest of a session is compat_server.sessions) -----------
    async def expire_sessions(self, timeout_seconds: float) -> int:
        """End sessions that stopped heartbeating ``timeout_seconds`` ago. Returns how many sessions ended."""
        cutoff = (datetime.now(UTC) - timedelta(seconds=timeout_seconds)).isoformat()
        stale = self.records.sessions.stale_sessions(cutoff)
        for session in stale:
            unloaded = await self.end_session(session["id"], "expired", "its session expired")
            log.info("session expired: %s (no heartbeat since %s); models unloaded: %s", session["id"],
                     session["last_heartbeat"], ", ".join(unloaded) or "none")
        return len(stale)

    async def end_session(self, session_id: str, reason: str, why: str) -> list[str]:
        """A session ends (its client closed it, or it expired): its training runs leave the trainer, so their
        adapter slots (``--max-adapters``, ``--max-adapters-per-key``) are free again, and its custom losses go;
        its saved checkpoints stay (load one into a new training client to continue). Returns the runs unloaded."""
        models = self.records.runs.active_models_of(session_id)
        for row in models:
            try:
                await self.scheduler.trainer_for(row["base_model"]).unload(row["id"])
            except Exception as exc:  # noqa: BLE001 - the model is gone from the trainer either way
                log.warning("unloading %s of ended session %s: %s", row["id"], session_id, exc)
            self.records.runs.set_model_status(row["id"], f"unloaded ({why}; load a checkpoint of it into a new "
                                                     "training client to continue)")
        self.records.sessions.finish_session(session_id, reason)
        self.custom_losses.drop_session(session_id)
        return [row["id"] for row in models]
