"""How the trainer runs its base model with the adapters on it: a batch's final hidden states, packed without
padding (each datum through its own adapter, ``adapters.trainer.packing``; on a sharded trainer inside the FSDP2
root module's call), a datum's target logprobs scored in chunks so
that a long datum never holds all of its logits at once, and scoring without gradients. ``adapters.trainer.forward``
builds the training passes on these."""

from __future__ import annotations

import math

import numpy as np
import torch

from adapters.lora.linear import with_tied_input_side
from adapters.lora.model import LoRAModel
from adapters.trainer.logprobs import target_logprobs
from adapters.trainer.memory import DoesNotFit
from adapters.trainer.packing import Packing, buckets, packs, use_packed_attention
from adapters.trainer.parallelize import experts_split
from adapters.trainer.recompute import LayerRecompute
from adapters.trainer.shards import Shards
from shims.tinker.training_wire import DatumArrays

LOGITS_CHUNK_ELEMENTS = 1 << 26
"""At most this many logits (positions × vocabulary) are computed at once: 256 MiB in float32, ~440 positions at a
151k vocabulary. Shorter datums are scored several to a chunk; longer ones chunk by chunk, each chunk's logits
recomputed in backward instead of kept."""

IDLE_ROW = DatumArrays(tokens=np.zeros(1, dtype=np.int64))
"""What a shard with no datum of a batch runs through the base model, so that it takes part in the batch's
collectives (``adapters.trainer.shards``); also each forward a shard runs beyond its own length buckets
(``ModelPasses._buckets``)."""

LOGIT_BYTES = 4
"""Bytes of each logit a datum's scoring keeps for backward: its log-softmax, in float32."""


