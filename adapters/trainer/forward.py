"""The trainer's forward (and backward) pass: several runs' requests as one mixed-adapter batch through the base model.

Every row goes through its own run's adapter (``adapters.lora.routing`` routes rows by adapter), each request's loss
is computed on its own rows, and one backward adds each run's gradient to that run only. Scoring stays chunked so
that a long datum never holds all of its logits at once.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from adapters.lora.linear import with_tied_input_side
from adapters.lora.model import LoRAModel
from adapters.trainer.interface import ModelFacts, StepRequest, StepResult
from adapters.trainer.recompute import LayerRecompute
from adapters.trainer.table import Adapter, AdapterTable
from shims.custom_loss.run import CustomLossBatch, check_custom_datum
from shims.errors import UserError
from shims.losses import check_datum, datum_loss, resolve_config
from shims.tinker.training_wire import DatumArrays

log = logging.getLogger("compat_server.trainer")

LOGITS_CHUNK_ELEMENTS = 1 << 26
"""At most this many logits (positions × vocabulary) exist at once per datum: 256 MiB in float32, ~440 positions at a
151k vocabulary. Longer datums are scored chunk by chunk, each chunk's logits recomputed in backward instead of kept."""


class MixedForward:
    """Runs forward / forward_backward requests of the table's runs on one base model, for ``MultiLoRATrainer``."""

    def __init__(self, model: LoRAModel, table: AdapterTable, facts: ModelFacts, device: torch.device,
                 recompute_tokens: int = 0) -> None:
        """``recompute_tokens``: passes that train over at least this many tokens checkpoint each decoder layer
        (``adapters.trainer.recompute``; 0: never)."""
        self.model = model
        self.recompute = LayerRecompute(model.base, model.router, recompute_tokens)
        """The base model, its LoRA modules routing rows by ``model.router``."""
        self.base = model.base
        self.head = model.head
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
            ready.sort(key=lambda item: item[2].name)  # each adapter's rows become one slice (adapters.lora.routing)
            self._run_isolated(ready, outcomes, started)
        return outcomes  # type: ignore[return-value]

    def _run_isolated(self, ready: list[tuple[int, StepRequest, Adapter, dict]],
                      outcomes: list[StepResult | UserError | None], started: float) -> None:
        """Run ``ready`` as one batch. Whatever one request does to the shared passes — a loss whose backward raises,
        an input the forward cannot take, memory it runs out of — the batch then added no gradient anywhere
        (``_run_mixed`` adds them only once everything succeeded), and each request runs again alone: only the one
        that fails gets an error, and every other gets exactly what it gets alone."""
        try:
            self._run_mixed(ready, outcomes, started)
            return
        except Exception as exc:  # noqa: BLE001 - which request caused it is found by running them apart
            failure = exc
        if len(ready) == 1:
            index, request, _, _ = ready[0]
            outcomes[index] = _failed(request, failure)
            return
        log.warning("a mixed batch of %d requests failed (%s: %s); running them one by one", len(ready),
                    type(failure).__name__, str(failure)[:200])
        del failure  # its traceback holds the failed batch's activations
        for item in ready:
            self._run_isolated([item], outcomes, started)

    def _run_mixed(self, ready: list[tuple[int, StepRequest, Adapter, dict]],
                   outcomes: list[StepResult | UserError | None], started: float) -> None:
        data = [d for _, request, _, _ in ready for d in request.data]
        names = [adapter.name for _, request, adapter, _ in ready for _ in request.data]
        with torch.set_grad_enabled(not all(request.forward_only for _, request, _, _ in ready)):
            hidden = self.hidden_states(data, names)
            row, trained, learning = 0, [], []
            for index, request, adapter, config in ready:
                first, row = row, row + len(request.data)
                try:
                    total, result = self._request_loss(request, adapter, config, hidden[first:row])
                except UserError as exc:  # this request's own failure, not the batch's
                    outcomes[index] = exc
                    continue
                if not request.forward_only:
                    trained.append(total)
                    learning.extend(adapter.params)
                outcomes[index] = result
            if trained:
                # Gradients of the learning adapters only (the layers concatenate every adapter's rows, so a plain
                # backward would also reach the adapters only being read), added to theirs only once the whole
                # backward has succeeded: a failing backward leaves every adapter's gradient as it was.
                grads = torch.autograd.grad(torch.stack(trained).sum(), learning, allow_unused=True)
                with torch.no_grad():
                    for param, grad in zip(learning, grads, strict=True):
                        if grad is None:
                            continue
                        if param.grad is None:
                            param.grad = grad.contiguous()
                        else:
                            param.grad += grad
        seconds = time.perf_counter() - started
        for index, _, _, _ in ready:
            if isinstance(outcomes[index], StepResult):
                outcomes[index].seconds = seconds

    def _request_loss(self, request: StepRequest, adapter: Adapter, config: dict,
                      hidden: torch.Tensor) -> tuple[torch.Tensor, StepResult]:
        """One request's summed loss over its rows of ``hidden``, and its result; a ``UserError`` for a loss the
        client got wrong (a custom loss that fails, or makes a loss that is not finite or has no gradient)."""
        custom = CustomLossBatch(request.custom_loss) if request.custom_loss is not None else None
        total = torch.zeros((), device=self.device)
        outputs = []
        try:
            for offset, d in enumerate(request.data):
                targets = torch.tensor(d.loss_fn_inputs["target_tokens"], device=self.device)
                target_logprobs = self.target_logprobs(hidden[offset, : d.tokens.size], adapter.name, targets)
                inputs = {k: torch.tensor(v, device=self.device) for k, v in d.loss_fn_inputs.items()}
                total = total + (custom.datum(target_logprobs, inputs) if custom is not None else
                                 datum_loss(request.loss_fn, target_logprobs, inputs, config))
                outputs.append({"logprobs": target_logprobs.detach().float().cpu().numpy()})
            loss = float(total.detach())
            metrics = {**(custom.metrics() if custom is not None else {}), "loss:sum": loss}
        except UserError:
            raise
        except Exception as exc:
            if custom is None:
                raise
            raise _failed(request, exc) from None
        if not math.isfinite(loss):  # before backward: a bad request must not touch accumulated gradients
            raise UserError(f"the loss is not finite ({loss}); check the loss inputs")
        if not request.forward_only and custom is not None and not total.requires_grad:
            raise UserError(f"custom loss {custom.loss.name!r} does not depend on logprobs, so it has no gradient")
        return total, StepResult(outputs=outputs, metrics=metrics,
                                 num_tokens=int(sum(d.tokens.size for d in request.data)), seconds=0.0)

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
        with self.model.router.routing(names), self.recompute.for_pass(ids.numel()):
            embeds = self.base.get_input_embeddings()(ids)
            if self.model.tied:
                embeds = with_tied_input_side(embeds, ids, self.head)
            # No cache: a training pass reads none, and a layer recomputed in backward must not append to one twice.
            return self.base.get_decoder()(inputs_embeds=embeds, attention_mask=mask, use_cache=False).last_hidden_state

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


def _failed(request: StepRequest, exc: Exception) -> UserError | Exception:
    """What a request that failed on its own gets: a user error when its custom loss (the client's code) failed
    outside the interpreter's checks, in backward for instance; otherwise the failure itself, a server error."""
    if isinstance(exc, UserError):
        return exc
    if request.custom_loss is not None:
        return UserError(f"custom loss {request.custom_loss.name!r} failed: {type(exc).__name__}: {exc}")
    return RuntimeError(f"{type(exc).__name__}: {exc}")
