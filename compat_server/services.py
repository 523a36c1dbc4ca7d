"""The server's components wired together: records, futures, Ray, the trainer pool and the training service."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
from dataclasses import dataclass, field, replace

import ray

from adapters.models.resolve import BaseModelSpec, resolve_base_model
from adapters.samplers.interface import choose_backend
from adapters.samplers.pool import SamplerPool
from adapters.trainer.pool import TrainerPool
from compat_server import watchdog
from compat_server.access.quotas import KeyQuota
from compat_server.access.tokens import TokenIssuer
from compat_server.account.service import AccountService
from compat_server.completions.service import CompletionsService
from compat_server.completions.workers import TokenWorkers
from compat_server.config import ServerConfig
from compat_server.devices import GpuAsk, gpu_refusal, gpu_shares, node_gpus
from compat_server.jobs.futures import FutureHub
from compat_server.jobs.scheduler import Scheduler
from compat_server.records import SCHEMA_VERSION, Records
from compat_server.runs.checkpoint_store import CheckpointStore
from compat_server.runs.downloads import UrlSigner
from compat_server.runs.service import RunsService
from compat_server.runs.uploads import UploadService
from compat_server.sampling.service import SamplingService
from compat_server.sessions.service import SessionService
from compat_server.telemetry import observe, trainer_span
from compat_server.training.service import TrainingService
from shims.errors import ConfigurationRefused

log = logging.getLogger("compat_server")


@dataclass
class Services:
    """What route handlers reach through the ``services`` dependency."""

    config: ServerConfig
    records: Records
    hub: FutureHub
    quota: KeyQuota
    trainers: TrainerPool
    samplers: SamplerPool
    scheduler: Scheduler
    training: TrainingService
    sampling: SamplingService
    completions: CompletionsService
    runs: RunsService
    uploads: UploadService
    sessions: SessionService
    account: AccountService
    tokens: TokenIssuer
    base_models: dict[str, BaseModelSpec]
    background: list[asyncio.Task] = field(default_factory=list)

    def stop(self) -> None:
        for task in self.background:
            task.cancel()
        self.completions.workers.close()
        self.samplers.stop()
        self.trainers.stop()


def _start_ray(config: ServerConfig) -> None:
    """Join or start Ray. Ray installs a SIGTERM handler that exits the process at once; the server's own (uvicorn's
    graceful shutdown) is put back so a terminated server still finishes its requests and stops Ray cleanly."""
    if ray.is_initialized():
        return
    if threading.current_thread() is not threading.main_thread():  # embedded (e.g. tests): signals are not ours
        _init_ray(config)
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _init_ray(config)
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def _custom_resources(config: ServerConfig) -> dict[str, float]:
    """The custom Ray resources every trainer and sampler replica together ask for."""
    needed: dict[str, float] = {}
    models = len(config.base_models)
    for resources, count in ((config.trainer.resources, models * config.trainer.shards),
                             (config.sampler.resources, models * config.sampler.count)):
        for name, amount in resources.items():
            needed[name] = needed.get(name, 0.0) + amount * count
    return needed


def _init_ray(config: ServerConfig) -> None:
    needed = _custom_resources(config)
    if config.ray_address:
        ray.init(address=config.ray_address, log_to_driver=True, configure_logging=False)
        available = ray.cluster_resources()
        short = {name: amount for name, amount in needed.items() if available.get(name, 0.0) < amount}
        if short:  # the actors would wait for these forever; say so at once instead
            raise ConfigurationRefused(f"the Ray cluster at {config.ray_address} lacks the custom resources the "
                                       f"trainers and samplers ask for: needs {short}, has "
                                       f"{ {n: available.get(n, 0.0) for n in short} }; start its nodes with "
                                       "`ray start --resources '{\"NAME\": AMOUNT}'`")
    else:
        # Ray CPUs are logical: ask for at least what the configured actors reserve, or they could never be placed.
        per_model = config.trainer.cpus * config.trainer.shards + config.sampler.count * config.sampler.cpus
        cpus = math.ceil(per_model * len(config.base_models))
        # The object store's pages touched once at start (``--no-ray-preallocate-object-store``): a hand-off copies
        # the weights into it, and writing fresh pages cost more than the copy itself (bench/RESULTS.md, "RL
        # hand-off").
        ray.init(num_cpus=config.ray_num_cpus or max(os.cpu_count() or 1, cpus), resources=needed or None,
                 object_store_memory=config.ray_object_store_mb * 1024 * 1024, include_dashboard=False,
                 log_to_driver=True, configure_logging=False,
                 _system_config={"preallocate_plasma_memory": config.ray_preallocate_object_store})
        watchdog.start()  # the private instance's processes end with this one, even after kill -9


async def start_services(config: ServerConfig) -> Services:
    """Open the records, start Ray, the trainers and the samplers; returns when every base model is loaded."""
    base_models = {name: resolve_base_model(name) for name in config.base_models}
    records = Records(config.records_path)
    failed, unloaded = records.runs.recover_after_restart()
    if failed or unloaded:
        log.warning("the previous server process stopped with %d requests in flight (now failed) and %d models "
                    "loaded (reload them from a checkpoint)", failed, unloaded)
    _start_ray(config)
    ask = GpuAsk(len(base_models), config.trainer, config.sampler)
    trainer_gpus, sampler_gpus = gpu_shares(ray.cluster_resources().get("GPU", 0), ask)
    if missing := gpu_refusal(node_gpus(), ask, trainer_gpus, sampler_gpus):
        raise ConfigurationRefused(missing)
    # The components get their own options, with what was left to be decided at start now decided.
    trainers = TrainerPool(list(base_models.values()), replace(config.trainer, gpus=trainer_gpus), traced=trainer_span)
    vllm = config.sampler.vllm
    samplers = SamplerPool(list(base_models.values()), replace(
        config.sampler, backend=choose_backend(config.sampler.backend, sampler_gpus > 0), gpus=sampler_gpus,
        vllm=replace(vllm, gpu_memory_utilization=vllm.gpu_memory_utilization or (
            round(0.85 * min(sampler_gpus, 1.0), 2) if sampler_gpus > 0 else None))))
    if samplers.options.backend == "vllm" and sampler_gpus > 0 and trainer_gpus > 0:
        # vLLM checks at start that the share of the GPU it is given is free; a trainer that loaded first on the
        # same GPU would make that check fail, so the samplers take their share first.
        await samplers.start()
        await trainers.start()
    else:
        await asyncio.gather(trainers.start(), samplers.start())
    quota = KeyQuota(config.max_pending_per_key)
    hub = FutureHub(records, quota)
    scheduler = Scheduler(hub, trainers, gap_timeout=config.seq_gap_timeout)
    observe(hub.pending_by_state, scheduler.queue_depth, samplers.resident_counts)
    checkpoints = CheckpointStore(config.checkpoint_dir, config.min_checkpoint_ttl)
    if checkpoints.abandoned:
        log.warning("deleted %d half-written checkpoints left by the previous server process", checkpoints.abandoned)
    if moved := checkpoints.adopt_unversioned(records.checkpoints.all_checkpoints()):
        log.info("moved %d checkpoints into per-save directories (records schema %d)", moved, SCHEMA_VERSION)
    sampling = SamplingService(records, scheduler, samplers, checkpoints, config.ephemeral_dir, base_models,
                               config.sampling)
    training = TrainingService(records, scheduler, checkpoints, base_models, sampling, config.max_adapters_per_key,
                               config.sampler.vllm.max_lora_rank)
    trainers.on_restart = training.reload_after_restart
    signer = UrlSigner(config.url_key_path, config.download_url_ttl)
    runs = RunsService(records, checkpoints, signer)
    uploads = UploadService(records, checkpoints, signer, scheduler, base_models, config.uploads, config.uploads_dir,
                            config.sampler.vllm.max_lora_rank, registered_keys=config.auth_mode == "keys")
    services = Services(config=config, records=records, hub=hub, quota=quota, trainers=trainers, samplers=samplers,
                    scheduler=scheduler, training=training, sampling=sampling,
                    completions=CompletionsService(sampling, records, base_models, quota, config.openai,
                                                   TokenWorkers(config.tokenizer_threads)),
                    runs=runs, uploads=uploads, sessions=SessionService(records, config.sessions),
                    account=AccountService(records, signer),
                    base_models=base_models,
                    tokens=TokenIssuer(config.url_key_path.read_bytes(), config.token_ttl))
    loop = asyncio.get_running_loop()
    services.background = [loop.create_task(_sweep_expired(services)), loop.create_task(trainers.watch(2.0))]
    return services


async def _sweep_expired(services: Services) -> None:
    """Every ``--expiry-sweep-seconds``: delete expired checkpoints (they vanished from listings when they expired)
    and expired adapter uploads, and end sessions that stopped heartbeating ``--session-timeout`` seconds ago."""
    config = services.config
    while True:
        try:
            services.runs.sweep_expired()
            services.uploads.sweep_expired()
            await services.training.expire_sessions(config.session_timeout)
        except Exception:  # a failed sweep is retried next time; it must not end the loop
            log.exception("expiry sweep failed")
        await asyncio.sleep(config.expiry_sweep_seconds)
