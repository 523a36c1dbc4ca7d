"""The server's components wired together: records, futures, Ray, the trainer pool and the training service."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

import ray

from adapters.base_models import BaseModelSpec, resolve_base_model
from adapters.trainer_pool import TrainerPlacement, TrainerPool
from compat_server.checkpoints import CheckpointStore
from compat_server.config import ServerConfig
from compat_server.futures import FutureHub
from compat_server.records import Records
from compat_server.scheduler import Scheduler
from compat_server.training import TrainingService

log = logging.getLogger("compat_server")


@dataclass
class Services:
    """What route handlers reach through the ``services`` dependency."""

    config: ServerConfig
    records: Records
    hub: FutureHub
    trainers: TrainerPool
    scheduler: Scheduler
    training: TrainingService
    base_models: dict[str, BaseModelSpec]


def _start_ray(config: ServerConfig) -> None:
    """Join or start Ray. Ray installs a SIGTERM handler that exits the process at once; the server's own (uvicorn's
    graceful shutdown) is put back so a terminated server still finishes its requests and stops Ray cleanly."""
    if ray.is_initialized():
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _init_ray(config)
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def _init_ray(config: ServerConfig) -> None:
    if config.ray_address:
        ray.init(address=config.ray_address, log_to_driver=True, configure_logging=False)
    else:
        ray.init(num_cpus=config.ray_num_cpus, object_store_memory=config.ray_object_store_mb * 1024 * 1024,
                 include_dashboard=False, log_to_driver=True, configure_logging=False)


async def start_services(config: ServerConfig) -> Services:
    """Open the records, start Ray and the trainers; returns when every base model is loaded."""
    base_models = {name: resolve_base_model(name) for name in config.base_models}
    records = Records(config.records_path)
    failed, unloaded = records.recover_after_restart()
    if failed or unloaded:
        log.warning("the previous server process stopped with %d requests in flight (now failed) and %d models "
                    "loaded (reload them from a checkpoint)", failed, unloaded)
    _start_ray(config)
    gpus = config.trainer_gpus
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    trainers = TrainerPool(list(base_models.values()), TrainerPlacement(
        num_cpus=config.trainer_cpus, num_gpus=gpus, threads=config.trainer_threads))
    await trainers.start()
    hub = FutureHub(records)
    scheduler = Scheduler(hub, trainers, gap_timeout=config.seq_gap_timeout)
    training = TrainingService(records, scheduler, CheckpointStore(config.checkpoint_dir), base_models)
    return Services(config=config, records=records, hub=hub, trainers=trainers, scheduler=scheduler,
                    training=training, base_models=base_models)
