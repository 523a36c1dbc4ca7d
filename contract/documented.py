"""Wire types that hosted Tinker documents for an SDK release newer than the installed one, pinned here from its
documented type pages until an installed SDK carries them (then the contract tests fail, saying to use the SDK's own
type and delete the one here). Each subclasses the installed SDK's type and only adds the documented fields: the
installed SDK's models ignore fields they do not know, so it still reads what the server sends, and a newer SDK
reads the fields too.

SDK 0.39.0 (documented 2026-11-06; the package registry serves 0.38.0): ``Checkpoint.base_model``, the base model a
checkpoint was trained on, in every checkpoint the REST routes return.
"""

from __future__ import annotations

from tinker import types

DOCUMENTED_SDK = "0.39.0"


class Checkpoint(types.Checkpoint):
    base_model: str | None = None
    """The base model the checkpoint was trained on."""


class CheckpointsListResponse(types.CheckpointsListResponse):
    checkpoints: list[Checkpoint]


class TrainingRun(types.TrainingRun):
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None


class TrainingRunsResponse(types.TrainingRunsResponse):
    training_runs: list[TrainingRun]


ADDED_FIELDS: dict[type, tuple[str, ...]] = {Checkpoint: ("base_model",)}
"""The fields each documented type adds to the installed SDK's (what the contract tests watch for)."""
