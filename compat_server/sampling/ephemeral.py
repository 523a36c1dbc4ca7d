"""Unnamed sampler saves (``save_weights_and_get_sampling_client``): where they are written, how many are kept, and
the latest ``inflight`` weights of each training model.

They live under ``DATA_DIR/ephemeral`` and do not outlive the process that made them (their training model does not
either): the directory is emptied at start, and only the last ``keep`` saves per training model stay on disk.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from adapters.samplers.interface import AdapterRef


@dataclass(frozen=True)
class EphemeralKey:
    """The identity of unnamed sampler weights: the training model they were saved from, and which save of it (a
    snapshot's own directory, or the model's one ``inflight`` weights, whose changes ``AdapterRef.version`` counts)."""

    model_id: str
    save: str

    @classmethod
    def snapshot(cls, model_id: str, directory: Path) -> EphemeralKey:
        return cls(model_id, directory.name)

    @classmethod
    def inflight(cls, model_id: str) -> EphemeralKey:
        return cls(model_id, "inflight")

    def __str__(self) -> str:
        """Its form where a string is needed (a sampler's adapter key, the records): an opaque name, never parsed."""
        return f"{self.model_id}#{self.save}"


class EphemeralWeights:
    def __init__(self, root: Path, keep: int) -> None:
        self.root = root
        self.keep = keep
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        self._kept: dict[str, list[Path]] = {}
        self._inflight: dict[str, AdapterRef] = {}
        self._counter = 0

    def directory(self, model_id: str) -> Path:
        """A fresh directory for an unnamed save of ``model_id``'s weights."""
        self._counter += 1
        return self.root / model_id.replace(":", "_") / f"{self._counter:08d}"

    def add(self, model_id: str, directory: Path, *, inflight: bool) -> AdapterRef:
        """The weights just saved into ``directory`` as a sampler adapter; an ``inflight`` save becomes the model's
        inflight weights (a new version of the same adapter). Older saves beyond ``keep`` are deleted."""
        if inflight:
            previous = self._inflight.get(model_id)
            ref = AdapterRef(str(EphemeralKey.inflight(model_id)), str(directory),
                             (previous.version + 1) if previous else 1)
            self._inflight[model_id] = ref
        else:
            ref = AdapterRef(str(EphemeralKey.snapshot(model_id, directory)), str(directory))
        kept = self._kept.setdefault(model_id, [])
        kept.append(directory)
        while len(kept) > self.keep:
            shutil.rmtree(kept.pop(0), ignore_errors=True)
        return ref

    def inflight(self, model_id: str) -> AdapterRef | None:
        """The model's latest inflight weights (None after a restart: they are not kept across one)."""
        return self._inflight.get(model_id)
