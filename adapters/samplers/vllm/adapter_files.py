"""The adapter directories the vLLM sampler loads: checked before the engine reads them (``read_config``,
``check_rank``), and written in shared memory for weights handed over in memory (``PeftTensors``: an unnamed save).

vLLM 0.32 loads a LoRA from a directory alone, in its worker processes (no API takes a LoRA's tensors: RFC
vllm-project/vllm#48297). So the sampler writes the handed tensors as a PEFT directory on a memory-backed filesystem
(``/dev/shm``), the engine's workers read it with vLLM's own loader (every check vLLM makes of a file holds for it),
and the directory is removed as soon as the engine has loaded it. vLLM never reads it again: ``ResidentAdapters``
never holds more adapters than vLLM's CPU cache (``max_cpu_loras``), so vLLM never evicts one on its own, and a
replica whose engine restarts starts empty.

Where ``/dev/shm`` cannot hold an adapter (a container's default is 64 MiB: ``docker run --shm-size`` raises it, as
Ray's object store needs too), the system's temporary directory is used instead, with a warning saying so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from adapters.lora.layout import ADAPTER_CONFIG
from adapters.samplers.interface import AdapterRef, PeftTensors
from shims.errors import UserError

log = logging.getLogger("compat_server.sampler")

SHARED_MEMORY = Path("/dev/shm")


def written(weights: PeftTensors, key: str, shared_memory: Path | None = None) -> Path:
    """A fresh directory holding ``weights`` as ``save_for_sampler`` writes them, in ``shared_memory`` (default
    ``SHARED_MEMORY``) where it has room; the caller removes it (``shutil.rmtree``) once vLLM has loaded it."""
    room = _room_for(weights.nbytes, key, shared_memory or SHARED_MEMORY)
    directory = Path(tempfile.mkdtemp(prefix="compat-server-lora-", dir=room))
    try:
        weights.write(directory)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def _room_for(nbytes: int, key: str, shared_memory: Path) -> str | None:
    """``shared_memory`` where it can take ``nbytes`` more (with 64 MiB to spare, for Ray's own use of it), else None:
    the system's temporary directory."""
    if shared_memory.is_dir() and os.access(shared_memory, os.W_OK):
        free = shutil.disk_usage(shared_memory).free
        if free >= nbytes + 64 * 2**20:
            return str(shared_memory)
        log.warning("sampler weights %s (%d MiB) do not fit %s (%d MiB free): handed to vLLM through %s instead; "
                    "give the machine or container more shared memory (docker run --shm-size)", key, nbytes // 2**20,
                    shared_memory, free // 2**20, tempfile.gettempdir(),
                    extra={"event": "shared_memory_full", "adapter": key})
    return None


def read_config(adapter: AdapterRef) -> dict:
    """The ``adapter_config.json`` of sampler weights in a directory; a user error, before anything is loaded, for
    one that is missing or unreadable."""
    config = Path(adapter.directory) / ADAPTER_CONFIG
    try:
        return json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"sampler weights {adapter.key} could not be loaded: {config} is missing or unreadable "
                        f"({type(exc).__name__})") from None


def check_rank(key: str, config: dict, max_rank: int) -> None:
    """A user error, before anything is loaded, for sampler weights of a rank the engine was not started for."""
    try:
        rank = max(int(r) for r in [config["r"], *(config.get("rank_pattern") or {}).values()])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"sampler weights {key} could not be loaded: adapter_config.json has no valid rank "
                        f"({type(exc).__name__})") from None
    if rank > max_rank:
        raise UserError(f"LoRA rank {rank} of {key} exceeds this sampler's --max-lora-rank {max_rank}")
