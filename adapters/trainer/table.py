"""The trainer's adapters: each one's LoRA weights, optimizer and step, and the table of training runs holding them.

Its own module so that the trainer's parts (``adapters.trainer.forward``, ``.files``, ``.optim``) all import it and
none imports another. An adapter is either a training run, in the table under its ``model_id`` and counted against
``--max-adapters``, or temporary: built by the trainer for its own use (a checkpoint being staged before it replaces a
run, the adapter ``score`` measures logprobs with), never in the table and never counted, so no run name is reserved
for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from adapters.lora.model import LoRAModel
from adapters.trainer.dimuon import Dimuon
from adapters.trainer.interface import LORA_ALPHA, AdamHyper, LoraSpec
from shims.errors import UserError


@dataclass
class Adapter:
    name: str
    """Its name in every LoRA layer (``adapter_<n>``), unique for the trainer's lifetime."""
    spec: LoraSpec
    params: list[torch.nn.Parameter]
    """A and B of every adapted slot, in the model's order (the order optimizer state is saved in)."""
    optimizer: torch.optim.Optimizer
    scaling: float
    """alpha / rank: ``LORA_ALPHA / rank`` when created here; a loaded checkpoint's own."""
    step: int = 0
    owned: list[int] | None = None
    """The indices into ``params`` of those this process's optimizer steps and keeps state for: a sharded trainer
    splits each run's optimizer state over its shards (``Optimizers.share`` then gives every shard the stepped
    weights); None: all of them."""
    held: dict[int, slice] = field(default_factory=dict)
    """The indices into ``params`` of those this process holds only its experts' share of (expert parallelism,
    ``adapters.trainer.parallelize``), with that share: always in ``owned``, never summed over the shards."""

    def whole(self) -> list[int]:
        """The indices of the parameters every shard holds whole."""
        return [i for i in range(len(self.params)) if i not in self.held]


class AdapterTable(Mapping[str, Adapter]):
    """The training runs on one base model, by ``model_id``; also builds and drops the temporary adapters."""

    def __init__(self, model: LoRAModel, device: torch.device, max_adapters: int,
                 mine: Callable[[list[int], int], list[int]] | None = None) -> None:
        """``mine``: given the sizes of a run's parameters and a number that differs from run to run (the same on every
        shard), the indices of those this process steps (a shard of a sharded trainer: its share, balanced by size,
        ``Shards.mine``, the shard that takes the largest turning with each run); None: all."""
        self.model = model
        """The base model with its LoRA modules; each adapter is on the weight groups its spec names."""
        self.device = device
        self.max_adapters = max_adapters
        self.mine = mine
        self._runs: dict[str, Adapter] = {}
        self._counter = 0

    def __getitem__(self, model_id: str) -> Adapter:
        return self._runs[model_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._runs)

    def __len__(self) -> int:
        return len(self._runs)

    def state_bytes(self, model_id: str | None = None) -> int:
        """Bytes the training runs' adapter state (or run ``model_id``'s alone) holds in this process now: LoRA
        weights, their gradients and the optimizer's state (AdamW's moments, Dimuon's momentum), each storage once."""
        seen: dict[int, int] = {}
        for adapter in self._runs.values() if model_id is None else [self.get_run(model_id)]:
            tensors = [t for p in adapter.params for t in (p, p.grad) if t is not None]
            tensors += [t for state in adapter.optimizer.state.values() for t in state.values()
                        if isinstance(t, torch.Tensor)]
            for tensor in tensors:
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def get_run(self, model_id: str) -> Adapter:
        """The run ``model_id``, or the user error saying it is not loaded."""
        adapter = self._runs.get(model_id)
        if adapter is None:
            raise UserError(f"model {model_id} is not loaded on the trainer")
        return adapter

    def create(self, model_id: str, spec: LoraSpec) -> None:
        """Add a training run with a freshly initialised adapter (LoRA B = 0: it starts equal to the base model)."""
        spec.validate()
        if model_id in self._runs:
            raise UserError(f"model {model_id} already exists")
        runs = len(self._runs)
        if runs >= self.max_adapters:
            raise UserError(f"this base model's trainer already holds {runs} training runs (--max-adapters "
                            f"{self.max_adapters}); unload one (or save its state and load it later) first")
        self._runs[model_id] = self.temporary(spec)

    def unload(self, model_id: str) -> None:
        """Drop a run's adapter and its optimizer state; the base model stays loaded for the others."""
        self.discard(self.get_run(model_id))
        del self._runs[model_id]

    def install(self, model_id: str, adapter: Adapter) -> None:
        """Make a temporary adapter (a staged checkpoint) run ``model_id``, replacing the run's current adapter if it
        has one. Like the load it completes, this does not check ``--max-adapters``: a crashed trainer's runs are put
        back this way."""
        if model_id in self._runs:
            self.unload(model_id)
        self._runs[model_id] = adapter

    def temporary(self, spec: LoraSpec, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                  scaling: float | None = None) -> Adapter:
        """An adapter in the model but in no run: freshly initialised as ``spec`` says, or holding ``tensors`` (by
        slot key; a ``UserError`` if they do not fit the model) at ``scaling``. The caller installs or discards it."""
        spec.validate()
        self._counter += 1
        name = f"adapter_{self._counter}"
        scaling = LORA_ALPHA / spec.rank if scaling is None else scaling
        if tensors is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.seed)
                self.model.add(name, spec.rank, scaling, spec.groups())
        else:
            self.model.put(name, tensors, scaling, trainable=True)
        params = self.model.params(name)
        held = {i: rows for i, rows in enumerate(self.model.held(name)) if rows is not None}
        owned = None
        if self.mine is not None:  # the experts' share a shard holds is its own; the rest is split by size
            whole = [i for i in range(len(params)) if i not in held]
            # The shard that takes the largest turns with the runs held (the same on every shard: a counter of
            # adapters built is not, once a checkpoint one shard could not read was built on the others).
            owned = sorted([*held, *(whole[i] for i in self.mine([params[i].numel() for i in whole],
                                                                  len(self._runs)))])
        # An optimizer takes at least one parameter: a shard that steps none of a run's holds an empty placeholder.
        stepped = params if owned is None else [params[i] for i in owned] or [nn.Parameter(params[0].new_zeros(0))]
        if spec.optimizer == "dimuon":
            optimizer: torch.optim.Optimizer = Dimuon(stepped, spec.rank)
        elif self.device.type == "cuda":  # one kernel for all of a run's tensors
            optimizer = torch.optim.AdamW(stepped, lr=AdamHyper.learning_rate, fused=True)
        else:
            optimizer = torch.optim.AdamW(stepped, lr=AdamHyper.learning_rate, foreach=True)
        return Adapter(name=name, spec=spec, params=params, optimizer=optimizer, scaling=scaling, owned=owned,
                       held=held)

    def discard(self, adapter: Adapter) -> None:
        """Remove an adapter's matrices from the model (a temporary one, or an unloaded run's)."""
        self.model.remove(adapter.name)
