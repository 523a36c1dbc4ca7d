"""The multi-LoRA trainer: one copy of a base model's weights, any number of LoRA adapters trained on it.

Each adapter (one per Tinker training client, keyed by ``model_id``) has its own LoRA weights, its own optimizer state
and its own step count. Gradients accumulate across ``forward_backward`` calls until ``optim_step`` applies them.
LoRA runs through ``adapters.lora.layers`` (rows grouped by adapter); checkpoints are standard PEFT directories
(``adapters.trainer.files``). This class is plain Python so it can be tested in-process; ``adapters.trainer.pool``
runs it as a Ray actor.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from adapters.actors import ray_node
from adapters.lora.files import ATTN_MODULES, MLP_MODULES, UNEMBED_MODULES
from adapters.lora.layers import LoRALinear, Router, with_tied_input_side, wrap_linears
from adapters.trainer.dimuon import Dimuon
from adapters.trainer.files import TrainerFiles
from adapters.trainer.interface import (
    LORA_ALPHA,
    MAX_LORA_RANK,
    AdamHyper,
    DimuonHyper,
    LoraSpec,
    ModelFacts,
    OptimRequest,
    StepRequest,
    StepResult,
    read_lora_spec,
)
from adapters.trainer.optim import TrainerOptim
from shims.custom_loss.run import CustomLossBatch, check_custom_datum
from shims.errors import UserError
from shims.losses import check_datum, datum_loss, resolve_config
from shims.tinker.training_wire import DatumArrays

__all__ = ["LORA_ALPHA", "MAX_LORA_RANK", "AdamHyper", "DimuonHyper", "LoraSpec", "ModelFacts", "MultiLoRATrainer",
           "StepRequest", "StepResult", "read_lora_spec"]

LOGITS_CHUNK_ELEMENTS = 1 << 26
"""At most this many logits (positions × vocabulary) exist at once per datum: 256 MiB in float32, ~440 positions at a
151k vocabulary. Longer datums are scored chunk by chunk, each chunk's logits recomputed in backward instead of kept."""


@dataclass
class _Adapter:
    name: str
    spec: LoraSpec
    params: list[torch.nn.Parameter]
    """A and B of every adapted layer, in the model's layer order (the order optimizer state is saved in)."""
    optimizer: torch.optim.Optimizer
    step: int = 0


