"""An adapter on disk: which files a checkpoint holds, and how an adapter's tensors are named in them.

An adapter in memory is ``{slot key: (A, B)}`` (``adapters.lora.model``). Two namings exist on disk, one per reader:

- **Stored** (training and sampler checkpoints): PEFT's, as PEFT and vLLM load LoRA: every pair under
  ``base_model.model.<module path>.lora_A/B.weight``, a routed expert's pairs as one 2-D pair per expert
  (``…experts.<e>.gate_proj``), and a projection trained as parts (``adapters.lora.targets``) as one pair on the
  fused module the model has: A the parts' A stacked, B their B block-diagonal, so of rank parts × r, which
  ``rank_pattern`` / ``alpha_pattern`` in ``adapter_config.json`` state at the adapter's own alpha / r (vLLM refuses
  the parts' names). A vision-language checkpoint's language model is named as in the checkpoint
  (``model.language_model.layers…``, which vLLM's vision-language classes map). That is the layout tinker-cookbook's
  ``build_lora_adapter`` writes for vLLM. When the base
  model ties its input embedding to its output head, a LoRA on the unembedding changes that one shared matrix, so the
  directory also holds the input side as PEFT's embedding LoRA (``embed_tokens.lora_embedding_A/B``, the same numbers
  transposed), so that any PEFT loader reproduces the trained model.
- **Exported** (``save_weights_external``, what users download): hosted Tinker's, which tinker-cookbook's
  ``weights.build_hf_model`` merges and ``build_lora_adapter`` converts: the unembedding as ``model.unembed_tokens``
  (once), experts as 3-D pairs ``…experts.w1/w2/w3`` (``(experts, rank, in)``, ``(experts, out, rank)``; w1 gate,
  w3 up, w2 down; a model without gates: w1 up, w2 down), fused projections as their trained parts
  (``in_proj_q/k/v``, Mamba's ``gate_proj``/``x_proj``), gpt-oss's attention under ``.attn.``, and module paths of
  the text model (``model.layers…``) also for a vision-language checkpoint, whose prefix the merge adds itself.

Reading takes either naming, or a mix, back to slot keys (``AdapterNaming.read``); a fused projection's pair is split
back into its parts, also a PEFT adapter's of rank r on the fused module (each part then keeps A whole).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from adapters.lora.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from adapters.lora.linear import Slot
from shims.errors import UserError

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."
"""PEFT's prefix for a module path in a saved adapter."""
HOSTED_UNEMBED = "model.unembed_tokens"
"""Hosted Tinker's module path for the unembedding LoRA in exported adapters."""
LANGUAGE_MODEL = ("model.", "model.language_model.")
"""A vision-language checkpoint's text model paths, as the text model names them and as the checkpoint does."""
EMBED = "base_model.model.model.embed_tokens."
EMBED_A, EMBED_B = f"{EMBED}lora_embedding_A", f"{EMBED}lora_embedding_B"

_EXPERT_SLOT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")
_HOSTED_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<w>w[123])$")
_ATTENTION_ALIASES = {"GptOss": (".self_attn.", ".attn.")}
"""Families whose attention hosted Tinker names differently: architecture name fragment → (ours, hosted)."""


def _pair_names(path: str) -> tuple[str, str]:
    return f"{PEFT_PREFIX}{path}.lora_A.weight", f"{PEFT_PREFIX}{path}.lora_B.weight"


