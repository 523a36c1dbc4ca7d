"""The multi-LoRA trainer: one copy of a base model's weights, any number of LoRA adapters trained on it.

Each adapter (one per Tinker training client, keyed by ``model_id``) has its own LoRA weights, its own AdamW state
and its own step count. Gradients accumulate across ``forward_backward`` calls until ``optim_step`` applies them.
This class is plain Python so it can be tested in-process; ``adapters.trainer_pool`` runs it as a Ray actor.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from adapters import adapter_files
from adapters.actors import ray_node
from adapters.adapter_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ATTN_MODULES,
    HOSTED_UNEMBED,
    MLP_MODULES,
    OPTIMIZER_STATE,
    TRAINER_STATE,
    UNEMBED_MODULES,
)
from adapters.dimuon import Dimuon
from adapters.disk import writing
from shims.custom_loss_graph import CustomLoss
from shims.custom_loss_run import CustomLossBatch, check_custom_datum
from shims.errors import UserError
from shims.losses import check_datum, datum_loss, resolve_config
from shims.training_wire import DatumArrays

LORA_ALPHA = 32
"""Fixed LoRA alpha, independent of rank (scale alpha/rank), so a learning rate carries across ranks as in Tinker."""

MAX_LORA_RANK = 512
"""The largest rank the trainer itself takes (vLLM's largest); the server's ``--max-lora-rank`` is usually lower."""


@dataclass(frozen=True)
class LoraSpec:
    """What a Tinker ``LoraConfig`` asks for, with the seed made concrete."""

    rank: int
    seed: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    optimizer: str = "adamw"
    """The optimizer family chosen at creation (``optimizer_config``): ``adamw`` or ``dimuon``."""

    def target_modules(self) -> list[str]:
        return ((ATTN_MODULES if self.train_attn else []) + (MLP_MODULES if self.train_mlp else [])
                + (UNEMBED_MODULES if self.train_unembed else []))

    def validate(self) -> None:
        if not 1 <= self.rank <= MAX_LORA_RANK:
            raise UserError(f"LoRA rank must be between 1 and {MAX_LORA_RANK}, got {self.rank}")
        if not self.target_modules():
            raise UserError("at least one of train_mlp, train_attn, train_unembed must be true")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"optimizer {self.optimizer!r} is not supported; use one of {', '.join(OPTIMIZERS)}")


@dataclass(frozen=True)
class AdamHyper:
    """Tinker's ``AdamParams``; they may change on every optim_step."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def validate(self) -> None:
        for name, value in asdict(self).items():
            if not math.isfinite(value) or value < 0:
                raise UserError(f"adam_params.{name} must be a finite number ≥ 0, got {value}")
        if self.eps <= 0:
            raise UserError(f"adam_params.eps must be > 0 (0 divides by zero on untouched weights), got {self.eps}")
        if self.beta1 >= 1 or self.beta2 >= 1:
            raise UserError(f"adam_params beta1 and beta2 must be < 1, got {self.beta1}, {self.beta2}")


@dataclass(frozen=True)
class DimuonHyper:
    """Tinker's ``DimuonParams`` (``adapters/dimuon.py``); they may change on every optim_step."""

    learning_rate: float
    beta1: float = 0.9
    grad_clip_norm: float = 0.0

    def validate(self) -> None:
        if not all(math.isfinite(v) for v in asdict(self).values()):
            raise UserError(f"dimuon params must be finite numbers, got {asdict(self)}")
        if self.learning_rate < 0 or not 0 <= self.beta1 < 1:
            raise UserError(f"dimuon params need learning_rate ≥ 0 and 0 ≤ beta1 < 1, got {self.learning_rate}, "
                            f"{self.beta1}")


OPTIMIZERS = {"adamw": AdamHyper, "dimuon": DimuonHyper}
"""Optimizer family → the per-step parameters it takes."""


@dataclass(frozen=True)
class ModelFacts:
    """What the server needs to know about a loaded base model to validate requests and answer get_info."""

    vocab_size: int
    max_context: int
    arch: str
    device: str
    node: str = ""
    """The Ray node the trainer runs on."""
    pid: int = 0
    boot: str = ""
    """Differs every time the trainer process starts: a changed value means it was restarted and holds no adapters."""


@dataclass
class StepRequest:
    """One forward / forward_backward call, as the trainer receives it (possibly batched with others)."""

    model_id: str
    data: list[DatumArrays]
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    custom_loss: CustomLoss | None = None
    """For ``loss_fn="custom"``: the stored loss the request's ``loss_id`` names (``shims.custom_loss_graph``)."""


@dataclass
class StepResult:
    """The outcome of one forward / forward_backward call."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]
    num_tokens: int
    seconds: float


@dataclass
class _Adapter:
    name: str
    spec: LoraSpec
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    step: int = 0


class MultiLoRATrainer:
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
        """One matrix embeds tokens and unembeds them: an unembedding LoRA then acts on both sides (``_embed``)."""
        self.peft = None
        self.adapters: dict[str, _Adapter] = {}
        self.max_adapters = max_adapters
        self._counter = 0

    # ---- adapters -------------------------------------------------------------------------------------------------
    def model_facts(self) -> ModelFacts:
        return self.facts

    def create(self, model_id: str, spec: LoraSpec) -> None:
        """Add a freshly initialised adapter (LoRA B = 0, so it starts equal to the base model)."""
        from peft import LoraConfig, get_peft_model

        spec.validate()
        if model_id in self.adapters:
            raise UserError(f"model {model_id} already exists")
        runs = sum("#" not in key for key in self.adapters)  # '#' marks the trainer's own temporary adapters
        if "#" not in model_id and runs >= self.max_adapters:
            raise UserError(f"this base model's trainer already holds {runs} training runs (--max-adapters "
                            f"{self.max_adapters}); unload one (or save its state and load it later) first")
        self._counter += 1
        name = f"adapter_{self._counter}"
        config = LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none",
                            target_modules=spec.target_modules(), base_model_name_or_path=self.location)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        params = [p for n, p in self.peft.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        optimizer = Dimuon(params, spec.rank) if spec.optimizer == "dimuon" else \
            torch.optim.AdamW(params, lr=AdamHyper.learning_rate, foreach=False)
        self.adapters[model_id] = _Adapter(name=name, spec=spec, params=params, optimizer=optimizer)

    def unload(self, model_id: str) -> None:
        """Drop an adapter and its optimizer state; the base model stays loaded for the others."""
        adapter = self._get(model_id)
        self.peft.delete_adapter(adapter.name)
        del self.adapters[model_id]

    def _get(self, model_id: str) -> _Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise UserError(f"model {model_id} is not loaded on the trainer")
        return adapter

    def _model(self) -> torch.nn.Module:
        """The transformers model, with LoRA layers in it once any adapter exists."""
        return self.peft.base_model.model if self.peft is not None else self.base

    def _activate(self, adapter: _Adapter) -> None:
        self.peft.base_model.set_adapter(adapter.name)
        for p in adapter.params:  # set_adapter toggles requires_grad; keep ours trainable
            p.requires_grad_(True)

    # ---- training -------------------------------------------------------------------------------------------------
    def forward_backward(self, model_id: str, data: list[DatumArrays], loss_fn: str,
                         loss_fn_config: dict[str, float | str], forward_only: bool) -> StepResult:
        """One request on its own (see ``forward_backward_batch``)."""
        outcome = self.forward_backward_batch([StepRequest(model_id, data, loss_fn, loss_fn_config, forward_only)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def forward_backward_batch(self, requests: list[StepRequest]) -> list[StepResult | UserError]:
        """Run several requests — of any adapters, ranks and losses on this base model — as one mixed-adapter batch:
        each row goes through its own adapter (PEFT's per-row adapter routing), each request's loss is computed on
        its own rows, and one backward adds each adapter's gradient to that adapter only, exactly as running it
        alone would. A request that is invalid, or whose loss is not finite, gets its own error and adds nothing;
        the others still run. ``forward_only`` requests share the forward and add no gradient."""
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
            self._run_mixed(ready, outcomes, started)
        return outcomes  # type: ignore[return-value]

    def _run_mixed(self, ready: list[tuple[int, StepRequest, _Adapter, dict]],
                   outcomes: list[StepResult | UserError | None], started: float) -> None:
        data = [d for _, request, _, _ in ready for d in request.data]
        names = [adapter.name for _, request, adapter, _ in ready for _ in request.data]
        for _, _, adapter, _ in ready:
            for p in adapter.params:  # set_adapter (used by score) may have switched them off
                p.requires_grad_(True)
        # PEFT routes rows to adapters only in eval mode; nothing here has dropout (lora_dropout=0), so the numbers
        # are those of train mode. The decoder and the LM head are called separately so that full-vocabulary
        # logits exist for one datum at a time, never for the whole batch.
        self.peft.eval()
        routed = self.peft.base_model._enable_peft_forward_hooks  # per-row adapters (PEFT 0.21, pinned)
        lm_head = self._model().get_output_embeddings()
        with torch.set_grad_enabled(not all(request.forward_only for _, request, _, _ in ready)):
            with routed(adapter_names=names):
                hidden = self._hidden_states(data, names)
            row, trained, learning = 0, [], set()
            for index, request, adapter, config in ready:
                total = torch.zeros((), device=self.device)
                outputs = []
                custom = CustomLossBatch(request.custom_loss) if request.custom_loss is not None else None
                first, row = row, row + len(request.data)
                try:
                    for offset, d in enumerate(request.data):
                        n = d.tokens.size
                        with routed(adapter_names=[adapter.name]):
                            logits = lm_head(hidden[first + offset:first + offset + 1, :n])[0]
                        logprobs = torch.log_softmax(logits.float(), dim=-1)
                        targets = torch.tensor(d.loss_fn_inputs["target_tokens"], device=self.device)
                        target_logprobs = logprobs.gather(1, targets.reshape(n, -1)).reshape(targets.shape)
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
                # Rows share tensors inside PEFT's routing, so autograd also reaches the adapters that are only being
                # read here, with exact zeros; their gradient state must stay as it was (None stays None).
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
        embeds = self._embed(ids.to(self.device), names)
        return self._model().get_decoder()(inputs_embeds=embeds, attention_mask=mask.to(self.device)).last_hidden_state

    def _embed(self, ids: torch.Tensor, names: list[str] | None) -> torch.Tensor:
        """Input embeddings. On a tied model the unembedding LoRA changes the shared matrix, so a row whose adapter
        has one also gets its delta here: row ``t`` of scale·B·A is scale·B[t]·A, from the same parameters the head
        uses (one gradient for the one matrix, as training it tied means)."""
        embeds = self._model().get_input_embeddings()(ids)
        head = self._model().get_output_embeddings()
        if not self.tied or names is None or not hasattr(head, "lora_A"):
            return embeds
        for name in dict.fromkeys(names):
            if name not in head.lora_A:
                continue
            rows = torch.tensor([i for i, n in enumerate(names) if n == name], device=ids.device)
            delta = torch.nn.functional.embedding(ids[rows], head.lora_B[name].weight) @ head.lora_A[name].weight
            embeds = embeds.index_add(0, rows, delta * head.scaling[name])
        return embeds

    def score(self, directory: str | None, tokens: list[int]) -> list[float]:
        """Logprobs of ``tokens[1:]`` under the base model plus the adapter saved in ``directory`` (None: the base
        model alone), computed exactly as ``forward`` computes them. Samplers' reported logprobs are checked against
        this to measure rollout-vs-train drift; the adapters being trained are not touched."""
        probe = "#logprob-probe"
        names = None
        if directory is not None:
            self.load_state(probe, directory, with_optimizer=False)
            self._activate(self.adapters[probe])
            names = [self.adapters[probe].name]
        base_only = self.peft.disable_adapter() if directory is None and self.peft is not None else nullcontext()
        try:
            with torch.no_grad(), base_only:
                hidden = self._hidden_states([DatumArrays(tokens=np.asarray(tokens[:-1], dtype=np.int64))], names)
                logprobs = torch.log_softmax(self._model().get_output_embeddings()(hidden[0]).float(), dim=-1)
                targets = torch.tensor(tokens[1:], device=self.device).unsqueeze(1)
                return logprobs.gather(1, targets).squeeze(1).cpu().tolist()
        finally:
            if directory is not None:
                self.unload(probe)

    def optim_step(self, model_id: str, hyper: AdamHyper | DimuonHyper) -> dict[str, float]:
        """Apply the accumulated gradient with the run's optimizer (AdamW with decoupled weight decay, or Dimuon),
        then clear it."""
        hyper.validate()
        adapter = self._get(model_id)
        if not isinstance(hyper, OPTIMIZERS[adapter.spec.optimizer]):
            raise UserError(f"this training run uses the {adapter.spec.optimizer} optimizer (chosen when it was "
                            f"created): send {'AdamParams' if adapter.spec.optimizer == 'adamw' else 'DimuonParams'}")
        grads = [p for p in adapter.params if p.grad is not None]
        grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in grads])) if grads else 0.0
        if not math.isfinite(grad_norm):
            adapter.optimizer.zero_grad(set_to_none=True)
            raise UserError(f"the accumulated gradient is not finite (norm {grad_norm}); it was discarded and the "
                            "weights were not changed")
        if hyper.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(grads, hyper.grad_clip_norm,
                                                 torch.tensor(grad_norm, device=grads[0].device))
        for group in adapter.optimizer.param_groups:
            if isinstance(hyper, AdamHyper):
                group.update(lr=hyper.learning_rate, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                             weight_decay=hyper.weight_decay)
            else:
                group.update(lr=hyper.learning_rate, beta1=hyper.beta1)
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.step += 1
        return {"grad_norm": grad_norm, "learning_rate": hyper.learning_rate, "step": float(adapter.step)}

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def save_for_sampler(self, model_id: str, directory: str) -> None:
        """Write the adapter as a standard PEFT directory (adapter_config.json + adapter_model.safetensors) that any
        PEFT loader turns into the trained model (``adapters.adapter_files``: the stored naming)."""
        self._write_adapter(model_id, Path(directory), export=False)

    def save_for_export(self, model_id: str, directory: str) -> None:
        """Write the adapter for download, named as hosted Tinker names it (``adapters.adapter_files``)."""
        self._write_adapter(model_id, Path(directory), export=True)

    def _write_adapter(self, model_id: str, out: Path, export: bool) -> None:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        adapter = self._get(model_id)
        state = {k: v.detach().cpu() for k, v in
                 get_peft_model_state_dict(self.peft, adapter_name=adapter.name, save_embedding_layers=False).items()}
        if export:
            state = adapter_files.exported(state)
        elif self.tied:
            state = adapter_files.with_tied_input_side(state)
        config = self.peft.peft_config[adapter.name]
        modules = adapter_files.target_modules(sorted(config.target_modules), tied=self.tied, export=export)
        with writing(out):
            out.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS))
            replace(config, target_modules=modules).save_pretrained(str(out))

    def save_state(self, model_id: str, directory: str) -> None:
        """Write the adapter, its optimizer state and step, so training can resume exactly."""
        adapter = self._get(model_id)
        self.save_for_sampler(model_id, directory)
        with writing(Path(directory)):
            torch.save(adapter.optimizer.state_dict(), Path(directory) / OPTIMIZER_STATE)
            (Path(directory) / TRAINER_STATE).write_text(json.dumps({"step": adapter.step,
                                                                     "lora": asdict(adapter.spec)}))

    def load_state(self, model_id: str, directory: str, with_optimizer: bool) -> LoraSpec:
        """Replace (or create) ``model_id``'s adapter with the checkpoint's weights, and optionally its optimizer.

        Without the optimizer the adapter gets fresh AdamW moments, as Tinker's ``load_state`` does.
        """
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        src = Path(directory)
        spec = read_lora_spec(src)
        if not with_optimizer and model_id in self.adapters:  # weights only: the run keeps its optimizer family
            spec = replace(spec, optimizer=self.adapters[model_id].spec.optimizer)
        if with_optimizer and not (src / OPTIMIZER_STATE).exists():
            raise UserError("this checkpoint has no optimizer state (sampler weights); load it without the optimizer")
        staging_id = f"{model_id}#loading"  # built beside the current adapter, swapped in only once complete
        self.create(staging_id, spec)
        staged = self.adapters[staging_id]
        try:
            result = set_peft_model_state_dict(self.peft, adapter_files.for_loading(load_file(str(src / ADAPTER_WEIGHTS))),
                                               adapter_name=staged.name)
            missing = [k for k in result.missing_keys if f".{staged.name}." in k]
            if missing:
                raise UserError(f"checkpoint is missing {len(missing)} adapter tensors, e.g. {missing[0]}")
            if with_optimizer:
                staged.optimizer.load_state_dict(torch.load(src / OPTIMIZER_STATE, map_location=self.device))
                staged.step = int(json.loads((src / TRAINER_STATE).read_text())["step"])
        except UserError:
            self.unload(staging_id)
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a bad checkpoint raises, it is the caller's to fix
            self.unload(staging_id)
            raise UserError(f"checkpoint {src.name} could not be loaded: {exc}") from None
        if model_id in self.adapters:
            self.unload(model_id)
        self.adapters[model_id] = self.adapters.pop(staging_id)
        return spec


def read_lora_spec(directory: Path) -> LoraSpec:
    """The LoRA layout of a saved adapter: from our trainer state if present, else from its PEFT config."""
    state_file = directory / TRAINER_STATE
    if state_file.exists():
        return LoraSpec(**json.loads(state_file.read_text())["lora"])
    if not (directory / ADAPTER_CONFIG).exists():
        encrypted = (directory / f"{ADAPTER_CONFIG}.age").exists()
        raise UserError("this checkpoint is an age-encrypted export: only its recipients can read it, so it cannot be "
                        "inspected or loaded here" if encrypted else "this checkpoint holds no adapter configuration")
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    modules = set(config["target_modules"])
    return LoraSpec(rank=int(config["r"]), seed=0, train_attn=bool(modules & set(ATTN_MODULES)),
                    train_mlp=bool(modules & set(MLP_MODULES)),
                    train_unembed=bool(modules & {*UNEMBED_MODULES, HOSTED_UNEMBED}))
