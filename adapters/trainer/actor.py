"""The multi-LoRA trainer: one copy of a base model's weights, any number of LoRA adapters trained on it.

Each adapter (one per Tinker training client, keyed by ``model_id``) has its own LoRA weights, its own optimizer state
and its own step count. Gradients accumulate across ``forward_backward`` calls until ``optim_step`` applies them.
LoRA runs through ``adapters.lora`` (rows grouped by adapter: ``adapters.lora.routing``); checkpoints are standard
PEFT directories (``adapters.trainer.files``). This class is plain Python so it can be tested in-process;
``adapters.trainer.group`` runs it as a Ray actor, or as N of them, each one shard of a trainer whose base model is
split over N devices (``adapters.trainer.shards``): the same methods, called on every shard, rank 0 answering.

It implements ``adapters.trainer.interface.Trainer``, the Protocol the server calls it by (checked when its actor
starts: ``adapters.boundary``); its other public methods are for in-process callers (tests, benchmarks). The work is
done by parts it holds: the model's passes (``.passes``), and, each knowing only those and the adapter table
(``adapters.trainer.table``), the mixed-adapter forward pass (``.forward``), the checkpoint files (``.files``) and the
optimizer steps (``.optim``).
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from adapters.actors import ray_node
from adapters.cpu_memory import keep_freed
from adapters.cpu_threads import PassThreads, set_torch_threads
from adapters.lora.model import LoRAModel
from adapters.models.resolve import is_vision_language, text_settings
from adapters.samplers.interface import AdapterTensors, PeftTensors, fetched
from adapters.trainer.files import CheckpointFiles
from adapters.trainer.forward import MixedForward
from adapters.trainer.interface import (
    LORA_ALPHA,
    MAX_LORA_RANK,
    AdamHyper,
    DimuonHyper,
    LoraSpec,
    ModelFacts,
    OptimRequest,
    ShardSpec,
    StepOutcome,
    StepRequest,
    StepResult,
    read_lora_spec,
)
from adapters.trainer.memory import ActivationBudget, kept_per_token
from adapters.trainer.optim import Optimizers
from adapters.trainer.options import TrainerOptions
from adapters.trainer.parallelize import apply_activation_checkpointing, apply_expert_parallel, apply_fsdp
from adapters.trainer.passes import ModelPasses
from adapters.trainer.shards import Shards, load_base, local_device, resident_bytes
from adapters.trainer.table import AdapterTable
from shims.errors import UserError
from shims.tinker.training_wire import DatumArrays

T = TypeVar("T")

PROBE_RANK = 32
"""The rank of the temporary adapter the trainer measures its activations through (``_checkpointing``): a LoRA keeps
its ``x·Aᵀ`` per adapted layer, small beside the layer's own activations at any usual rank."""

__all__ = ["LORA_ALPHA", "MAX_LORA_RANK", "AdamHyper", "DimuonHyper", "LoraSpec", "ModelFacts", "MultiLoRATrainer",
           "StepRequest", "StepResult", "read_lora_spec"]


