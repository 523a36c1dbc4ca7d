"""An adapter on disk: which files a checkpoint holds, what its LoRA layout is, and how its tensors are named.

Two namings exist, one per reader:

- **Stored** (training and sampler checkpoints): a standard PEFT directory that PEFT, vLLM and this server's
  samplers load as it is. When the base model ties its input embedding to its output head (``tie_word_embeddings``),
  a LoRA on the unembedding changes that one shared matrix, so the trained model has the delta on both sides; the
  directory then holds the input side too, as PEFT's embedding LoRA (``embed_tokens.lora_embedding_A/B``, the same
  numbers transposed), so that any PEFT loader reproduces the trained model.
- **Exported** (``save_weights_external``, what users download): hosted Tinker's names, which tinker-cookbook's
  ``weights.build_hf_model`` merges: the unembedding LoRA is ``model.unembed_tokens``, once, and the merge puts it
  into ``lm_head`` or, on a tied model, into the shared ``embed_tokens`` — the same model in both cases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_STATE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"

ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]
UNEMBED_MODULES = ["lm_head"]
HOSTED_UNEMBED = "unembed_tokens"
"""Hosted Tinker's module name for the unembedding LoRA in exported adapters."""
EMBED_MODULE = "embed_tokens"

PEFT_PREFIX = "base_model.model."
"""PEFT's prefix for a module path in a saved adapter."""


def lora_key(path: str, matrix: str) -> str:
    """The saved name of LoRA matrix ``matrix`` ("A" or "B") of the layer at module path ``path``."""
    return f"{PEFT_PREFIX}{path}.lora_{matrix}.weight"


HEAD = "base_model.model.lm_head."
HOSTED_HEAD = "base_model.model.model.unembed_tokens."
EMBED = "base_model.model.model.embed_tokens."
EMBED_A, EMBED_B = f"{EMBED}lora_embedding_A", f"{EMBED}lora_embedding_B"
HEAD_A, HEAD_B = lora_key("lm_head", "A"), lora_key("lm_head", "B")


def with_tied_input_side(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stored naming on a tied model: the unembedding LoRA (B·A on ``[vocab, hidden]``) once more as PEFT's
    embedding LoRA, whose lookup ``A_emb.T[token] @ B_emb.T`` is then exactly row ``token`` of B·A."""
    if HEAD_A not in state:
        return state
    return {**state, EMBED_A: state[HEAD_B].T.contiguous(), EMBED_B: state[HEAD_A].T.contiguous()}


def for_loading(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's naming, from either stored or exported files: the input side of a tied unembedding is derived
    from the head, never trained on its own, so it is dropped; hosted names become PEFT's."""
    return {key.replace(HOSTED_HEAD, HEAD): value for key, value in state.items() if not key.startswith(EMBED)}


def exported(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hosted Tinker's naming, for download: the unembedding LoRA once, as ``model.unembed_tokens``."""
    return {key.replace(HEAD, HOSTED_HEAD): value for key, value in state.items() if not key.startswith(EMBED)}


def target_modules(modules: list[str], *, tied: bool, export: bool) -> list[str]:
    """``adapter_config.json``'s ``target_modules`` for the stored (``export`` false) or exported naming."""
    base = [m for m in modules if m not in (*UNEMBED_MODULES, HOSTED_UNEMBED, EMBED_MODULE)]
    if not set(modules) & {*UNEMBED_MODULES, HOSTED_UNEMBED}:
        return base
    if export:
        return [*base, HOSTED_UNEMBED]
    return [*base, *UNEMBED_MODULES, *([EMBED_MODULE] if tied else [])]


def read_saved_step(directory: Path) -> int | None:
    """The optimizer step a training checkpoint was saved at (None for sampler weights, which have no state)."""
    state_file = directory / TRAINER_STATE
    return int(json.loads(state_file.read_text())["step"]) if state_file.exists() else None


def read_adapter(directory: Path) -> tuple[dict[str, torch.Tensor], float]:
    """A saved adapter's tensors in the trainer's naming (``for_loading``) and its LoRA scale (alpha / r). PEFT
    variants that scale or shape LoRA differently are refused rather than applied wrongly."""
    from safetensors.torch import load_file

    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    unsupported = [key for key in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern") if config.get(key)]
    if unsupported:
        raise ValueError(f"adapter_config.json sets {', '.join(unsupported)}, which this sampler does not apply")
    return for_loading(load_file(str(directory / ADAPTER_WEIGHTS))), float(config["lora_alpha"]) / int(config["r"])
