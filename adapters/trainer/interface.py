"""The trainer as its callers know it: ``Trainer``, the Protocol of one base model's trainer, and what crosses it —
LoRA layouts, optimizer parameters, requests, results — and the LoRA layout of a saved adapter. No torch here: the
server process imports these without loading the model code, which only the trainer's actors import
(``TRAINER_CLASS``, built there by ``adapters.boundary.actor_class``)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from adapters.boundary import by_reference, on_rank_zero
from adapters.lora.layout import ADAPTER_CONFIG, TRAINER_STATE
from adapters.samplers.interface import AdapterTensors, PeftTensors
from shims.custom_loss.graph import CustomLoss
from shims.errors import UserError
from shims.tinker.training_wire import DatumArrays

LORA_ALPHA = 32
"""Fixed LoRA alpha, independent of rank (scale alpha/rank), so a learning rate carries across ranks as in Tinker."""

FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: a hyperparameter beyond it overflows in the optimizer's tensor arithmetic."""

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

    def groups(self) -> list[str]:
        """The weight groups (``adapters.lora.targets``) the adapter is on."""
        return [group for group, on in (("attn", self.train_attn), ("mlp", self.train_mlp),
                                        ("unembed", self.train_unembed)) if on]

    def validate(self) -> None:
        if not 1 <= self.rank <= MAX_LORA_RANK:
            raise UserError(f"LoRA rank must be between 1 and {MAX_LORA_RANK}, got {self.rank}")
        if not self.groups():
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
            if not math.isfinite(value) or not 0 <= value <= FLOAT32_MAX:
                raise UserError(f"adam_params.{name} must be a number from 0 to {FLOAT32_MAX:.4g} (the largest the "
                                f"optimizer's float32 arithmetic holds), got {value}")
        if self.eps <= 0:
            raise UserError(f"adam_params.eps must be > 0 (0 divides by zero on untouched weights), got {self.eps}")
        if self.beta1 >= 1 or self.beta2 >= 1:
            raise UserError(f"adam_params beta1 and beta2 must be < 1, got {self.beta1}, {self.beta2}")
        if self.learning_rate / (1 - self.beta1) > FLOAT32_MAX or self.learning_rate * self.weight_decay > FLOAT32_MAX:
            raise UserError(f"adam_params.learning_rate {self.learning_rate} is too large: its first step "
                            "(learning_rate / (1 - beta1), and learning_rate × weight_decay) must stay within float32")


@dataclass(frozen=True)
class DimuonHyper:
    """Tinker's ``DimuonParams`` (``adapters/trainer/dimuon.py``); they may change on every optim_step."""

    learning_rate: float
    beta1: float = 0.9
    grad_clip_norm: float = 0.0

    def validate(self) -> None:
        if not all(math.isfinite(v) and abs(v) <= FLOAT32_MAX for v in asdict(self).values()):
            raise UserError(f"dimuon params must be finite numbers within float32's range, got {asdict(self)}")
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
    lora_targets: dict[str, list[str]] = field(default_factory=dict)
    """What a LoRA adapts on this model, by weight group (``attn``, ``mlp``, ``unembed``): each distinct weight once
    (``adapters.lora.model.LoRAModel.describe``)."""
    shard: int = 0
    """This process's rank in a sharded trainer (``adapters.trainer.shards``); 0 for a plain one."""
    shards: int = 1
    backend: str = ""
    """The ``torch.distributed`` backend the shards talk through (``gloo``, ``nccl``); "" for a plain trainer."""
    base_bytes: int = 0
    """Bytes of memory the base model's weights hold in this process (a shard: its share)."""
    threads: int = 0
    """The torch threads this process computes with (``torch.get_num_threads()``, read in it)."""
    checkpointing: str = ""
    """When a training pass checkpoints its layers' activations (``adapters.trainer.memory``), in words."""
    experts: str = ""
    """Which routed experts this shard holds, with their LoRA pairs (``adapters.trainer.parallelize``), in words;
    "" when it holds every one (a plain trainer, a model without routed experts)."""
    runs: int = 0
    """Training runs held now."""
    adapter_bytes: int = 0
    """Bytes their adapter state holds in this process now: LoRA weights, gradients and optimizer state
    (``AdapterTable.state_bytes``)."""
    lora_file_bound: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per weight group, the most numbers per unit of rank and the most tensors a file of an adapter of this model
    holds (``adapters.lora.files.AdapterNaming.file_bound``): what bounds an upload before it is stored."""


@dataclass
class StepRequest:
    """One forward / forward_backward call, as the trainer receives it (possibly batched with others)."""

    model_id: str
    data: list[DatumArrays]
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    custom_loss: CustomLoss | None = None
    """For ``loss_fn="custom"``: the stored loss the request's ``loss_id`` names (``shims.custom_loss.graph``)."""


@dataclass(frozen=True)
class OptimRequest:
    """One ``optim_step`` call, as the trainer receives it (possibly with other runs' optim steps and
    forward_backward requests in the same call: ``MultiLoRATrainer.run_batch``)."""

    model_id: str
    hyper: AdamHyper | DimuonHyper


