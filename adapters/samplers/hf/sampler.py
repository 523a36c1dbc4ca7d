"""The transformers sampler: the CPU default (and GPU fallback) behind the sampler interface.

Concurrent requests are not run one by one: every request that is waiting when the model becomes free joins one
batch (up to ``max_batch_sequences`` sequences), each row with its own LoRA adapter, its own sampling parameters and
its own random generator. Adapters run through ``adapters.lora.model`` (the trainer's LoRA model and loader): requests are
ordered by adapter so each adapter's rows are one slice of the batch, which ``adapters.samplers.hf.decode`` decodes.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from adapters.batching import Coalescer
from adapters.cpu_threads import set_torch_threads
from adapters.lora.files import adapter_scale, read_adapter_file
from adapters.lora.linear import with_tied_input_side
from adapters.lora.model import LoRAModel
from adapters.models.resolve import is_vision_language, resolve_dtype, text_settings
from adapters.samplers.grammar import JsonGrammars, check_constraint
from adapters.samplers.hf.decode import BatchDecoder, BatchRequest
from adapters.samplers.interface import (
    AdapterRef,
    OnToken,
    PeftTensors,
    ResidentAdapters,
    SamplerBackend,
    SamplerFacts,
)
from adapters.samplers.options import SamplerOptions
from shims.errors import UserError
from shims.sampling.job import SampleJob, SampleResult

log = logging.getLogger("compat_server.sampler")

PROMPT_LOGITS_BUDGET = 1 << 28
"""Most logit cells (rows × prompt length × vocabulary; 1 GiB in fp32) one batch may materialise to score prompts:
a request that would exceed it with others waits for a batch of its own."""


class TransformersSampler(SamplerBackend):
    """One base model in transformers, sampled with any number of LoRA adapters (standard PEFT directories)."""

    def __init__(self, location: str, options: SamplerOptions = SamplerOptions()) -> None:  # noqa: B008 - frozen
        """``options``: the samplers' (``dtype`` ``auto``: the model's own on a GPU, float32 on CPU;
        ``max_model_len``: the longest prompt + completion, unset or beyond it: the model's context;
        ``disable_any_whitespace``: constrained JSON without optional whitespace, as vLLM's setting of that name)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        set_torch_threads(options.threads)  # None: this machine's usable CPUs (adapters.cpu_threads)
        self.location = location
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = getattr(torch, resolve_dtype(options.dtype, self.device.type, location))
        self.tokenizer = AutoTokenizer.from_pretrained(location)
        self.base = AutoModelForCausalLM.from_pretrained(location, dtype=dtype).to(self.device).eval()
        self.base.requires_grad_(False)
        self.model = LoRAModel(self.base)
        """The same LoRA model the trainer holds: adapters load, scale and compute as they train."""
        self.naming = self.model.naming(is_vision_language(AutoConfig.from_pretrained(location)))
        text = text_settings(self.base.config)
        eos = self.base.generation_config.eos_token_id if self.base.generation_config else None
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._decoder = BatchDecoder(self._forward, self.device, self.pad_id, self.eos_ids, self.tokenizer.decode,
                                     JsonGrammars(self.tokenizer, text.vocab_size, options.disable_any_whitespace))
        self._facts = SamplerFacts(
            backend="transformers", vocab_size=text.vocab_size,
            max_context=min(text.max_context, options.max_model_len or 1 << 62),
            device=str(self.device), max_resident=options.max_resident, dtype=str(dtype).removeprefix("torch."))
        self.max_batch_sequences = options.max_batch_sequences
        self.adapters = ResidentAdapters(options.max_resident)
        self.dead: str | None = None
        """Never set: the transformers sampler has no separate engine that could die under it."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transformers-sampler")
        self._batches = Coalescer(self._run_in_thread, self._batch_size)
        self.batches = 0

    def facts(self) -> SamplerFacts:
        return self._facts

    def resident(self) -> list[str]:
        return self.adapters.keys()

    async def torch_threads(self) -> list[int]:
        """Read on the thread every batch runs on (``_run_in_thread``)."""
        return [await asyncio.get_running_loop().run_in_executor(self._thread, torch.get_num_threads)]

    def stats(self) -> dict:
        return {"batches": self.batches, "decoded_tokens": self.decoded_tokens, "resident_adapters": self.resident()}

    @property
    def decoded_tokens(self) -> int:
        """Every token decoded, including those of requests whose caller later went away."""
        return self._decoder.decoded_tokens

    async def close(self) -> None:
        """Stop batching (requests still waiting fail as cancelled)."""
        await self._batches.close()
        self._thread.shutdown(wait=False)

    # ---- request intake -------------------------------------------------------------------------------------------
    async def sample(self, adapter: AdapterRef | None, job: SampleJob, on_token: OnToken | None = None) -> SampleResult:
        """Requests waiting when the model becomes free run together as one batch, in a worker thread. Cancelling
        the call stops its sequences: still waiting, it never joins a batch; running, its rows leave the batch."""
        check_constraint(job.constraint)
        request = BatchRequest(adapter, job, on_token)
        try:
            return await self._batches.submit(request)
        except asyncio.CancelledError:
            request.cancelled.set()
            raise

    async def _run_in_thread(self, batch: list[BatchRequest]) -> list[SampleResult | Exception]:
        """Every batch on the one same thread: torch's CPU thread pool belongs to the thread that calls it, and the
        pools left behind on other threads (``asyncio.to_thread`` picks any) keep spinning after their work, taking
        the cores from the pool at work (measured: each batch ~2× slower on 2 cores)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._run_batch, batch)

    def _batch_size(self, pending: list[BatchRequest]) -> int:
        """How many of the oldest waiting requests fit one batch: up to ``max_batch_sequences`` rows, at most as many
        distinct adapters as may be resident — counted by version, since one key's two versions (an inflight client's
        requests on both sides of a hand-off) take two slots — and prompt-scoring logits (rows × prompt length ×
        vocabulary) within ``PROMPT_LOGITS_BUDGET``; the first request always goes, whatever its size."""
        count, rows, keys, longest, scoring = 0, 0, set(), 0, False
        for request in pending:
            job = request.job
            new_keys = keys | ({(request.adapter.key, request.adapter.version)} if request.adapter else set())
            new_longest, new_rows = max(longest, len(job.prompt)), rows + job.num_samples
            new_scoring = scoring or job.needs_prompt_scores
            logit_cells = new_rows * new_longest * self._facts.vocab_size if new_scoring else 0
            if count and (new_rows > self.max_batch_sequences or len(new_keys) > self.adapters.capacity
                          or logit_cells > PROMPT_LOGITS_BUDGET):
                break
            count += 1
            rows, keys, longest, scoring = new_rows, new_keys, new_longest, new_scoring
        return count

    # ---- adapters -------------------------------------------------------------------------------------------------
    def _acquire(self, ref: AdapterRef) -> tuple[str, int]:
        """Make ``ref`` resident (loading it if needed, then unloading what the LRU evicts); returns its slot name
        and slot id."""
        slot = self.adapters.acquire(ref)
        name = f"slot_{slot.slot_id}"
        if slot.load:
            try:
                if ref.tensors is not None:  # handed in memory: by the LoRA model's own slot keys, or as PEFT's
                    weights = ref.resolve()
                    # Read in place: the object store's memory on this node, read-only (nothing here writes a LoRA
                    # weight), kept while the adapter is resident; on a GPU the parameters are copies on it.
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)  # torch's warning about read-only arrays
                        if isinstance(weights, PeftTensors):
                            scaling, rank = adapter_scale(weights.config)
                            tensors = self.naming.read({k: torch.from_numpy(t) for k, t in weights.state.items()},
                                                       rank)
                        else:
                            scaling = weights.scaling
                            tensors = {key: (torch.from_numpy(a), torch.from_numpy(b))
                                       for key, (a, b) in weights.pairs.items()}
                    self.model.put(name, tensors, scaling)
                else:
                    state, scaling, rank = read_adapter_file(Path(ref.directory))
                    self.model.put(name, self.naming.read(state, rank), scaling)
            except Exception as exc:  # noqa: BLE001 - any load failure is reported as this request's error
                self.adapters.forget(ref.key, slot.slot_id)
                raise UserError(f"sampler weights {ref.key} could not be loaded: {exc}") from None
            log.info("adapter loaded into sampler: %s (%s)", ref.key, name,
                     extra={"event": "adapter_loaded", "adapter": ref.key, "slot": name})
        self._unload(slot.evicted)
        return name, slot.slot_id

    def _unload(self, slot_ids) -> None:
        for slot_id in slot_ids:
            self.model.remove(f"slot_{slot_id}")
            log.info("adapter evicted from sampler: slot_%d", slot_id,
                     extra={"event": "adapter_evicted", "slot": f"slot_{slot_id}"})

    # ---- generation -----------------------------------------------------------------------------------------------
    def _run_batch(self, requests: list[BatchRequest]) -> list[SampleResult | Exception]:
        """Results in request order; a request whose adapter cannot be loaded, or whose rows fail while decoding
        (``BatchDecoder.generate``), gets its own error, and the others still run."""
        outcomes: list[SampleResult | Exception | None] = [None] * len(requests)
        runnable, names, held = [], [], []
        try:
            for i, request in enumerate(requests):
                ref = request.adapter
                if ref is None:
                    runnable.append(i)
                    names.append(None)
                    continue
                try:
                    name, slot_id = self._acquire(ref)
                except UserError as exc:
                    outcomes[i] = exc
                    continue
                held.append((ref.key, slot_id))
                runnable.append(i)
                names.append(name)
            if runnable:
                order = sorted(range(len(runnable)), key=lambda k: names[k] or "")  # each adapter's rows: one slice
                runnable, names = [runnable[k] for k in order], [names[k] for k in order]
                with torch.inference_mode():
                    results = self._decoder.generate([requests[i] for i in runnable], names)
                for i, result in zip(runnable, results):
                    outcomes[i] = result
        finally:
            for key, slot_id in held:
                self.adapters.release(key, slot_id)
        self.batches += 1
        return outcomes

    def _forward(self, adapter_names: list[str | None], input_ids: torch.Tensor, **kwargs):
        with self.model.router.routing(adapter_names):
            embeds = self.base.get_input_embeddings()(input_ids)
            if self.model.tied:
                embeds = with_tied_input_side(embeds, input_ids, self.model.head)
            return self.base(inputs_embeds=embeds, **kwargs)