class MultiLoRATrainer:
    """Holds one base model and the LoRA adapters of every training run on it."""

    def __init__(self, location: str, options: TrainerOptions = TrainerOptions(),  # noqa: B008 - frozen
                 shard: ShardSpec | None = None) -> None:
        """``options``: what this trainer computes with and holds: ``threads``, torch threads (None: this machine's
        usable CPUs, shared with this trainer's other shards here; ``adapters.cpu_threads``); ``max_adapters``, the
        runs it holds at once; ``activation_checkpointing_tokens``, training batches of at least this many tokens
        checkpoint each decoder layer (``adapters.trainer.recompute``; 0: never); ``activation_memory_mib``, the
        most memory a pass counts on (``adapters.trainer.memory``). ``shard``: this process's place in a sharded
        trainer (``adapters.trainer.shards``; None: the whole model here)."""
        from transformers import AutoConfig

        self.device = local_device()
        if self.device.type == "cpu":
            keep_freed()  # the passes' large tensors reuse memory rather than fault it in again (adapters.cpu_memory)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        config = AutoConfig.from_pretrained(location)
        text = text_settings(config)  # a vision-language checkpoint trains and serves as its text model
        self.shards = Shards(shard, self.device)
        threads = set_torch_threads(options.threads, self.shards.peers_here())
        base = load_base(location, dtype, self.shards)
        base.requires_grad_(False)
        # Parallelism, applied here alone (``adapters.trainer.parallelize``): FSDP2 for a sharded trainer's base
        # weights, its MoE layers' experts split over the shards, layers that may recompute their activations.
        apply_fsdp(base, self.shards)
        self.model = LoRAModel(base)
        """The base model with every weight matrix a LoRA adapts wrapped (``adapters.lora.targets``)."""
        experts = apply_expert_parallel(self.model, self.shards)
        recompute = apply_activation_checkpointing(self.model, options.activation_checkpointing_tokens)
        self.facts = ModelFacts(
            vocab_size=text.vocab_size, max_context=text.max_context,
            arch=str((config.architectures or [config.model_type])[0]), device=str(self.device), node=ray_node(),
            pid=os.getpid(), boot=uuid.uuid4().hex, lora_targets=self.model.describe(),
            shard=self.shards.rank, shards=self.shards.world, backend=self.shards.backend,
            base_bytes=resident_bytes(base), threads=torch.get_num_threads(), experts=experts or "",
        )
        self.adapters = AdapterTable(self.model, self.device, options.max_adapters,
                                     self.shards.mine if self.shards.world > 1 else None)
        """The training runs, by ``model_id``."""
        self.passes = ModelPasses(self.model, text.vocab_size, self.shards, recompute)
        self.threads = PassThreads(threads, _largest_weight(self.passes.recompute.layers[0]),
                                   fixed=options.threads is not None or self.device.type != "cpu")
        """Torch threads per pass (``adapters.cpu_threads``): a pass too small to split runs on one."""
        self.forward_pass = MixedForward(self.passes, self.adapters, self.facts)
        self.files = CheckpointFiles(self.adapters, location, self.model.naming(is_vision_language(config)),
                                     self.shards)
        self.facts = replace(self.facts, lora_file_bound=self.files.naming.file_bound())
        self.optimizers = Optimizers(self.adapters, self.shards)
        self.facts = replace(self.facts, checkpointing=self._checkpointing(options))

    def _checkpointing(self, options: TrainerOptions) -> str:
        """Measure what this model keeps per token (``adapters.trainer.memory``), through a temporary adapter of
        rank ``PROBE_RANK`` (every shard of a sharded trainer runs the same probe passes, so their collectives
        match): it decides which passes fit at all, and by default which checkpoint their layers. Returns the
        decision in words."""
        probe = self.adapters.temporary(LoraSpec(rank=PROBE_RANK, seed=0))
        min_tokens = self.passes.recompute.min_tokens
        self.passes.recompute.min_tokens = None  # the probe keeps every activation (no budget yet: none checkpoint)
        try:
            per_token = kept_per_token(lambda tokens: self.passes.hidden(
                [DatumArrays(tokens=np.arange(tokens, dtype=np.int64) % self.facts.vocab_size)], [probe.name]))
        finally:
            self.passes.recompute.min_tokens = min_tokens
            self.adapters.discard(probe)
        embeddings = self.model.base.get_input_embeddings()
        layer_input = embeddings.embedding_dim * embeddings.weight.element_size()
        cap = options.activation_memory_mib
        budget = ActivationBudget(per_token, layer_input, len(self.passes.recompute.layers), self.device,
                                  cap=None if cap is None else cap * 2**20)
        self.passes.recompute.budget = budget
        if min_tokens is not None:
            return f"passes of at least {min_tokens} tokens" if min_tokens else "never"
        return (f"passes whose activations ({per_token / 1024:.0f} KiB per token) would take over a third of the "
                f"free memory, now over {budget.tokens_now()} tokens")

    # ---- adapters -------------------------------------------------------------------------------------------------
    def model_facts(self) -> ModelFacts:
        """Who this trainer (or shard) is, and what it holds and runs with now: its base model's bytes, its runs
        and the bytes of their adapter state, and the threads torch runs its passes with (read back from torch when it started; a pass too small to split runs on
        one, ``PassThreads``)."""
        return replace(self.facts, base_bytes=resident_bytes(self.model.base), threads=self.threads.most,
                       runs=len(self.adapters), adapter_bytes=self.adapters.state_bytes())

    def create(self, model_id: str, spec: LoraSpec) -> None:
        """Add a freshly initialised adapter (LoRA B = 0, so it starts equal to the base model)."""
        self.adapters.create(model_id, spec)

    def unload(self, model_id: str) -> None:
        """Drop an adapter and its optimizer state; the base model stays loaded for the others."""
        self.adapters.unload(model_id)

    # ---- training -------------------------------------------------------------------------------------------------
    def forward_backward(self, model_id: str, data: list[DatumArrays], loss_fn: str,
                         loss_fn_config: dict[str, float | str], forward_only: bool) -> StepResult:
        """One request on its own (see ``forward_backward_batch``)."""
        outcome = self.forward_backward_batch([StepRequest(model_id, data, loss_fn, loss_fn_config, forward_only)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def run_batch(self, requests: list[StepRequest | OptimRequest]) -> list[StepOutcome]:
        """What the trainer pool sends: any runs' optim steps and forward / forward_backward requests, each run at
        most once, in one call (one Ray round trip). The optim steps go first: a run's next forward_backward cannot
        be in the same call as its optim step, so the order between runs changes nothing. Each request gets its own
        outcome, as it happened: an optim step that was applied is reported applied whatever the forward passes
        beside it do."""
        outcomes: list = [None] * len(requests)
        for kind, run in ((OptimRequest, self.optim_steps), (StepRequest, self.forward_backward_batch)):
            picked = [i for i, request in enumerate(requests) if isinstance(request, kind)]
            if not picked:
                continue
            try:
                results = run([requests[i] for i in picked])
            except Exception as exc:  # noqa: BLE001 - the other kind's outcomes stand: the optim steps were applied
                results = [RuntimeError(f"{type(exc).__name__}: {exc}")] * len(picked)
            for index, outcome in zip(picked, results, strict=True):
                outcomes[index] = outcome
        return outcomes

    def forward_backward_batch(self, requests: list[StepRequest]) -> list[StepResult | UserError]:
        """Run several requests — of any adapters, ranks and losses on this base model — as one mixed-adapter batch;
        each request gets its result or its own error (``adapters.trainer.forward``)."""
        self.threads.set_for(sum(d.tokens.size for request in requests for d in request.data))
        return self.forward_pass.run(requests)

    def optim_step(self, model_id: str, hyper: AdamHyper | DimuonHyper) -> dict[str, float]:
        """Apply the accumulated gradient with the run's optimizer (AdamW with decoupled weight decay, or Dimuon),
        then clear it."""
        return self.optimizers.optim_step(model_id, hyper)

    def optim_steps(self, requests: list[OptimRequest]) -> list[dict[str, float] | UserError]:
        """Several runs' optim steps (each run at most once); one outcome per request, in order (``.optim``)."""
        return self.optimizers.optim_steps(requests)

    def score(self, weights: str | AdapterTensors | PeftTensors | None, tokens: list[int]) -> list[float]:
        """Logprobs of ``tokens[1:]`` under the base model plus the adapter saved in the directory ``weights`` or
        handed in memory (None: the base model alone), computed exactly as ``forward`` computes them. Samplers'
        reported logprobs are checked against this to measure rollout-vs-train drift; the adapters being trained are
        not touched: the saved one is loaded as a temporary adapter, in no run's slot."""
        probe = None
        if isinstance(weights, tuple):  # a sharded trainer's parts, each where its shard put it
            weights = fetched(weights)
        if isinstance(weights, AdapterTensors | PeftTensors):
            probe = self._read_on_every_shard(lambda: self.files.staged_tensors(weights))
        elif weights is not None:
            directory = Path(weights)
            probe = self._read_on_every_shard(
                lambda: self.files.staged(directory, read_lora_spec(directory), with_optimizer=False))
        try:
            self.threads.set_for(len(tokens))
            datum = DatumArrays(tokens=np.asarray(tokens[:-1], dtype=np.int64)) if self.shards.writes else None
            return self.passes.score(datum, None if probe is None else probe.name, tokens[1:])
        finally:
            if probe is not None:
                self.adapters.discard(probe)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    # Every shard takes part in a save: what is split over them (a MoE adapter's experts, a training checkpoint's
    # optimizer state) is gathered on rank 0, which writes the files (``adapters.trainer.files``).
    def save_for_sampler(self, model_id: str, directory: str) -> None:
        """Write the adapter as a standard PEFT directory any PEFT loader reads (``adapters.trainer.files``)."""
        self.files.save_for_sampler(model_id, directory)

    def sampler_tensors(self, model_id: str, peft: bool = False) -> tuple[int, AdapterTensors | PeftTensors]:
        """This shard's part of the adapter as samplers load it from memory (``adapters.trainer.files``; ``peft``:
        as a PEFT directory's contents), after the whole adapter's bytes (the parts' sum, every shard's)."""
        part = self.files.sampler_tensors(model_id, peft)
        return sum(self.shards.everywhere(part.nbytes)), part

    def save_for_export(self, model_id: str, directory: str) -> None:
        """Write the adapter for download, named as hosted Tinker names it."""
        self.files.save_for_export(model_id, directory)

    def save_state(self, model_id: str, directory: str) -> None:
        """Write the adapter, its optimizer state and step, so training can resume exactly."""
        self.files.save_state(model_id, directory)

    def import_adapter(self, source: str, spec: LoraSpec, directory: str) -> None:
        """Check an adapter made elsewhere (an upload) against this model and ``spec``, and write it for samplers
        (``adapters.trainer.files``); no run is touched."""
        self.files.import_adapter(Path(source), spec, Path(directory))

    def load_state(self, model_id: str, directory: str, with_optimizer: bool) -> LoraSpec:
        """Replace (or create) ``model_id``'s adapter with the checkpoint's weights, and optionally its optimizer
        (without it, fresh AdamW moments, as Tinker's ``load_state`` does). Returns the layout loaded."""
        staged, spec = self._read_on_every_shard(lambda: self.files.stage_state(model_id, directory, with_optimizer))
        self.adapters.install(model_id, staged)
        return spec

    def _read_on_every_shard(self, read: Callable[[], T]) -> T:
        """``read()`` (staging an adapter from a checkpoint's files), and whether every shard could: a shard that
        cannot read it (another node that does not see the file, or a file deleted between two shards' reads) fails
        the call on every shard alike, before any of them changes a run or starts a pass the others must join."""
        try:
            value, error = read(), None
        except Exception as exc:  # noqa: BLE001 - said to every shard, then raised as the caller's error
            value, error = None, exc if isinstance(exc, UserError) else UserError(f"the checkpoint could not be "
                                                                                  f"read: {exc}")
        if self.shards.agreed(error is None):
            return value
        staged = value[0] if isinstance(value, tuple) else value
        if staged is not None:
            self.adapters.discard(staged)
        raise error or UserError("the checkpoint could not be read by every trainer shard; on a Ray cluster, "
                                 "--storage-dir must be one filesystem every node sees")


def _largest_weight(layer: torch.nn.Module) -> int:
    """Elements of a decoder layer's largest weight matrix: the multiply-adds per token of its largest matmul (a
    mixture-of-experts layer's 3-D expert weights count one expert's matrix)."""
    return max((math.prod(p.shape[-2:]) for p in layer.parameters() if p.dim() >= 2), default=1)  # global shapes
