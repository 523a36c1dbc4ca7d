"""Padding-free batches: the trainer runs a batch's real tokens, not a rectangle of rows × its longest datum.

A batch's datums are packed one after another into a single sequence, each with its own positions (0, 1, …), and
every attention layer attends within each datum only: block-diagonal causal attention, computed here
(``packed_attention``, registered with transformers as the model's attention) datum group by datum group, never as
a (total tokens)² mask. The datums are grouped by length into *buckets* whose padding is at most ``SLACK`` of their
real tokens; each bucket is one batched attention over ``[datums, heads, longest, longest]``, so attention costs
what each datum's own causal attention costs, plus that slack. Everything else in a layer (projections, LoRA,
experts, norms) sees only the real tokens, each routed per token.

Families whose layers carry a recurrent state along the sequence (Gated DeltaNet, Mamba: a causal convolution and
a scan) cannot restart it at a datum's start inside one packed sequence with transformers' own layers; their
datums run as padded rows instead, in the same length buckets, one forward per bucket, so that padding stays
under ``SLACK`` of the real tokens (``buckets``; on a sharded trainer every shard runs as many forwards as the one
with the most buckets: ``adapters.trainer.forward``). Either way the pass returns the datums' final hidden
states packed, ``[real tokens, hidden]``, datum after datum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

ATTENTION = "compat_packed"
"""The name ``packed_attention`` is registered under with transformers (``AttentionInterface``). It has no mask
function, so the model builds no attention mask at all (transformers' ``_preprocess_mask_arguments``)."""

SLACK = 0.10
"""At most this share of a bucket's positions is padding (above its real tokens), beside a bucket of one length."""


def buckets(lengths: list[int], slack: float = SLACK) -> list[list[int]]:
    """Indices of ``lengths`` grouped so that each group's ``count × longest`` is at most ``(1 + slack)`` of its real
    tokens: the longest first, each group taking the next longest while it stays within the slack. Within a group
    the indices keep their order in ``lengths`` (a batch sorted by adapter stays sorted). Linear after the sort."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    real, longest = 0, 0
    for i in order:
        n = lengths[i]
        if groups and (len(groups[-1]) + 1) * longest <= (1 + slack) * (real + n):
            groups[-1].append(i)
            real += n
            continue
        groups.append([i])
        real, longest = n, n
    return [sorted(group) for group in groups]


@dataclass
class _Bucket:
    count: int
    longest: int
    gather: torch.Tensor
    """``[count × longest]``: the packed position each padded slot reads (a padding slot: its datum's last)."""
    keys: torch.Tensor
    """``[count, 1, 1, longest]``: True where a slot is one of its datum's tokens."""
    full: bool
    """Every datum of the bucket is ``longest`` tokens: no padding, so a plain causal attention needs no mask."""


class Packing:
    """The datums of one packed pass: their positions, and the buckets ``packed_attention`` runs them in. Built once
    per pass (a few index tensors, linear in the tokens) and handed to every attention layer."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.tokens = sum(lengths)
        sizes = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(sizes) - sizes
        owner = np.repeat(np.arange(len(sizes)), sizes)  # each packed position's datum
        offset = np.arange(self.tokens) - starts[owner]  # its position within that datum
        self.positions = torch.from_numpy(offset).to(device)[None]
        self.buckets: list[_Bucket] = []
        first_slot = np.zeros(len(sizes), dtype=np.int64)  # where each datum's first token sits in the buckets' output
        slot = 0
        for group in buckets(lengths):
            members = np.asarray(group)
            longest = int(sizes[members].max())
            steps = np.arange(longest)
            # A padding slot reads its datum's last token: any real position would do, it is masked out as a key and
            # its output is never read.
            gather = starts[members, None] + np.minimum(steps[None, :], sizes[members, None] - 1)
            keys = steps[None, :] < sizes[members, None]
            first_slot[members] = slot + np.arange(len(members)) * longest
            slot += len(members) * longest
            self.buckets.append(_Bucket(len(members), longest, torch.from_numpy(gather.reshape(-1)).to(device),
                                        torch.from_numpy(keys[:, None, None, :]).to(device), bool(keys.all())))
        self.back = torch.from_numpy(first_slot[owner] + offset).to(device)
        """Each packed position's slot in the buckets' outputs, concatenated."""
        self.uniform = len(self.buckets) == 1 and self.buckets[0].full and self.buckets[0].count == len(lengths)
        """All datums are one bucket of equal lengths, in order: the packed sequence is already ``[datums, longest]``
        row by row, so attention reads and writes it in place, with no gather (one datum, or a uniform batch)."""


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                     packing: Packing | None = None, softcap: float | None = None,
                     **_: object) -> tuple[torch.Tensor, None]:
    """Attention of a packed sequence (``query`` ``[1, heads, tokens, d]``, ``key``/``value`` ``[1, kv heads,
    tokens, d]``), causal within each datum of ``packing`` and never across datums; a sliding window and attention
    sinks (``s_aux``, gpt-oss) as the family's own attention applies them. Returns ``[1, tokens, heads, d_v]``.
    Only the families of ``PACKED_FAMILIES`` reach it; a logit soft-cap, which none of them has, is refused."""
    if packing is None:
        raise RuntimeError("the packed attention was called outside a packed pass")
    if softcap is not None:
        raise NotImplementedError("the packed attention does not apply a logit soft-cap")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    if packing.uniform and s_aux is None and sliding_window is None:
        n = packing.buckets[0].count
        q, k, v = (t[0].unflatten(1, (n, -1)).transpose(0, 1) for t in (query, key, value))  # [n, heads, L, d]
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1)
        return out.transpose(1, 2).reshape(1, packing.tokens, out.shape[1], out.shape[3]), None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, d]
    outputs = []
    for bucket in packing.buckets:
        n, length = bucket.count, bucket.longest
        gather, keys = bucket.gather.to(query.device), bucket.keys.to(query.device)  # no-ops on the model's device

        def rows(t: torch.Tensor, n=n, length=length, gather=gather) -> torch.Tensor:
            return t.index_select(0, gather).view(n, length, t.shape[1], t.shape[2]).transpose(1, 2)

        qb, kb, vb = rows(q), rows(k), rows(v)
        if s_aux is None and sliding_window is None and bucket.full:  # equal lengths: the kernel's own causal mask
            out = nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scaling,
                                                             enable_gqa=groups > 1)
            outputs.append(out.transpose(1, 2).reshape(n * length, out.shape[1], out.shape[3]))
            continue
        steps = torch.arange(length, device=query.device)
        allowed = steps[None, :] <= steps[:, None]
        if sliding_window is not None:
            allowed = allowed & (steps[None, :] > steps[:, None] - sliding_window)
        allowed = allowed[None, None] & keys  # [n, 1, length, length]
        # A padding query (never read) may see every real key, so that no row is empty, whatever the window.
        allowed = allowed | (~keys.transpose(-1, -2) & keys)
        if s_aux is None:
            out = nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=scaling,
                                                             enable_gqa=groups > 1)
        else:  # a learned sink logit per head joins each row's softmax, then is dropped (gpt-oss)
            if groups > 1:
                kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
            scores = torch.matmul(qb, kb.transpose(-1, -2)) * scaling
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            sinks = s_aux.reshape(1, -1, 1, 1).expand(n, -1, length, 1).to(scores.dtype)
            combined = torch.cat([scores, sinks], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = torch.softmax(combined, dim=-1)[..., :-1].to(vb.dtype)
            out = torch.matmul(probs, vb)
        outputs.append(out.transpose(1, 2).reshape(n * length, out.shape[1], out.shape[3]))
    flat = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return flat.index_select(0, packing.back)[None], None


PACKED_FAMILIES = frozenset({"llama", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3"})
"""Model types whose every token mixer is attention that ``packed_attention`` computes as the family does (causal,
sliding windows, sinks, MLA), each checked in ``tests/test_packing.py`` against each datum run alone. Any other
family (recurrent layers, chunked or soft-capped attention, masks with more in them) runs padded length buckets."""


def packs(model: nn.Module) -> bool:
    """Whether ``model``'s batches run packed: a family of ``PACKED_FAMILIES`` with no convolution in it (the causal
    convolution of Mamba and Gated DeltaNet layers, whose state a packed sequence would carry across datums)."""
    return (getattr(model.config, "model_type", None) in PACKED_FAMILIES
            and not any(isinstance(module, nn.Conv1d) for module in model.modules()))


def use_packed_attention(model: nn.Module) -> None:
    """Make ``packed_attention`` the attention of every layer of ``model`` (its configs and sub-configs)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTENTION
