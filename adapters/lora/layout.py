"""The files of a saved adapter's directory, by name, and what the server reads from them itself: the server process
checks and lists checkpoints without importing the LoRA modules and torch (their tensors: ``adapters.lora.files``)."""

from __future__ import annotations

import json
from pathlib import Path

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_STATE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"


def read_saved_step(directory: Path) -> int | None:
    """The optimizer step a training checkpoint was saved at (None for sampler weights, which have no state)."""
    state_file = directory / TRAINER_STATE
    return int(json.loads(state_file.read_text())["step"]) if state_file.exists() else None
