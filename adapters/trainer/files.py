"""The trainer's checkpoints: an adapter written as a standard PEFT directory (plus optimizer state and step for
training checkpoints), and read back from one — in either naming of ``adapters.lora.files``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TypeVar

import torch

from adapters.disk import DiskFull, writing
from adapters.lora.files import (
    AdapterNaming,
    adapter_scale,
    read_adapter_file,
    whole_if_integer,
)
from adapters.lora.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER_STATE, TRAINER_STATE
from adapters.samplers.interface import AdapterTensors, PeftTensors
from adapters.trainer import optimizer_state
from adapters.trainer.interface import LoraSpec, read_lora_spec
from adapters.trainer.parallelize import whole_tensors
from adapters.trainer.shards import Shards
from adapters.trainer.table import Adapter, AdapterTable
from shims.errors import UserError

T = TypeVar("T")


class CheckpointFiles:
    """Writes the table's runs to checkpoint directories and reads them back, for ``MultiLoRATrainer``."""

    def __init__(self, table: AdapterTable, location: str, naming: AdapterNaming, shards: Shards) -> None:
        """``shards``: the trainer's (a plain trainer's is alone); a sharded trainer's runs keep their optimizer
        state split over them (``adapters.trainer.optimizer_state``)."""
        self.table = table
        self.shards = shards
        self.location = location
        """The base model's directory, named in each adapter's ``adapter_config.json``."""
        self.naming = naming

    def save_for_sampler(self, model_id: str, directory: str) -> None:
        """Write the adapter as a standard PEFT directory (adapter_config.json + adapter_model.safetensors) that any
        PEFT loader turns into the trained model (``adapters.lora.files``: the stored naming)."""
        self._write_adapter(model_id, Path(directory), export=False)

    def sampler_tensors(self, model_id: str, peft: bool = False) -> AdapterTensors | PeftTensors:
        """This shard's part of the adapter as samplers load it from memory (an unnamed save: nothing written),
        float32 — by the LoRA model's slot keys, or with ``peft`` as in the PEFT directory ``save_for_sampler``
        writes (vLLM's form). A plain trainer's part is the whole adapter; a sharded one's parts, rank 0's holding
        all but the other shards' experts and each other shard its own experts, are handed over by each shard
        directly, with no gather, and joined where they are read (``adapters.samplers.interface.joined``). On a CPU
        trainer the arrays are views of the run's weights where the form allows, not copies: Ray copies an actor
        call's answer into its object store as the call returns, before the actor runs its next call (measured: 80
        MiB handed over in 99 ms instead of 222 with a copy here and one in the sampler); an in-process caller
        copies them if it trains on."""
        adapter = self.table.get_run(model_id)
        model = self.table.model
        tensors = model.tensors(adapter.name)  # of an expert slot split over the shards, this shard's experts
        if not self.shards.writes:
            split = model.split_keys()
            tensors = {key: pair for key, pair in tensors.items() if key in split}
        floats = {key: (a.float(), b.float()) for key, (a, b) in tensors.items()}
        if peft:
            state = self.naming.stored(floats, model.first_experts())
            config = (self._peft_config(list(floats), adapter.spec.rank, adapter.scaling, export=False)
                      if self.shards.writes else {})
            return PeftTensors({name: t.numpy() for name, t in state.items()}, config)
        return AdapterTensors({key: (a.numpy(), b.numpy()) for key, (a, b) in floats.items()}, adapter.scaling,
                              adapter.spec.rank)

    def staged_tensors(self, weights: AdapterTensors | PeftTensors) -> Adapter:
        """A temporary adapter holding ``weights`` (handed in memory: ``sampler_tensors``), to score with."""
        if isinstance(weights, PeftTensors):
            scaling, rank = adapter_scale(weights.config)
            state = {name: torch.from_numpy(t.copy()) for name, t in weights.state.items()}
            return self._temporary(self.naming.read(state, rank), scaling, rank, LoraSpec(rank=rank, seed=0))
        tensors = {key: (torch.from_numpy(a.copy()), torch.from_numpy(b.copy())) for key, (a, b) in weights.pairs.items()}
        return self._temporary(tensors, weights.scaling, weights.rank, LoraSpec(rank=weights.rank, seed=0))

    def _temporary(self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float, rank: int,
                   spec: LoraSpec) -> Adapter:
        """A temporary adapter holding ``tensors``, on the weight groups they are on (``spec`` for the rest)."""
        groups = self.table.model.slot_groups(tensors)
        spec = replace(spec, rank=rank, train_attn="attn" in groups, train_mlp="mlp" in groups,
                       train_unembed="unembed" in groups)
        return self.table.temporary(spec, tensors, scaling)

    def save_for_export(self, model_id: str, directory: str) -> None:
        """Write the adapter for download, named as hosted Tinker names it (``adapters.lora.files``)."""
        self._write_adapter(model_id, Path(directory), export=True)

    def _write_adapter(self, model_id: str, out: Path, export: bool) -> None:
        adapter = self.table.get_run(model_id)
        tensors = _kept(lambda: whole_tensors(self.table.model, adapter.name, self.shards))
        self._on_rank_zero(lambda: self._write(out, tensors(), adapter.spec.rank, adapter.scaling, export))

    def _on_rank_zero(self, write: Callable[[], None]) -> None:
        """``write()`` on rank 0, which writes the group's files; on a sharded trainer its outcome is told to every
        shard and raised alike on each, so that the group agrees (a full disk fails the call, not the group)."""
        error: Exception | None = None
        if self.shards.writes:
            try:
                write()
            except Exception as exc:  # noqa: BLE001 - told to every shard, then raised alike on each
                error = exc
        if self.shards.world == 1:
            if error is not None:
                raise error
            return
        kind = next((k for k in (DiskFull, UserError) if isinstance(error, k)), RuntimeError)
        told = self.shards.everywhere(None if error is None else (kind.__name__, str(error)))[0]
        if told is not None:
            raise {"DiskFull": DiskFull, "UserError": UserError}.get(told[0], RuntimeError)(told[1]) from error

    def _write(self, out: Path, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, scaling: float,
               export: bool) -> None:
        from safetensors.torch import save_file

        state, config = self._peft(tensors, rank, scaling, export)
        with writing(out):
            out.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS))
            (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))

    def _peft(self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, scaling: float,
              export: bool) -> tuple[dict[str, torch.Tensor], dict]:
        """A PEFT directory's contents: the tensors by the stored (or, ``export``, hosted Tinker's) names, and
        ``adapter_config.json`` as PEFT's ``LoraConfig`` writes it."""
        state = self.naming.exported(tensors) if export else self.naming.stored(tensors)
        return state, self._peft_config(list(tensors), rank, scaling, export)

    def _peft_config(self, keys: list[str], rank: int, scaling: float, export: bool) -> dict:
        """``adapter_config.json`` of an adapter on the slots ``keys``, as PEFT's ``LoraConfig`` writes it."""
        from peft import LoraConfig

        alpha = whole_if_integer(scaling * rank)
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                            base_model_name_or_path=self.location,
                            **self.naming.peft_settings(keys, rank, alpha, export))
        # Plain JSON values (PEFT's enums as their strings): whoever reads the dict (a server writing a save's
        # files) needs no PEFT to unpickle it.
        return json.loads(json.dumps({key: sorted(value) if isinstance(value, set) else value
                                      for key, value in config.to_dict().items()}))

    def import_adapter(self, source: Path, spec: LoraSpec, out: Path) -> None:
        """Check that an adapter made elsewhere (an upload: hosted Tinker's export naming, or PEFT's own) is a LoRA
        of this model as ``spec`` describes it — its rank, only the weight groups it names, every tensor floating
        point, finite and of its slot's shape, one scale (``rank_pattern`` / ``alpha_pattern``) — and write it into
        ``out`` in the stored naming, which samplers load. Anything else is a ``UserError`` naming what is wrong."""
        try:
            tensors, names, scaling, rank = self._checked(source, spec)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a malformed file raises, it is the uploader's to fix
            raise UserError(f"the adapter could not be read: {type(exc).__name__}: {exc}") from None
        self._write(out, tensors, rank, scaling, export=False)
        self._normalize_config(source, names, rank, scaling)

    def _normalize_config(self, source: Path, names: list[str], rank: int, scaling: float) -> None:
        """Replace an uploaded ``adapter_config.json`` by one that says what its tensors are: their modules, its rank
        and scale (its checked ``rank_pattern`` / ``alpha_pattern`` kept), this base model: what is read of the
        checkpoint later (``read_lora_spec``, ``weights_info``) then never trusts a field the check did not read."""
        from peft import LoraConfig

        original = json.loads((source / ADAPTER_CONFIG).read_text())
        config = LoraConfig(r=rank, lora_alpha=whole_if_integer(scaling * rank), lora_dropout=0.0, bias="none",
                            base_model_name_or_path=self.location,
                            target_modules=sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in names}),
                            rank_pattern=original.get("rank_pattern") or {},
                            alpha_pattern=original.get("alpha_pattern") or {})
        with writing(source):
            temporary = source / ".config"
            config.save_pretrained(str(temporary))
            os.replace(temporary / ADAPTER_CONFIG, source / ADAPTER_CONFIG)  # a new file: the upload's stays as sent
            temporary.rmdir()

    def _checked(self, source: Path, spec: LoraSpec) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]],
                                                               list[str], float, int]:
        """The adapter's pairs by slot key, its tensors' names, scale and rank, once checked (``import_adapter``)."""
        state, scaling, rank = read_adapter_file(source)
        if rank != spec.rank:
            raise UserError(f"adapter_config.json has r={rank}, but the upload was started for a LoRA of rank "
                            f"{spec.rank} (lora_config.rank)")
        for name, tensor in state.items():
            if not tensor.is_floating_point():
                raise UserError(f"adapter tensor {name} is {tensor.dtype}; LoRA weights are floating point")
            if tensor.dim() not in (2, 3):
                raise UserError(f"adapter tensor {name} has {tensor.dim()} dimensions; a LoRA factor has 2 (3 for "
                                "routed experts)")
            if not torch.isfinite(tensor.float()).all():
                raise UserError(f"adapter tensor {name} holds NaN or infinite values")
        tensors = {key: (a.float(), b.float()) for key, (a, b) in self.naming.read(state, rank).items()}
        if not tensors:
            raise UserError("the adapter holds no LoRA tensors")
        self.table.model.check(tensors)
        if (found := next(iter(tensors.values()))[0].shape[-2]) != rank:
            raise UserError(f"the adapter's tensors are of rank {found}, but adapter_config.json says r={rank}")
        extra = self.table.model.slot_groups(tensors) - set(spec.groups())
        if extra:
            raise UserError(f"the adapter adapts {' and '.join(sorted(extra))} weights, which its lora_config leaves "
                            f"out (train_attn={spec.train_attn}, train_mlp={spec.train_mlp}, "
                            f"train_unembed={spec.train_unembed})")
        return tensors, list(state), scaling, rank

    def save_state(self, model_id: str, directory: str) -> None:
        """Write the adapter, its optimizer state and step, so training can resume exactly. Sharded, every shard
        calls this together: rank 0 gathers the adapter's experts and the optimizer state's parts, and writes."""
        adapter = self.table.get_run(model_id)
        optimizer = _kept(lambda: optimizer_state.whole(adapter, self.shards))
        tensors = _kept(lambda: whole_tensors(self.table.model, adapter.name, self.shards))
        out = Path(directory)

        def write() -> None:
            self._write(out, tensors(), adapter.spec.rank, adapter.scaling, export=False)
            with writing(out):
                torch.save(optimizer(), out / OPTIMIZER_STATE)
                (out / TRAINER_STATE).write_text(json.dumps({"step": adapter.step, "lora": asdict(adapter.spec)}))

        self._on_rank_zero(write)

    def stage_state(self, model_id: str, directory: str, with_optimizer: bool) -> tuple[Adapter, LoraSpec]:
        """A temporary adapter holding the checkpoint's weights for ``model_id``, and optionally its optimizer; the
        caller installs it in the run's place (``AdapterTable.install``) or discards it. Without the optimizer the
        adapter gets fresh AdamW moments, as Tinker's ``load_state`` does."""
        src = Path(directory)
        spec = read_lora_spec(src)
        if not with_optimizer and model_id in self.table:  # weights only: the run keeps its optimizer family
            spec = replace(spec, optimizer=self.table[model_id].spec.optimizer)
        if with_optimizer and not (src / OPTIMIZER_STATE).exists():
            raise UserError("this checkpoint has no optimizer state (sampler weights); load it without the optimizer")
        # Built beside the run's current adapter, swapped in only once complete.
        return self.staged(src, spec, with_optimizer), spec

    def staged(self, src: Path, spec: LoraSpec, with_optimizer: bool) -> Adapter:
        """A temporary adapter holding the checkpoint in ``src`` (in either naming, at its own alpha / rank), and its
        optimizer state and step if ``with_optimizer``. The weight groups it is on are those its tensors are on. A
        checkpoint that cannot be read is a ``UserError`` and leaves nothing behind."""
        try:
            state, scaling, rank = read_adapter_file(src)
            tensors = self.naming.read(state, rank)
            staged = self._temporary(tensors, scaling, rank, spec)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a bad checkpoint raises, it is the caller's to fix
            raise UserError(f"checkpoint {src.name} could not be loaded: {exc}") from None
        try:
            if with_optimizer:
                # On the CPU: each shard keeps its part, which load_state_dict moves to the device.
                saved = torch.load(src / OPTIMIZER_STATE, map_location="cpu", weights_only=True)
                staged.optimizer.load_state_dict(optimizer_state.part(saved, staged))
                staged.step = int(json.loads((src / TRAINER_STATE).read_text())["step"])
        except Exception as exc:  # noqa: BLE001 - as above
            self.table.discard(staged)
            raise UserError(f"checkpoint {src.name} could not be loaded: {exc}") from None
        return staged


def _kept(gather: Callable[[], T]) -> Callable[[], T]:
    """``gather()`` (a collective every shard takes part in), its value or its failure kept for the write: rank 0
    unpacks every shard's part after the exchange, and a failure there (out of memory) must fail the call on every
    shard, told by ``_on_rank_zero``, not leave the others waiting for rank 0 in the next collective."""
    try:
        value = gather()
    except Exception as exc:  # noqa: BLE001 - raised by the write, on rank 0, and told to every shard
        failure = exc

        def failed() -> T:
            raise failure

        return failed
    return lambda: value