class MultiLoRATrainer(TrainerFiles, TrainerOptim):
    """Holds one base model and the LoRA adapters of every training run on it."""

    def __init__(self, location: str, threads: int | None = None, max_adapters: int = 64) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.location = location
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        config = AutoConfig.from_pretrained(location)
        self.base = AutoModelForCausalLM.from_pretrained(location, dtype=dtype).to(self.device)
        self.base.requires_grad_(False)
        self.facts = ModelFacts(
            vocab_size=int(config.vocab_size), max_context=int(getattr(config, "max_position_embeddings", 2048)),
            arch=str((config.architectures or [config.model_type])[0]), device=str(self.device), node=ray_node(),
            pid=os.getpid(), boot=uuid.uuid4().hex,
        )
        self.tied = self.base.get_output_embeddings().weight is self.base.get_input_embeddings().weight
        """One matrix embeds tokens and unembeds them: an unembedding LoRA then acts on both sides."""
        self.router = Router()
        self.layers = wrap_linears(self.base, {*ATTN_MODULES, *MLP_MODULES, *UNEMBED_MODULES}, self.router)
        """Every layer a LoRA may target, by module path; each adapter is on the ones its spec names."""
        self.head: LoRALinear = self.base.get_output_embeddings()
        self.adapters: dict[str, _Adapter] = {}
        self.max_adapters = max_adapters
        self._counter = 0

    # ---- adapters -------------------------------------------------------------------------------------------------
    def model_facts(self) -> ModelFacts:
        return self.facts

    def create(self, model_id: str, spec: LoraSpec) -> None:
        """Add a freshly initialised adapter (LoRA B = 0, so it starts equal to the base model)."""
        spec.validate()
        if model_id in self.adapters:
            raise UserError(f"model {model_id} already exists")
        runs = sum("#" not in key for key in self.adapters)  # '#' marks the trainer's own temporary adapters
        if "#" not in model_id and runs >= self.max_adapters:
            raise UserError(f"this base model's trainer already holds {runs} training runs (--max-adapters "
                            f"{self.max_adapters}); unload one (or save its state and load it later) first")
        self._counter += 1
        name = f"adapter_{self._counter}"
        targets = set(spec.target_modules())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            for path, layer in self.layers.items():
                if path.rsplit(".", 1)[-1] in targets:
                    layer.add(name, spec.rank, LORA_ALPHA / spec.rank)
        params = [p for layer in self.layers.values() if name in layer.scaling
                  for p in (layer.lora_a[name], layer.lora_b[name])]
        if spec.optimizer == "dimuon":
            optimizer: torch.optim.Optimizer = Dimuon(params, spec.rank)
        elif self.device.type == "cuda":  # one kernel for all of a run's tensors
            optimizer = torch.optim.AdamW(params, lr=AdamHyper.learning_rate, fused=True)
        else:
            optimizer = torch.optim.AdamW(params, lr=AdamHyper.learning_rate, foreach=True)
        self.adapters[model_id] = _Adapter(name=name, spec=spec, params=params, optimizer=optimizer)

    def unload(self, model_id: str) -> None:
        """Drop an adapter and its optimizer state; the base model stays loaded for the others."""
        adapter = self._get(model_id)
        for layer in self.layers.values():
            layer.remove(adapter.name)
        del self.adapters[model_id]

    def _get(self, model_id: str) -> _Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise UserError(f"model {model_id} is not loaded on the trainer")
        return adapter

    # ---- training -------------------------------------------------------------------------------------------------
    def forward_backward(self, model_id: str, data: list[DatumArrays], loss_fn: str,
                         loss_fn_config: dict[str, float | str], forward_only: bool) -> StepResult:
        """One request on its own (see ``forward_backward_batch``)."""
        outcome = self.forward_backward_batch([StepRequest(model_id, data, loss_fn, loss_fn_config, forward_only)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def run_batch(self, requests: list[StepRequest | OptimRequest]) -> list[StepResult | dict[str, float] | UserError]:
        """What the trainer pool sends: any runs' optim steps and forward / forward_backward requests, each run at
        most once, in one call (one Ray round trip). The optim steps go first: a run's next forward_backward cannot
        be in the same call as its optim step, so the order between runs changes nothing."""
        outcomes: list = [None] * len(requests)
        for kind, run in ((OptimRequest, self.optim_steps), (StepRequest, self.forward_backward_batch)):
            picked = [i for i, request in enumerate(requests) if isinstance(request, kind)]
            for index, outcome in zip(picked, run([requests[i] for i in picked]), strict=True):
                outcomes[index] = outcome
        return outcomes

    def forward_backward_batch(self, requests: list[StepRequest]) -> list[StepResult | UserError]:
        """Run several requests — of any adapters, ranks and losses on this base model — as one mixed-adapter batch:
        each row goes through its own adapter, each request's loss is computed on its own rows, and one backward adds
        each adapter's gradient to that adapter only, exactly as running it alone would. A request that is invalid,
        or whose loss is not finite, gets its own error and adds nothing; the others still run. ``forward_only``
        requests share the forward and add no gradient."""
        started = time.perf_counter()
        outcomes: list[StepResult | UserError | None] = [None] * len(requests)
        ready: list[tuple[int, StepRequest, _Adapter, dict]] = []
        for index, request in enumerate(requests):
            try:
                adapter = self._get(request.model_id)
                custom = request.custom_loss
                config = resolve_config(request.loss_fn, request.loss_fn_config) if custom is None else {}
                for i, d in enumerate(request.data):
                    if custom is not None:
                        check_custom_datum(custom, i, d.tokens, d.loss_fn_inputs, vocab_size=self.facts.vocab_size,
                                           max_context=self.facts.max_context)
                    else:
                        check_datum(request.loss_fn, i, d.tokens, d.loss_fn_inputs,
                                    vocab_size=self.facts.vocab_size, max_context=self.facts.max_context)
            except UserError as exc:
                outcomes[index] = exc
                continue
            ready.append((index, request, adapter, config))
        if ready:
            ready.sort(key=lambda item: item[2].name)  # each adapter's rows become one slice (adapters.lora.layers)
            self._run_mixed(ready, outcomes, started)
        return outcomes  # type: ignore[return-value]

    def _run_mixed(self, ready: list[tuple[int, StepRequest, _Adapter, dict]],
                   outcomes: list[StepResult | UserError | None], started: float) -> None:
        data = [d for _, request, _, _ in ready for d in request.data]
        names = [adapter.name for _, request, adapter, _ in ready for _ in request.data]
        with torch.set_grad_enabled(not all(request.forward_only for _, request, _, _ in ready)):
            hidden = self._hidden_states(data, names)
            row, trained, learning = 0, [], set()
            for index, request, adapter, config in ready:
                total = torch.zeros((), device=self.device)
                outputs = []
                custom = CustomLossBatch(request.custom_loss) if request.custom_loss is not None else None
                first, row = row, row + len(request.data)
                try:
                    for offset, d in enumerate(request.data):
                        targets = torch.tensor(d.loss_fn_inputs["target_tokens"], device=self.device)
                        target_logprobs = self._target_logprobs(hidden[first + offset, : d.tokens.size],
                                                                adapter.name, targets)
                        inputs = {k: torch.tensor(v, device=self.device) for k, v in d.loss_fn_inputs.items()}
                        total = total + (custom.datum(target_logprobs, inputs) if custom is not None else
                                         datum_loss(request.loss_fn, target_logprobs, inputs, config))
                        outputs.append({"logprobs": target_logprobs.detach().float().cpu().numpy()})
                except UserError as exc:  # a custom loss's own failure: this request's error, not the batch's
                    outcomes[index] = exc
                    continue
                loss = float(total.detach())
                if not math.isfinite(loss):  # before backward: a bad request must not touch accumulated gradients
                    outcomes[index] = UserError(f"the loss is not finite ({loss}); check the loss inputs")
                    continue
                if not request.forward_only and custom is not None and not total.requires_grad:
                    outcomes[index] = UserError(f"custom loss {custom.loss.name!r} does not depend on logprobs, so "
                                                "it has no gradient")
                    continue
                if not request.forward_only:
                    trained.append(total)
                    learning.add(request.model_id)
                metrics = {**(custom.metrics() if custom is not None else {}), "loss:sum": loss}
                outcomes[index] = StepResult(outputs=outputs, metrics=metrics,
                                             num_tokens=int(sum(d.tokens.size for d in request.data)), seconds=0.0)
            if trained:
                # The layers concatenate every adapter's rows, so autograd also reaches the adapters only being read
                # here, with exact zeros; their gradient state must stay as it was (None stays None).
                reading = [p for _, request, adapter, _ in ready if request.model_id not in learning
                           for p in adapter.params if p.grad is None]
                torch.stack(trained).sum().backward()
                for p in reading:
                    p.grad = None
        seconds = time.perf_counter() - started
        for index, _, _, _ in ready:
            if isinstance(outcomes[index], StepResult):
                outcomes[index].seconds = seconds

    def _hidden_states(self, data: list[DatumArrays], names: list[str] | None) -> torch.Tensor:
        """Final hidden states of a right-padded batch, row ``i`` through adapter ``names[i]`` (None: the base
        model); padded positions are masked out and never read."""
        longest = max(d.tokens.size for d in data)
        ids = torch.zeros((len(data), longest), dtype=torch.long)
        mask = torch.zeros((len(data), longest), dtype=torch.long)
        for i, d in enumerate(data):
            ids[i, : d.tokens.size] = torch.tensor(d.tokens)
            mask[i, : d.tokens.size] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with self.router.routing(names):
            embeds = self.base.get_input_embeddings()(ids)
            if self.tied:
                embeds = with_tied_input_side(embeds, ids, self.head)
            return self.base.get_decoder()(inputs_embeds=embeds, attention_mask=mask).last_hidden_state

    def _target_logprobs(self, hidden: torch.Tensor, name: str | None, targets: torch.Tensor) -> torch.Tensor:
        """Logprobs of ``targets`` (one per position, or ``[positions, k]``) from one datum's final hidden states,
        through ``name``'s output head, computed over at most ``LOGITS_CHUNK_ELEMENTS`` logits at a time."""
        n = hidden.shape[0]
        flat = targets.reshape(n, -1)
        head = self.head

        def score(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(head.with_adapter(h, name).float(), dim=-1).gather(1, t)

        size = max(1, LOGITS_CHUNK_ELEMENTS // self.facts.vocab_size)
        if n <= size:
            return score(hidden, flat).reshape(targets.shape)
        recompute = torch.is_grad_enabled()
        chunks = [torch.utils.checkpoint.checkpoint(score, hidden[i:i + size], flat[i:i + size], use_reentrant=False)
                  if recompute else score(hidden[i:i + size], flat[i:i + size]) for i in range(0, n, size)]
        return torch.cat(chunks).reshape(targets.shape)

    def score(self, directory: str | None, tokens: list[int]) -> list[float]:
        """Logprobs of ``tokens[1:]`` under the base model plus the adapter saved in ``directory`` (None: the base
        model alone), computed exactly as ``forward`` computes them. Samplers' reported logprobs are checked against
        this to measure rollout-vs-train drift; the adapters being trained are not touched."""
        probe = "#logprob-probe"
        name = None
        if directory is not None:
            self.load_state(probe, directory, with_optimizer=False)
            name = self.adapters[probe].name
        try:
            with torch.no_grad():
                hidden = self._hidden_states([DatumArrays(tokens=np.asarray(tokens[:-1], dtype=np.int64))],
                                             None if name is None else [name])
                targets = torch.tensor(tokens[1:], device=self.device)
                return self._target_logprobs(hidden[0], name, targets).cpu().tolist()
        finally:
            if directory is not None:
                self.unload(probe)