class AdapterNaming:
    """The names of one model's slots in both namings, and the way back."""

    def __init__(self, slots: dict[str, Slot], head: str, arch: str, tied: bool,
                 fused: dict[str, list[str]] | None = None, renamed: tuple[str, str] | None = None) -> None:
        """``head``: the output head's slot key; ``arch``: the model's architecture name (``GptOssForCausalLM``);
        ``fused``: module path → the slot keys of its parts, in row order, for each projection trained as parts;
        ``renamed``: (prefix, as stored), a prefix of module paths stored under another name (``LANGUAGE_MODEL``)."""
        self.renamed = renamed
        self.slots = slots
        self.head = head
        self.tied = tied
        self.fused = fused or {}
        self._part_of = {key: path for path, parts in self.fused.items() for key in parts}
        self.alias = next((pair for fragment, pair in _ATTENTION_ALIASES.items() if fragment in arch), None)
        self._hosted_w: dict[str, str] = {}
        """Expert slot key → its hosted ``w1/w2/w3`` name."""
        experts: dict[str, list[str]] = {}
        for key, slot in slots.items():
            match = _EXPERT_SLOT.match(key)
            if match and slot.experts:
                experts.setdefault(match["experts"], []).append(match["proj"])
        for path, projections in experts.items():
            names = ({"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if "gate_proj" in projections
                     else {"up_proj": "w1", "down_proj": "w2"})
            for projection in projections:
                self._hosted_w[f"{path}.{projection}"] = names[projection]

    # ---- writing ---------------------------------------------------------------------------------------------------
    def stored(self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
               first_experts: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
        """The stored naming (PEFT's, per expert), with a tied unembedding's input side. ``first_experts``: of an
        expert slot holding some experts alone (a shard's), the index of its first."""
        import torch

        out: dict[str, torch.Tensor] = {}
        for path, parts in self.fused.items():
            if parts[0] in tensors:  # a module's parts come all or none (LoRAModel.put)
                name_a, name_b = _pair_names(self._stored_path(path))
                out[name_a] = torch.cat([tensors[key][0] for key in parts]).contiguous()
                out[name_b] = torch.block_diag(*[tensors[key][1] for key in parts])
        for key, (a, b) in tensors.items():
            if key in self._part_of:
                continue
            if self.slots[key].experts:
                match = _EXPERT_SLOT.match(key)
                first = (first_experts or {}).get(key, 0)
                for e in range(a.shape[0]):
                    name_a, name_b = _pair_names(self._stored_path(f"{match['experts']}.{first + e}.{match['proj']}"))
                    out[name_a], out[name_b] = a[e].contiguous(), b[e].contiguous()
            else:
                name_a, name_b = _pair_names(self._stored_path(key))
                out[name_a], out[name_b] = a, b
        if self.tied and self.head in tensors:
            a, b = tensors[self.head]
            # Copies, not ``.contiguous()``: at rank 1 the transpose is already contiguous, so it would be the head's
            # own tensor, and safetensors refuses to write two names sharing memory.
            out[EMBED_A] = b.T.clone(memory_format=torch.contiguous_format)
            out[EMBED_B] = a.T.clone(memory_format=torch.contiguous_format)
        return out

    def _stored_path(self, path: str) -> str:
        if self.renamed and path.startswith(self.renamed[0]):
            return self.renamed[1] + path.removeprefix(self.renamed[0])
        return path

    def exported(self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Hosted Tinker's naming."""
        out: dict[str, torch.Tensor] = {}
        for key, (a, b) in tensors.items():
            name_a, name_b = _pair_names(self._hosted_path(key))
            out[name_a], out[name_b] = a.contiguous(), b.contiguous()
        return out

    def _hosted_path(self, key: str) -> str:
        if key == self.head:
            return HOSTED_UNEMBED
        if key in self._hosted_w:
            return f"{key.rsplit('.', 1)[0]}.{self._hosted_w[key]}"
        if self.alias:
            return f".{key}".replace(*self.alias)[1:]
        return key

    def peft_settings(self, keys: list[str], rank: int, alpha: float, export: bool) -> dict:
        """``adapter_config.json``'s ``target_modules`` (the leaf module names the files use) and, stored, the
        ``rank_pattern`` / ``alpha_pattern`` of fused projections (parts × the rank and the alpha, so that their scale
        is the adapter's: what ``build_lora_adapter`` writes)."""
        if export:
            return {"target_modules": sorted({self._hosted_path(key).rsplit(".", 1)[-1] for key in keys})}
        fused = {self._part_of[key] for key in keys if key in self._part_of}
        leaves = {key.rsplit(".", 1)[-1] for key in keys if key not in self._part_of}
        ranks = {path.rsplit(".", 1)[-1]: len(self.fused[path]) for path in fused}
        return {"target_modules": sorted(leaves | set(ranks) |
                                         ({"embed_tokens"} if self.tied and self.head in keys else set())),
                "rank_pattern": {leaf: parts * rank for leaf, parts in sorted(ranks.items())},
                "alpha_pattern": {leaf: whole_if_integer(parts * alpha) for leaf, parts in sorted(ranks.items())}}

    def file_bound(self) -> dict[str, tuple[int, int]]:
        """Per weight group, the most numbers per unit of rank and the most tensors a file of this model's adapter
        holds in either naming: a fused projection stored as one pair of rank parts × r (its B block-diagonal), routed
        experts one pair each, a tied unembedding twice. What an upload of an adapter is bounded by before it is
        stored (``compat_server.runs.uploads``)."""
        bound: dict[str, tuple[int, int]] = {}
        for key, slot in self.slots.items():
            parts = len(self.fused[self._part_of[key]]) if key in self._part_of else 1
            copies = (2 if self.tied and key == self.head else 1) * max(slot.experts, 1)
            numbers, tensors = bound.get(slot.group, (0, 0))
            bound[slot.group] = (numbers + copies * (slot.in_features + parts * slot.out_features), tensors + 2 * copies)
        return bound

    # ---- reading ---------------------------------------------------------------------------------------------------
    def read(self, state: dict[str, torch.Tensor], rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Slot key → (A, B) from a file in either naming, of an adapter of ``rank``. A tied unembedding's input side
        is derived from the head, never trained on its own, so it is dropped. Names no slot has, and half pairs, are
        a ``UserError``."""
        import torch

        by_path: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in state.items():
            if name.startswith(EMBED):
                continue
            match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", name)
            if match is None:
                raise UserError(f"adapter tensor {name} is not a LoRA pair this server reads")
            path = match[1]
            if self.renamed and path.startswith(self.renamed[1]):
                path = self.renamed[0] + path.removeprefix(self.renamed[1])
            by_path.setdefault(path, {})[match[2]] = tensor
        hosted = {self._hosted_path(key): key for key in self.slots}
        experts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for path, pair in by_path.items():
            if set(pair) != {"A", "B"}:
                raise UserError(f"adapter tensor {path} has lora_{next(iter(pair))} but not its other half")
            if path in self.fused:
                out.update(self._split(path, pair["A"], pair["B"], rank))
                continue
            per_expert = _PER_EXPERT.match(path)
            if per_expert and f"{per_expert['experts']}.{per_expert['proj']}" in self.slots:
                slot = f"{per_expert['experts']}.{per_expert['proj']}"
                experts.setdefault(slot, {})[int(per_expert["e"])] = (pair["A"], pair["B"])
                continue
            key = path if path in self.slots and not _HOSTED_EXPERT.match(path) else hosted.get(path)
            if key is None:
                raise UserError(f"adapter tensor {path} names no weight this model's LoRA adapts")
            out[key] = (pair["A"], pair["B"])
        for key, pairs in experts.items():
            count = self.slots[key].experts
            if sorted(pairs) != list(range(count)):
                raise UserError(f"adapter {key} has pairs for {len(pairs)} of the model's {count} experts")
            out[key] = (torch.stack([pairs[e][0] for e in range(count)]),
                        torch.stack([pairs[e][1] for e in range(count)]))
        return out

    def _split(self, path: str, a: torch.Tensor, b: torch.Tensor,
               rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """A fused projection's pair as its parts' pairs of ``rank``: stacked As and a block-diagonal B (as
        ``stored`` writes it) split exactly, or a pair of ``rank`` itself with each part keeping A whole."""
        parts = self.fused[path]
        bounds = [0]
        for key in parts:
            bounds.append(bounds[-1] + self.slots[key].out_features)
        if b.shape[0] != bounds[-1] or a.shape[0] != b.shape[1]:
            raise UserError(f"adapter tensor {path} has shapes {list(a.shape)}, {list(b.shape)}; this model needs "
                            f"{bounds[-1]} output rows")
        if a.shape[0] == rank:
            return {key: (a, b[lo:hi]) for key, lo, hi in zip(parts, bounds, bounds[1:], strict=False)}
        if a.shape[0] != len(parts) * rank:
            raise UserError(f"adapter tensor {path} has rank {a.shape[0]}; an adapter of rank {rank} has {rank} or "
                            f"{len(parts) * rank} (its {len(parts)} parts) there")
        out = {}
        for i, (key, lo, hi) in enumerate(zip(parts, bounds, bounds[1:], strict=False)):
            rows = b[lo:hi]
            if rows[:, :i * rank].any() or rows[:, (i + 1) * rank:].any():
                raise UserError(f"adapter tensor {path} of rank {a.shape[0]} is not block-diagonal over its parts "
                                f"({', '.join(key.rsplit('.', 1)[-1] for key in parts)}), which this server trains "
                                f"as {len(parts)} pairs of rank {rank}")
            out[key] = (a[i * rank:(i + 1) * rank], rows[:, i * rank:(i + 1) * rank])
        return out


def whole_if_integer(value: float) -> int | float:
    """An alpha as ``adapter_config.json`` writes it: an int where it is one (as PEFT's own configs have it)."""
    value = round(float(value), 6)
    return int(value) if value.is_integer() else value


MAX_SCALE = 1e4
"""The largest LoRA scale (alpha / r) an adapter read here may have: far above any trained one (PEFT's usual scales
are 0.5 to 4), and finite, so that a scale from a file never overflows what it multiplies."""


def read_adapter_file(directory: Path) -> tuple[dict[str, torch.Tensor], float, int]:
    """A saved adapter's tensors as named in the file, its LoRA scale (alpha / r) and rank (``adapter_scale``)."""
    from safetensors.torch import load_file

    scaling, rank = adapter_scale(json.loads((directory / ADAPTER_CONFIG).read_text()))
    return load_file(str(directory / ADAPTER_WEIGHTS)), scaling, rank


def adapter_scale(config: dict) -> tuple[float, int]:
    """An ``adapter_config.json``'s LoRA scale (alpha / r) and rank. PEFT variants that scale or shape LoRA
    differently are refused rather than applied wrongly; ``rank_pattern`` / ``alpha_pattern`` are taken where they
    keep every module at the adapter's scale (fused projections, as ``stored`` writes them)."""
    unsupported = [key for key in ("use_rslora", "use_dora") if config.get(key)]
    if unsupported:
        raise UserError(f"adapter_config.json sets {', '.join(unsupported)}, which this server does not apply")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    if rank < 1 or not 0 < alpha / rank <= MAX_SCALE:
        raise UserError(f"adapter_config.json has r={config['r']} and lora_alpha={config['lora_alpha']}: a LoRA needs "
                        f"r ≥ 1 and a scale lora_alpha / r above 0 and at most {MAX_SCALE:g}")
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    for module in sorted(set(ranks) | set(alphas)):
        module_rank, module_alpha = int(ranks.get(module, rank)), float(alphas.get(module, alpha))
        if abs(module_alpha / module_rank - alpha / rank) > 1e-6 * alpha / rank:
            raise UserError(f"adapter_config.json scales {module} by {module_alpha:g}/{module_rank} and the rest by "
                            f"{alpha:g}/{rank}; this server applies one scale per adapter")
    return alpha / rank, rank