class ModelPasses:
    """One base model's passes, for ``MultiLoRATrainer`` (and its ``MixedForward``)."""

    def __init__(self, model: LoRAModel, vocab_size: int, shards: Shards, recompute: LayerRecompute) -> None:
        """``recompute``: the model's layers that checkpoint their activations in the passes that call for it
        (``adapters.trainer.parallelize.apply_activation_checkpointing``). ``shards``: the trainer's group (a plain
        trainer's: world 1)."""
        self.model = model
        self.base = model.base
        """The base model, its LoRA modules routing rows by ``model.router``."""
        self.head = model.head
        self.vocab_size = vocab_size
        self.shards = shards
        self.device = shards.device
        self.recompute = recompute
        self.experts_split = experts_split(model)
        """Whether each shard computes its experts' rows of every shard's tokens (``_expert_share``)."""
        self.keeps_logits = True
        """Whether the pass being run keeps its short datums' logits for backward (``_admit``)."""
        self.packs = packs(model.base)
        """Whether batches run as one packed sequence (``adapters.trainer.packing``), else as padded length buckets."""
        if self.packs:
            use_packed_attention(model.base)

    def hidden(self, data: list[DatumArrays], names: list[str | None]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final hidden states of ``data``, datum ``i`` through adapter ``names[i]`` (None: the base model), packed:
        ``[real tokens, hidden]``, datum after datum (``adapters.trainer.packing``), run inside the sharded model's
        root call (``Shards.through_root``). A family that packs runs one packed sequence; a recurrent one runs
        padded rows in length buckets, one forward each (``_buckets``). And on a sharded trainer's pass that trains,
        each forward's input embeddings as a leaf that needs a gradient, so that every shard's backward reaches the
        first layer (none otherwise). A pass that trains and would not fit in memory raises ``memory.DoesNotFit``
        before it runs (``_admit``)."""
        probes: list[torch.Tensor] = []
        short = sum(d.tokens.size for d in data if d.tokens.size <= self.chunk_positions)
        if self.packs:
            checkpointed = self._admit(sum(d.tokens.size for d in data), short)
            run = lambda: self._packed(data, names, probes, checkpointed)  # noqa: E731
        else:
            real = sum(d.tokens.size for d in data)
            data, names, groups = self._buckets(data, names)
            checkpointed = self._admit(_padded(data, groups), short)
            run = lambda: self._in_rows(data, names, groups, probes, checkpointed)[:real]  # noqa: E731
        return self.shards.through_root(self.base, run), probes

    def _buckets(self, data: list[DatumArrays], names: list[str | None]) -> tuple[
            list[DatumArrays], list[str | None], list[list[int]]]:
        """Length buckets of ``data`` (indices, one padded forward each: ``packing.buckets``). On a sharded trainer
        every shard runs as many forwards as the shard with the most buckets, one with fewer running ``IDLE_ROW``
        for the rest (appended to the data and names returned; ``hidden`` cuts their states from its output): FSDP2
        gathers each layer's weights once per forward, in forward and in backward, so shards that ran different
        numbers of forwards went out of step in their collectives (they hung)."""
        groups = buckets([d.tokens.size for d in data])
        if not self.shards.sharded:
            return data, names, groups
        missing = max(self.shards.everywhere(len(groups))) - len(groups)
        groups += [[len(data) + i] for i in range(missing)]
        return data + [IDLE_ROW] * missing, names + [None] * missing, groups

    def _admit(self, tokens: int, short: int) -> bool:
        """Refuse a pass that trains over ``tokens`` tokens (padding included) whose activations would not fit
        (``ActivationBudget.shortfall``), before it runs: on every shard alike, agreed before the pass's first
        collective, so that a sharded trainer's group goes on (``memory.DoesNotFit``). And decide whether the
        scoring of its ``short`` tokens (of datums of at most one chunk) keeps their logits for backward: only when
        they fit beside the layers' activations, else each chunk of them is recomputed in backward, as a long
        datum's are (a float32 logit per vocabulary entry per token: 590 KiB a token at a 151k vocabulary, more
        than a checkpointed pass keeps in its layers). Returns whether the pass checkpoints its layers: on a sharded
        trainer every shard does if one does (a recomputed layer gathers its weights again, so shards that decided
        apart would run different collectives). The memory free is read once, here, for all three decisions."""
        budget = self.recompute.budget
        self.keeps_logits = True
        if not torch.is_grad_enabled():
            return False
        if self.experts_split:
            tokens = self._expert_share(tokens)
        if budget is None:
            return self.recompute.checkpoints(tokens)
        free = budget.free()
        checkpointed = self.recompute.checkpoints(tokens, free)
        shortfall = budget.shortfall(tokens, checkpointed, free)
        fits, checkpointed = self.shards.agreed_pass(shortfall is None, checkpointed)
        self.keeps_logits = (budget.needed(tokens, checkpointed) + short * self.vocab_size * LOGIT_BYTES
                             <= budget.room(free))
        if fits:
            return checkpointed
        reasons = [f"{reason} (trainer shard {rank})" if self.shards.sharded else reason
                   for rank, reason in enumerate(self.shards.everywhere(shortfall)) if reason]
        raise DoesNotFit(reasons[0])

    def _expert_share(self, tokens: int) -> int:
        """The tokens a shard's pass is budgeted for when the experts are split over the shards: its own, or its even
        share of the batch's, if more. Each shard computes the (token, expert) rows of every shard's tokens routed to
        its experts, so a shard with a short part of the batch (or none: one long datum on another shard) still
        holds the MoE activations of its share of it. A share beyond even (routing that favours one shard's experts)
        is not foreseen."""
        total = self.shards.sum(torch.tensor([float(tokens)], dtype=torch.float64, device=self.device))
        return max(tokens, math.ceil(float(total.item()) / self.shards.world))

    def _packed(self, data: list[DatumArrays], names: list[str | None], probes: list[torch.Tensor],
                checkpointed: bool) -> torch.Tensor:
        lengths = [d.tokens.size for d in data]
        ids = torch.from_numpy(np.concatenate([d.tokens for d in data]).astype(np.int64)).to(self.device)[None]
        packing = Packing(lengths, self.device)
        with self.model.router.routing(names, lengths), self.recompute.for_pass(checkpointed):
            embeds = self._embeds(ids, probes)
            # No cache: a training pass reads none, and a layer recomputed in backward must not append to one twice.
            return self.base.get_decoder()(inputs_embeds=embeds, position_ids=packing.positions, use_cache=False,
                                           packing=packing).last_hidden_state[0]

    def _in_rows(self, data: list[DatumArrays], names: list[str | None], groups: list[list[int]],
                 probes: list[torch.Tensor], checkpointed: bool) -> torch.Tensor:
        pieces: list[torch.Tensor] = []
        order: list[int] = []
        # Every group's activations are kept until the batch's one backward: the batch checkpoints as a whole.
        with self.recompute.for_pass(checkpointed):
            for group in groups:
                rows = [data[i] for i in group]
                out = self._rows(rows, [names[i] for i in group], probes)
                longest = out.shape[1]
                real = torch.cat([torch.arange(d.tokens.size) + r * longest for r, d in enumerate(rows)])
                pieces.append(out.reshape(-1, out.shape[-1]).index_select(0, real.to(out.device)))
                order.extend(group)
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if order == sorted(order):
            return flat
        starts = np.cumsum([0] + [data[i].tokens.size for i in order])
        where = {i: k for k, i in enumerate(order)}
        back = torch.cat([torch.arange(starts[where[i]], starts[where[i] + 1]) for i in range(len(data))])
        return flat.index_select(0, back.to(flat.device))

    def _rows(self, data: list[DatumArrays], names: list[str | None], probes: list[torch.Tensor]) -> torch.Tensor:
        """``[rows, longest, hidden]`` of right-padded rows (padded positions masked out, never read)."""
        longest = max(d.tokens.size for d in data)
        ids = torch.zeros((len(data), longest), dtype=torch.long)
        mask = torch.zeros((len(data), longest), dtype=torch.long)
        for i, d in enumerate(data):
            ids[i, : d.tokens.size] = torch.tensor(d.tokens)
            mask[i, : d.tokens.size] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with self.model.router.routing(names):
            embeds = self._embeds(ids, probes)
            return self.base.get_decoder()(inputs_embeds=embeds, attention_mask=mask, use_cache=False).last_hidden_state

    def _embeds(self, ids: torch.Tensor, probes: list[torch.Tensor]) -> torch.Tensor:
        embeds = self.base.get_input_embeddings()(ids)
        if self.shards.sharded and torch.is_grad_enabled():
            embeds = embeds.detach().requires_grad_(True)
            probes.append(embeds)
        if self.model.tied:
            embeds = with_tied_input_side(embeds, ids, self.head)
        return embeds

    def score(self, data: DatumArrays | None, name: str | None, targets: list[int]) -> list[float] | None:
        """Logprobs of ``targets`` after ``data`` through adapter ``name`` (None: the base model), without
        gradients. On a sharded trainer rank 0 scores the datum and the other shards (``data`` None) take part in
        its forward; a failure of rank 0's own scoring, after it, fails the call on every shard alike."""
        try:
            with torch.no_grad():
                hidden, _ = self.hidden([data if data is not None else IDLE_ROW], [name])
                logprobs, error = None, None
                if data is not None:
                    try:
                        logprobs = self.target_logprobs(hidden, name, torch.tensor(targets, device=self.device))
                    except Exception as exc:  # noqa: BLE001 - said to the other shards, then raised
                        error = exc
        except Exception as exc:
            if self.shards.sharded:  # inside the forward's collectives: the other shards wait for this one
                self.shards.fatal(exc)
            raise
        finally:
            self.shards.settle(self.base)
        if not self.shards.agreed(error is None):
            raise error or RuntimeError("scoring failed on the trainer's rank 0")
        return None if logprobs is None else logprobs.cpu().tolist()

    def target_logprobs(self, hidden: torch.Tensor, name: str | None, targets: torch.Tensor) -> torch.Tensor:
        """Logprobs of ``targets`` (one per position, or ``[positions, k]``) from one datum's final hidden states,
        through ``name``'s output head, computed over at most ``LOGITS_CHUNK_ELEMENTS`` logits at a time."""
        n = hidden.shape[0]
        flat = targets.reshape(n, -1)
        size = self.chunk_positions
        if n <= size:
            return self._score(hidden, flat, name).reshape(targets.shape)
        recompute = torch.is_grad_enabled()
        chunks = [torch.utils.checkpoint.checkpoint(self._score, part, part_targets, name, use_reentrant=False)
                  if recompute else self._score(part, part_targets, name)
                  for part, part_targets in zip(hidden.split(size), flat.split(size), strict=True)]
        return torch.cat(chunks).reshape(targets.shape)

    def target_logprobs_together(self, hiddens: list[torch.Tensor], name: str | None,
                                 targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """``target_logprobs`` of several datums through one adapter's head. Datums of at most one chunk are scored
        together, as many at once as one chunk holds, their logits kept for backward (unless the pass has no room for
        them: ``_admit``); longer ones chunk by chunk. One head matmul over many rows rather than one per datum: measured on CPU, a 32k-vocabulary
        head took 1.4× longer per row over 256 rows than over 2,048 (MKL packs the head's weight once per call)."""
        size = self.chunk_positions
        out: list[torch.Tensor | None] = [None] * len(hiddens)
        group: list[int] = []
        used, width = 0, None

        def flush() -> None:
            if not group:
                return
            rows = torch.cat([hiddens[i] for i in group])
            columns = torch.cat([targets[i].reshape(hiddens[i].shape[0], -1) for i in group])
            if torch.is_grad_enabled() and not self.keeps_logits:
                scored = torch.utils.checkpoint.checkpoint(self._score, rows, columns, name, use_reentrant=False)
            else:
                scored = self._score(rows, columns, name)
            for i, part in zip(group, scored.split([hiddens[i].shape[0] for i in group]), strict=True):
                out[i] = part.reshape(targets[i].shape)
            group.clear()

        for i, (hidden, target) in enumerate(zip(hiddens, targets, strict=True)):
            n = hidden.shape[0]
            if n > size:
                out[i] = self.target_logprobs(hidden, name, target)
                continue
            k = target.reshape(n, -1).shape[1]
            if group and (used + n > size or k != width):
                flush()
                used = 0
            group.append(i)
            used, width = used + n, k
        flush()
        return out  # type: ignore[return-value]

    @property
    def chunk_positions(self) -> int:
        """Positions whose logits one chunk holds (``LOGITS_CHUNK_ELEMENTS``)."""
        return max(1, LOGITS_CHUNK_ELEMENTS // self.vocab_size)

    def _score(self, hidden: torch.Tensor, targets: torch.Tensor, name: str | None) -> torch.Tensor:
        """Logprobs of ``targets`` (``[positions, k]``) after ``hidden`` through ``name``'s head, in float32."""
        return target_logprobs(self.head.with_adapter(hidden, name).float(), targets)


def _padded(data: list[DatumArrays], groups: list[list[int]]) -> int:
    """Positions a pass of padded ``groups`` of ``data`` computes: each group is as long as its longest datum."""
    return sum(len(group) * max(data[i].tokens.size for i in group) for group in groups)