@dataclass
class StepResult:
    """The outcome of one forward / forward_backward call."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]
    num_tokens: int
    seconds: float


StepOutcome = StepResult | dict[str, float] | UserError
"""What ``Trainer.run_batch`` answers for one request: a forward / forward_backward's result, an optim step's metrics,
or the error that request alone met."""


@dataclass(frozen=True)
class ShardSpec:
    """Where one shard of a sharded trainer sits in its group (``adapters.trainer.shards``)."""

    rank: int
    world: int
    address: str
    """``host:port`` where rank 0 listens for the others at start (``torch.distributed``'s TCP rendezvous)."""


SEE_ALL_GPUS = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
"""Set on a shard's actor, Ray leaves ``CUDA_VISIBLE_DEVICES`` alone: the shard sees its node's GPUs
(``adapters.trainer.shards.local_device``)."""


class Trainer(Protocol):
    """One base model's trainer, as the server calls it: one actor holding the whole model, or N shards answering as
    one (``adapters.trainer.group``). ``MultiLoRATrainer`` implements it (its methods run one at a time, in order);
    every call here is awaited, the trainer's own process doing the work. Forward / forward_backward and optim_step
    requests of several runs reach it together, as one ``run_batch`` (``adapters.trainer.pool``)."""

    async def model_facts(self) -> ModelFacts:
        """Who the trainer (or shard) is, and what it holds and runs with now."""
        ...

    async def create(self, model_id: str, spec: LoraSpec) -> None:
        """Add a run with a fresh adapter; a user error if the trainer holds ``--max-adapters`` runs already."""
        ...

    async def unload(self, model_id: str) -> None:
        """Drop a run's adapter and optimizer state; the base model stays loaded for the others."""
        ...

    async def run_batch(self, requests: list[StepRequest | OptimRequest]) -> list[StepOutcome]:
        """Any runs' optim steps and forward / forward_backward requests, each run at most once, in one call; each
        request gets its own outcome."""
        ...

    async def save_for_sampler(self, model_id: str, directory: str) -> None:
        """Write a run's adapter as a PEFT directory samplers load. On every shard: a sharded trainer's MoE adapters
        are split over them by expert, and gathered to be written."""
        ...

    @by_reference
    async def sampler_tensors(self, model_id: str, peft: bool = False) -> tuple[int, AdapterTensors | PeftTensors]:
        """A run's adapter as samplers load it from memory (an unnamed save: nothing written): its bytes, and the
        weights — by the LoRA model's slot keys, or with ``peft`` as the PEFT directory's contents — which the caller
        gets as a Ray reference it owns, to hand to the samplers unread. On every shard: a sharded trainer's caller
        gets a tuple of every shard's part's reference, each where its shard put it (no gather; the reader joins
        them, ``adapters.samplers.interface.fetched``)."""
        ...

    async def save_for_export(self, model_id: str, directory: str) -> None:
        """Write a run's adapter for download, named as hosted Tinker names it (on every shard, as
        ``save_for_sampler``)."""
        ...

    async def save_state(self, model_id: str, directory: str) -> None:
        """Write a run's adapter, optimizer state and step into ``directory`` (a training checkpoint). On every shard:
        a sharded trainer's optimizer state is split over them, and gathered to be written."""
        ...

    @on_rank_zero
    async def import_adapter(self, source: str, spec: LoraSpec, directory: str) -> None:
        """Check that the adapter in ``source`` (made elsewhere: an upload) is a LoRA of this model as ``spec``
        describes it, and write it into ``directory`` as a PEFT directory samplers load; a user error says what
        does not fit."""
        ...

    async def load_state(self, model_id: str, directory: str, with_optimizer: bool) -> LoraSpec:
        """Replace (or create) a run's adapter with the checkpoint in ``directory``; returns the layout loaded."""
        ...

    async def score(self, weights: str | AdapterTensors | PeftTensors | None, tokens: list[int]) -> list[float]:
        """Logprobs of ``tokens[1:]`` under the base model plus the adapter saved in the directory ``weights`` or
        handed in memory (None: the base model alone); no run is touched."""
        ...


TRAINER_CLASS = "adapters.trainer.actor:MultiLoRATrainer"
"""The class that implements ``Trainer``, imported only in the trainer's actors."""


def read_lora_spec(directory: Path) -> LoraSpec:
    """The LoRA layout of a saved adapter: from our trainer state if present, else as its PEFT config suggests."""
    state_file = directory / TRAINER_STATE
    if state_file.exists():
        return LoraSpec(**json.loads(state_file.read_text())["lora"])
    if not (directory / ADAPTER_CONFIG).exists():
        encrypted = (directory / f"{ADAPTER_CONFIG}.age").exists()
        raise UserError("this checkpoint is an age-encrypted export: only its recipients can read it, so it cannot be "
                        "inspected or loaded here" if encrypted else "this checkpoint holds no adapter configuration")
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    modules = set(config["target_modules"])
    return LoraSpec(rank=int(config["r"]), seed=0, train_attn=bool(modules - _MLP_LEAVES - _HEAD_LEAVES),
                    train_mlp=bool(modules & _MLP_LEAVES), train_unembed=bool(modules & _HEAD_LEAVES))


_MLP_LEAVES = {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "fc1_latent_proj", "fc2_latent_proj"}
_HEAD_LEAVES = {"lm_head", "unembed_tokens", "embed_tokens"}
"""For a PEFT directory without our trainer state, the groups its ``target_modules`` suggest (the trainer itself
goes by the tensors: ``adapters.trainer.files``)."""
