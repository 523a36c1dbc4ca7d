"""Unnamed sampler saves (``save_weights_and_get_sampling_client``): where they are held, how many are kept, and the
latest ``inflight`` weights of each training model.

They are held in memory, as Ray objects the server owns (the reference the trainer call returned:
``adapters.boundary.by_reference``), in the form the samplers load (``SamplerPool.takes_peft_tensors``): nothing is
written. A save larger than the memory allowed is written under ``DATA_DIR/ephemeral`` instead. Neither outlives the
process that made them (their training model does not either): the directory is emptied at start, and only the last
``keep`` saves per training model are kept.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from adapters.samplers.interface import AdapterRef


@dataclass(frozen=True)
class EphemeralKey:
    """The identity of unnamed sampler weights: the training model they were saved from, and which save of it (a
    snapshot's own number, or the model's one ``inflight`` weights, whose changes ``AdapterRef.version`` counts)."""

    model_id: str
    save: str

    @classmethod
    def snapshot(cls, model_id: str, save: str) -> EphemeralKey:
        return cls(model_id, save)

    @classmethod
    def inflight(cls, model_id: str) -> EphemeralKey:
        return cls(model_id, "inflight")

    def __str__(self) -> str:
        """Its form where a string is needed (a sampler's adapter key, the records): an opaque name, never parsed."""
        return f"{self.model_id}#{self.save}"


class EphemeralWeights:
    def __init__(self, root: Path, keep: int, memory_bytes: int = 0) -> None:
        """``keep``: saves kept per training model; ``memory_bytes``: the most the saves held in memory take together
        (``--ephemeral-memory-mb``), the oldest pushed out first."""
        self.root = root
        self.keep = keep
        self.memory_bytes = memory_bytes
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        self._kept: dict[str, list[AdapterRef]] = {}
        self._held: dict[str, tuple[str, AdapterRef, int]] = {}
        """The saves held in memory, oldest first, by key: their training model, reference and bytes."""
        self._inflight: dict[str, AdapterRef] = {}
        self._versions: dict[str, int] = {}
        """Each model's last inflight version, kept when its weights are pushed out: a replica that still holds an
        older version reloads any newer one (``ResidentAdapters``), so versions never repeat."""
        self._sizes: dict[str, int] = {}
        """Each model's last save's bytes."""
        self._counter = 0

    def fits(self, nbytes: int) -> bool:
        """Whether a save of ``nbytes`` may be held in memory (pushing older ones out)."""
        return 0 < nbytes <= self.memory_bytes

    def may_hold(self, model_id: str) -> bool:
        """Whether ``model_id``'s next save is worth handing over in memory: memory is allowed, and its last save (a
        run's adapter keeps its size) fitted. Otherwise it is written at once, without an in-memory copy first."""
        return self.memory_bytes > 0 and self.fits(self._sizes.get(model_id, 1))

    def sized(self, model_id: str, nbytes: int) -> None:
        """Remember the bytes of ``model_id``'s save (``may_hold``)."""
        self._sizes[model_id] = nbytes

    def _next(self) -> str:
        self._counter += 1
        return f"{self._counter:08d}"

    def directory(self, model_id: str) -> Path:
        """A fresh directory for an unnamed save of ``model_id``'s weights (for samplers that read one)."""
        return self.root / model_id.replace(":", "_") / self._next()

    def add(self, model_id: str, directory: Path | None = None, tensors: object = None, nbytes: int = 0, *,
            inflight: bool) -> AdapterRef:
        """The weights just saved into ``directory``, or held in memory as ``tensors`` (``AdapterRef.tensors``, of
        ``nbytes``), as a sampler adapter; an ``inflight`` save becomes the model's inflight weights (a new version
        of the same adapter). Older saves beyond ``keep`` are deleted, and in memory the oldest beyond
        ``memory_bytes`` (the saving model's own first); the inflight weights a newer version replaces go at once
        from memory (a sample that started on them holds them itself)."""
        held = directory is None
        if inflight:
            self._versions[model_id] = version = self._versions.get(model_id, 0) + 1
            ref = AdapterRef(str(EphemeralKey.inflight(model_id)), "" if held else str(directory), version, tensors)
            self._inflight[model_id] = ref
        else:
            save = self._next() if held else directory.name
            ref = AdapterRef(str(EphemeralKey.snapshot(model_id, save)), "" if held else str(directory), tensors=tensors)
        kept = self._kept.setdefault(model_id, [])
        if held:
            if inflight:
                kept[:] = [old for old in kept if old.key != ref.key]
                self._held.pop(ref.key, None)
            while self._held and sum(size for _, _, size in self._held.values()) + nbytes > self.memory_bytes:
                # The saving model's own oldest first: another tenant's saves go only when its own cannot make room.
                oldest_model, oldest, _ = next((entry for entry in self._held.values() if entry[0] == model_id),
                                               next(iter(self._held.values())))
                self._kept[oldest_model].remove(oldest)
                self._drop(oldest)
            self._held[ref.key] = (model_id, ref, nbytes)
        kept.append(ref)
        while len(kept) > self.keep:
            self._drop(kept.pop(0))
        return ref

    def _drop(self, ref: AdapterRef) -> None:
        """Delete a save's files, or let go of it in memory (its model's inflight weights, if it was them)."""
        if ref.directory:
            shutil.rmtree(ref.directory, ignore_errors=True)
        entry = self._held.pop(ref.key, None)
        if entry is not None and self._inflight.get(entry[0]) is ref:
            del self._inflight[entry[0]]

    def snapshot(self, key: str) -> AdapterRef | None:
        """The snapshot held in memory under ``key`` (None once newer saves pushed it out, or after a restart)."""
        entry = self._held.get(key)
        return entry[1] if entry else None

    def inflight(self, model_id: str) -> AdapterRef | None:
        """The model's latest inflight weights (None after a restart, or once newer saves pushed them out of
        memory)."""
        return self._inflight.get(model_id)
