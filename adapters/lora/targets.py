"""Where LoRA goes in a model: every weight matrix hosted Tinker adapts, found from the model's own modules.

Not a list of names: every ``nn.Linear`` inside the decoder layers, every transformers experts module of 3-D weights
(``adapters.lora.experts``) and the output head are adapted, whatever the family calls them — GQA's ``q/k/v/o_proj``,
MLA's ``q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj``, Gated DeltaNet's ``in_proj_*`` and ``out_proj``, Mamba's
``in_proj`` and ``out_proj``, dense and shared-expert MLPs, routed experts. Left frozen, as hosted Tinker leaves them:
routers (a MoE block's ``gate`` / ``router``, Qwen3.5's ``shared_expert_gate``), convolutions, norms, embeddings (a
tied head's input side follows the head: ``adapters.lora.linear.with_tied_input_side``).

Each weight is in one group, which ``train_attn`` / ``train_mlp`` / ``train_unembed`` select: ``mlp`` when it sits in
a channel mixer (a module whose class is an MLP, a MoE block or experts), ``unembed`` for the head, ``attn`` for the
token mixers (attention of every kind, linear attention, Mamba).

Two fused projections are adapted as the parts hosted Tinker trains (``tinker_cookbook.weights``: split QKV for
Qwen3.5, the fused projection map for Nemotron): Gated DeltaNet's ``in_proj_qkv`` as ``in_proj_q``, ``in_proj_k``,
``in_proj_v`` and a Mamba mixer's ``in_proj`` as ``gate_proj`` (its first ``intermediate_size`` rows) and ``x_proj``
(the rest).
"""

from __future__ import annotations

import re

from torch import nn

from adapters.lora.experts import LoRAExperts, is_experts
from adapters.lora.linear import LoRALinear, Slot
from adapters.lora.routing import Router

GROUPS = ("attn", "mlp", "unembed")

_CHANNEL_MIXER = re.compile(r"(MLP|MoE|MoeBlock|Experts|FeedForward)$")
_IN_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
_ROUTER_LEAVES = re.compile(r"^(gate|router|shared_expert_gate)$")


def _split_rows(owner: nn.Module, leaf: str, linear: nn.Linear) -> list[tuple[str, int, int]] | None:
    """The parts a fused projection is adapted as, ``(leaf name, first row, end row)``; None: adapted whole."""
    if leaf == "in_proj_qkv" and hasattr(owner, "key_dim") and hasattr(owner, "value_dim"):
        k, v = int(owner.key_dim), int(owner.value_dim)
        return [("in_proj_q", 0, k), ("in_proj_k", k, 2 * k), ("in_proj_v", 2 * k, 2 * k + v)]
    if leaf == "in_proj" and "Mamba" in type(owner).__name__ and hasattr(owner, "intermediate_size"):
        inner = int(owner.intermediate_size)
        return [("gate_proj", 0, inner), ("x_proj", inner, linear.out_features)]
    return None


def _group(model: nn.Module, path: str) -> str:
    """``mlp`` if a module enclosing ``path`` below its decoder layer is a channel mixer, else ``attn``. By the end of
    the class name, since families prefix theirs (``Qwen3_5MoeGatedDeltaNet`` is a token mixer)."""
    parts = path.split(".")
    layer = next(i for i in range(len(parts) - 1) if parts[i] == "layers" and parts[i + 1].isdigit())
    for depth in range(layer + 3, len(parts)):
        if _CHANNEL_MIXER.search(type(model.get_submodule(".".join(parts[:depth]))).__name__):
            return "mlp"
    return "attn"


def wrap_model(model: nn.Module, router: Router) -> dict[str, LoRALinear | LoRAExperts]:
    """Replace every adaptable module of ``model`` with its LoRA wrapper, in the model's order; returns them by
    module path. Idempotent per model: call it once."""
    head = model.get_output_embeddings()
    targets = []
    for path, module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if module is head:
            targets.append((path, module, "unembed"))
        elif is_experts(module):
            targets.append((path, module, "mlp"))
        elif isinstance(module, nn.Linear) and _IN_LAYER.search(path) and not _ROUTER_LEAVES.match(leaf):
            targets.append((path, module, _group(model, path)))
    wrapped: dict[str, LoRALinear | LoRAExperts] = {}
    for path, module, group in targets:
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if is_experts(module):
            wrapper: LoRALinear | LoRAExperts = LoRAExperts(module, router, path)
        else:
            split = _split_rows(parent, attribute, module)
            parts = split or [(attribute, 0, module.out_features)]
            slots = [Slot(f"{parent_path}.{leaf}" if parent_path else leaf, group, module.in_features, hi - lo)
                     for leaf, lo, hi in parts]
            wrapper = LoRALinear(module, router, slots, [(lo, hi) for _, lo, hi in parts])
        setattr(parent, attribute, wrapper)
        wrapped[path] = wrapper
    return wrapped
