"""The trainer's forward (and backward) pass: several runs' requests as one mixed-adapter batch through the base model.

Every row goes through its own run's adapter (``adapters.lora.layers`` routes rows by adapter), each request's loss
is computed on its own rows, and one backward adds each run's gradient to that run only. Scoring stays chunked so
that a long datum never holds all of its logits at once.
"""

from __future__ import annotations

import math
import time

import torch

from adapters.lora.layers import LoRALinear, Router, with_tied_input_side
from adapters.trainer.interface import ModelFacts, StepRequest, StepResult
from adapters.trainer.table import Adapter, AdapterTable
from shims.custom_loss.run import CustomLossBatch, check_custom_datum
from shims.errors import UserError
from shims.losses import check_datum, datum_loss, resolve_config
from shims.tinker.training_wire import DatumArrays

LOGITS_CHUNK_ELEMENTS = 1 << 26
"""At most this many logits (positions × vocabulary) exist at once per datum: 256 MiB in float32, ~440 positions at a
151k vocabulary. Longer datums are scored chunk by chunk, each chunk's logits recomputed in backward instead of kept."""


class MixedForward:
    """Runs forward / forward_backward requests of the table's runs on one base model, for ``MultiLoRATrainer``."""

    def __init__(self, base: torch.nn.Module, router: Router, tied: bool, table: AdapterTable, facts: ModelFacts,
                 device: torch.device) -> None:
        self.base = base
        """The base model, its layers wrapped (``adapters.lora.layers.wrap_linears``) to route rows by ``router``."""
        self.router = router
        self.tied = tied
        """One matrix embeds tokens and unembeds them: an unembedding LoRA then acts on both sides."""
        self.head: LoRALinear = base.get_output_embeddings()
        self.table = table
        self.facts = facts
        self.device = device

    def run(self, requests: list[StepRequest]) -> list[StepResult | UserError]:
        """Run several requests — of any adapters, ranks and losses on this base model — as one mixed-adapter batch:
        each row goes through its own adapter, each request's loss is computed on its own rows, and one backward adds
        each adapter's gradient to that adapter only, exactly as running it alone would. A request that is invalid,
        or whose loss is not finite, gets its own error and adds nothing; the others still run. ``forward_only``
        requests share the forward and add no gradient."""
        started = time.perf_counter()
        outcomes: list[StepResult | UserError | None] = [None] * len(requests)
        ready: list[tuple[int, StepRequest, Adapter, dict]] = []
        for index, request in enumerate(requests):
            try:
                adapter = self.table.get_run(request.model_id)
                custom = request.custom_loss
                config = resolve_config(request.loss_fn, request.loss_fn_config) if custom is None else {}
                for i, d in enumerate(request.data):
                    if custom is not None:
                        check_custom_datum(custom, i, d.tokens, d.loss_fn_inputs, vocab_size=self.facts.vocab_size,
                                           max_context=self.facts.max_context)
                    else:
                        check_datum(request.loss_fn, i, d.tokens, d.loss_fn_inputs,
                                    vocab_size=self.facts.vocab_size, max_context=self.facts.max_context)
            except UserError as exc:
                outcomes[index] = exc
                continue
            ready.append((index, request, adapter, config))
        if ready:
            ready.sort(key=lambda item: item[2].name)  # each adapter's rows become one slice (adapters.lora.layers)
            self._run_mixed(ready, outcomes, started)
        return outcomes  # type: ignore[return-value]

    def _run_mixed(self, ready: list[tuple[int, StepRequest, Adapter, dict]],
                   outcomes: list[StepResult | UserError | None], started: float) -> None:
        data = [d for _, request, _, _ in ready for d in request.data]
        names = [adapter.name for _, request, adapter, _ in ready for _ in request.data]
        with torch.set_grad_enabled(not all(request.forward_only for _, request, _, _ in ready)):
            hidden = self.hidden_states(data, names)
            row, trained, learning = 0, [], set()
            for index, request, adapter, config in ready:
                total = torch.zeros((), device=self.device)
                outputs = []
                custom = CustomLossBatch(request.custom_loss) if request.custom_loss is not None else None
                first, row = row, row + len(request.data)
                try:
                    for offset, d in enumerate(request.data):
                        targets = torch.tensor(d.loss_fn_inputs["target_tokens"], device=self.device)
                        target_logprobs = self.target_logprobs(hidden[first + offset, : d.tokens.size],
                                                                adapter.name, targets)
                        inputs = {k: torch.tensor(v, device=self.device) for k, v in d.loss_fn_inputs.items()}
                        total = total + (custom.datum(target_logprobs, inputs) if custom is not None else
                                         datum_loss(request.loss_fn, target_logprobs, inputs, config))
                        outputs.append({"logprobs": target_logprobs.detach().float().cpu().numpy()})
                except UserError as exc:  # a custom loss's own failure: this request's error, not the batch's
                    outcomes[index] = exc
                    continue
                loss = float(total.detach())
                if not math.isfinite(loss):  # before backward: a bad request must not touch accumulated gradients
                    outcomes[index] = UserError(f"the loss is not finite ({loss}); check the loss inputs")
                    continue
                if not request.forward_only and custom is not None and not total.requires_grad:
                    outcomes[index] = UserError(f"custom loss {custom.loss.name!r} does not depend on logprobs, so "
                                                "it has no gradient")
                    continue
                if not request.forward_only:
                    trained.append(total)
                    learning.add(request.model_id)
                metrics = {**(custom.metrics() if custom is not None else {}), "loss:sum": loss}
                outcomes[index] = StepResult(outputs=outputs, metrics=metrics,
                                             num_tokens=int(sum(d.tokens.size for d in request.data)), seconds=0.0)
            if trained:
                # The layers concatenate every adapter's rows, so autograd also reaches the adapters only being read
                # here, with exact zeros; their gradient state must stay as it was (None stays None).
                reading = [p for _, request, adapter, _ in ready if request.model_id not in learning
                           for p in adapter.params if p.grad is None]
                torch.stack(trained).sum().backward()
                for p in reading:
                    p.grad = None
        seconds = time.perf_counter() - started
        for index, _, _, _ in ready:
            if isinstance(outcomes[index], StepResult):
                outcomes[index].seconds = seconds

    def hidden_states(self, data: list[DatumArrays], names: list[str] | None) -> torch.Tensor:
        """Final hidden states of a right-padded batch, row ``i`` through adapter ``names[i]`` (None: the base
        model); padded positions are masked out and never read."""
        longest = max(d.tokens.size for d in data)
        ids = torch.zeros((len(data), longest), dtype=torch.long)
        mask = torch.zeros((len(data), longest), dtype=torch.long)
        for i, d in enumerate(data):
            ids[i, : d.tokens.size] = torch.tensor(d.tokens)
            mask[i, : d.tokens.size] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with self.router.routing(names):
            embeds = self.base.get_input_embeddings()(ids)
            if self.tied:
                embeds = with_tied_input_side(embeds, ids, self.head)
            return self.base.get_decoder()(inputs_embeds=embeds, attention_mask=mask).last_hidden_state

    def target_logprobs(self, hidden: torch.Tensor, name: str | None, targets: torch.Tensor) -> torch.Tensor:
        """Logprobs of ``targets`` (one per position, or ``[positions, k]``) from one datum's final hidden states,
        through ``name``'s output head, computed over at most ``LOGITS_CHUNK_ELEMENTS`` logits at a time."""
        n = hidden.shape[0]
        flat = targets.reshape(n, -1)
        head = self.head

        def score(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(head.with_adapter(h, name).float(), dim=-1).gather(1, t)

        size = max(1, LOGITS_CHUNK_ELEMENTS // self.facts.vocab_size)
        if n <= size:
            return score(hidden, flat).reshape(targets.shape)
        recompute = torch.is_grad_enabled()
        chunks = [torch.utils.checkpoint.checkpoint(score, hidden[i:i + size], flat[i:i + size], use_reentrant=False)
                  if recompute else score(hidden[i:i + size], flat[i:i + size]) for i in range(0, n, size)]
        return torch.cat(chunks).reshape(targets.shape)
