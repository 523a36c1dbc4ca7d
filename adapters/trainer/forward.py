"""The trainer's forward (and backward) pass: several runs' requests as one mixed-adapter batch through the base model.

Every row goes through its own run's adapter (``adapters.lora.routing`` routes rows by adapter), each request's loss
is computed on its own rows, and one backward adds each run's gradient to that run only. How the model itself is
run — a batch's hidden states, a datum's logprobs in chunks — is ``adapters.trainer.passes``.

On a sharded trainer (``adapters.trainer.shards``) each shard runs the datums the batch assigns it, and the shards
combine what belongs to a request as a whole: its loss, whether it failed, its custom-loss metrics and the adapters'
gradients; rank 0 answers with every datum's output.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from adapters.trainer.interface import ModelFacts, StepRequest, StepResult
from adapters.trainer.memory import DoesNotFit
from adapters.trainer.passes import IDLE_ROW, ModelPasses
from adapters.trainer.table import Adapter, AdapterTable
from shims.custom_loss.batch import CustomLossBatch, combined_metrics
from shims.custom_loss.run import check_custom_datum
from shims.errors import UserError
from shims.losses import check_datum, datum_loss, resolve_config

log = logging.getLogger("compat_server.trainer")

Ready = tuple[int, StepRequest, Adapter, dict]
"""A request that passed its checks: its index in the batch, itself, its run's adapter, its loss config."""


@dataclass
class _Part:
    """What one shard computed of one request: its datums' summed loss and outputs, or its error."""

    total: torch.Tensor | None = None
    loss: float = 0.0
    outputs: dict[int, np.ndarray] = field(default_factory=dict)
    """By the datum's index within the request."""
    logprobs: list[torch.Tensor] = field(default_factory=list)
    """Its datums' target logprobs, where a custom loss's own backward ends."""
    custom: CustomLossBatch | None = None
    """A custom loss over the datums here, with their metrics."""
    error: UserError | Exception | None = None


class MixedForward:
    """Runs forward / forward_backward requests of the table's runs on one base model, for ``MultiLoRATrainer``."""

    def __init__(self, passes: ModelPasses, table: AdapterTable, facts: ModelFacts) -> None:
        self.passes = passes
        """How the base model and its adapters are run (``adapters.trainer.passes``)."""
        self.shards = passes.shards
        self.device = passes.device
        self.table = table
        self.facts = facts

    def run(self, requests: list[StepRequest]) -> list[StepResult | UserError]:
        """Run several requests — of any adapters, ranks and losses on this base model — as one mixed-adapter batch:
        each row goes through its own adapter, each request's loss is computed on its own rows, and one backward adds
        each adapter's gradient to that adapter only, exactly as running it alone would. A request that is invalid,
        or whose loss is not finite, gets its own error and adds nothing; the others still run. ``forward_only``
        requests share the forward and add no gradient. A sharded trainer's shards other than rank 0 return None for
        every request (rank 0 answers)."""
        started = time.perf_counter()
        outcomes: list[StepResult | UserError | None] = [None] * len(requests)
        ready: list[Ready] = []
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
        if not self.shards.writes:
            return [None] * len(requests)  # type: ignore[list-item]
        return outcomes  # type: ignore[return-value]

    def _run_isolated(self, ready: list[Ready], outcomes: list[StepResult | UserError | None],
                      started: float) -> None:
        """Run ``ready`` as one batch. Whatever one request does to the shared passes — an input the forward cannot
        take, memory it runs out of — the batch then added no gradient anywhere (``_run_mixed`` adds them only once
        everything succeeded), and each request runs again alone: only the one that fails gets an error, and every
        other gets exactly what it gets alone. A sharded trainer does so only for a batch refused before its pass
        because its activations would not fit (``memory.DoesNotFit``, agreed by every shard); any other failure
        leaves its other shards waiting in the pass that failed (``Shards.fatal``)."""
        try:
            self._run_mixed(ready, outcomes, started)
            return
        except Exception as exc:  # noqa: BLE001 - which request caused it is found by running them apart
            if self.shards.sharded and not isinstance(exc, DoesNotFit):  # that one every shard met, before the pass
                self.shards.fatal(exc)
            failure = exc
        finally:
            self.shards.settle(self.passes.base)
        if len(ready) == 1:
            index, request, _, _ = ready[0]
            outcomes[index] = _failed(request, failure)
            return
        log.warning("a mixed batch of %d requests failed (%s: %s); running them one by one", len(ready),
                    type(failure).__name__, str(failure)[:200])
        del failure  # its traceback holds the failed batch's activations
        for item in ready:
            self._run_isolated([item], outcomes, started)

    def _run_mixed(self, ready: list[Ready], outcomes: list[StepResult | UserError | None], started: float) -> None:
        """One forward over this shard's datums of the batch, each request's loss on its own rows, the requests'
        failures agreed on by every shard, one backward for the requests that train, and (on rank 0) every request's
        outcome from what every shard computed of it."""
        # The batch's datums in row order, and the ones this shard runs (all of them on a plain trainer).
        datums = [(position, offset) for position, (_, request, _, _) in enumerate(ready)
                  for offset in range(len(request.data))]
        mine = self.shards.mine([ready[p][1].data[o].tokens.size for p, o in datums])
        trains = not all(request.forward_only for _, request, _, _ in ready)
        parts = [_Part() for _ in ready]
        with torch.set_grad_enabled(trains):
            rows = [ready[datums[i][0]][1].data[datums[i][1]] for i in mine] or [IDLE_ROW]
            names = [ready[datums[i][0]][2].name for i in mine] or [None]
            hidden, probes = self.passes.hidden(rows, names)
            # One split into datums (a single backward node), never a slice per datum: a slice's gradient is the
            # whole batch's size, which made backward quadratic in the number of datums.
            pieces = hidden.split([rows[row].tokens.size for row in range(len(mine))]) if mine else ()
            scores = self._scores(ready, [datums[i] for i in mine], pieces)
            for row, i in enumerate(mine):
                position, offset = datums[i]
                part = parts[position]
                if part.error is None:
                    self._datum_loss(ready[position], offset, pieces[row], part, scores.get(row))
            for position, part in enumerate(parts):
                self._close_part(ready[position][1], part)
            failed, losses = self._agree(parts)
            learning: list[torch.nn.Parameter] = []
            held: set[int] = set()
            trained = []
            for position, (_, request, adapter, _) in enumerate(ready):
                if failed[position] or request.forward_only:
                    continue
                held.update(id(adapter.params[i]) for i in adapter.held)
                learning.extend(adapter.params)
                if parts[position].total is not None:
                    trained.append(parts[position].total)
            if learning:
                self._backward(trained, learning, held, hidden, probes)
        answers = self.shards.gather([(p.outputs, p.custom.tally() if p.custom else None,
                                       p.error if failed[i] else None) for i, p in enumerate(parts)])
        if answers is None:
            return
        seconds = time.perf_counter() - started
        for position, (index, request, _, _) in enumerate(ready):
            shares = [answer[position] for answer in answers]
            if failed[position]:
                outcomes[index] = next((error for _, _, error in shares if error is not None), None) or UserError(
                    f"the loss is not finite ({losses[position]}); check the loss inputs")
                continue
            outputs = {offset: lp for share in shares for offset, lp in share[0].items()}
            tallies = [share[1] for share in shares if share[1] is not None]
            metrics = {**(combined_metrics(tallies) if request.custom_loss is not None else {}),
                       "loss:sum": losses[position]}
            outcomes[index] = StepResult(outputs=[{"logprobs": outputs[i]} for i in range(len(request.data))],
                                         metrics=metrics, seconds=seconds,
                                         num_tokens=int(sum(d.tokens.size for d in request.data)))

    def _scores(self, ready: list[Ready], rows: list[tuple[int, int]],
                hidden: tuple[torch.Tensor, ...]) -> dict[int, torch.Tensor]:
        """The target logprobs of ``rows`` (request position, datum offset; row i of ``hidden``), each request's
        datums scored together (``ModelPasses.target_logprobs_together``), by row. A request whose targets or
        scoring fail is left out: its datums are scored one by one in ``_datum_loss``, where the failure is that
        request's own."""
        by_request: dict[int, list[int]] = {}
        for row, (position, _) in enumerate(rows):
            by_request.setdefault(position, []).append(row)
        scores: dict[int, torch.Tensor] = {}
        for position, mine in by_request.items():
            _, request, adapter, _ = ready[position]
            data = [request.data[rows[row][1]] for row in mine]
            try:
                targets = [torch.tensor(d.loss_fn_inputs["target_tokens"], device=self.device) for d in data]
                scored = self.passes.target_logprobs_together(
                    [hidden[row] for row in mine], adapter.name, targets)
            except Exception:  # noqa: BLE001, S112 - said by _datum_loss, which scores each datum alone
                continue
            scores.update(zip(mine, scored, strict=True))
        return scores

    def _datum_loss(self, item: Ready, offset: int, hidden: torch.Tensor, part: _Part,
                    target_logprobs: torch.Tensor | None = None) -> None:
        """Add one datum's loss and output to its request's part (its target logprobs scored here unless given);
        a failure of its loss (a custom loss the client got wrong, or a server error of this request alone) is
        recorded as the part's error."""
        _, request, adapter, config = item
        d = request.data[offset]
        custom = request.custom_loss
        try:
            if target_logprobs is None:
                targets = torch.tensor(d.loss_fn_inputs["target_tokens"], device=self.device)
                target_logprobs = self.passes.target_logprobs(hidden, adapter.name, targets)
            inputs = {k: torch.tensor(v, device=self.device) for k, v in d.loss_fn_inputs.items()}
            if custom is not None:
                part.custom = part.custom or CustomLossBatch(custom, self.device)
                loss = part.custom.datum(target_logprobs, inputs)
            else:
                loss = datum_loss(request.loss_fn, target_logprobs, inputs, config)
        except Exception as exc:  # noqa: BLE001 - this request's own failure (the shared forward is done)
            part.error = _failed(request, exc.with_traceback(None))  # not the activations its frames hold
            return
        part.total = loss if part.total is None else part.total + loss
        part.logprobs.append(target_logprobs)
        part.outputs[offset] = target_logprobs.detach().float().cpu().numpy()

    def _close_part(self, request: StepRequest, part: _Part) -> None:
        """Check what can only be checked of a request's loss as a whole on this shard: that a custom loss that
        trains depends on the logprobs, and that its backward runs (the client's code, which must fail alone here
        rather than inside the shared backward)."""
        if part.error is not None or part.total is None:
            return
        part.loss = float(part.total.detach())
        custom = request.custom_loss
        if request.forward_only or custom is None:
            return
        if not part.total.requires_grad:
            part.error = UserError(f"custom loss {custom.name!r} does not depend on logprobs, so it has no gradient")
            return
        try:  # through the loss's own steps only, down to the logprobs, once, within the request's time
            grads = part.custom.gradients(part.total, part.logprobs)
        except Exception as exc:  # noqa: BLE001 - the client's loss failed in backward, or ran out of time
            part.error = _failed(request, exc)
            return
        # The shared backward starts from the logprobs: a surrogate whose gradient is the loss's, so the client's
        # loss graph never runs backward again (nor unbounded) inside the shared backward.
        used = [(lp * g).sum() for lp, g in zip(part.logprobs, grads, strict=True) if g is not None]
        if not used:
            part.error = UserError(f"custom loss {custom.name!r} does not depend on logprobs, so it has no gradient")
            return
        part.total = torch.stack(used).sum()

    def _agree(self, parts: list[_Part]) -> tuple[list[bool], list[float]]:
        """Which requests failed on any shard, or have a loss that is not finite, and each request's loss summed
        over the shards: the same answer on every shard, so that every shard leaves the same requests out of the
        backward."""
        status = torch.zeros((len(parts), 2), dtype=torch.float64, device=self.device)
        for i, part in enumerate(parts):
            status[i, 0] = part.loss if part.error is None else 0.0
            status[i, 1] = part.error is not None
        status = self.shards.sum(status).cpu()
        losses = status[:, 0].tolist()
        return [bool(status[i, 1] > 0) or not math.isfinite(losses[i]) for i in range(len(parts))], losses

    def _backward(self, trained: list[torch.Tensor], learning: list[torch.nn.Parameter], held: set[int],
                  hidden: torch.Tensor, probes: list[torch.Tensor]) -> None:
        """Gradients of the learning adapters only (the layers concatenate every adapter's rows, so a plain backward
        would also reach the adapters only being read), summed over the shards and added to theirs only once the
        whole backward has succeeded. A sharded trainer's shards all go through every layer of every forward
        (``probes``), also one whose datums train nothing, for the collectives of the layers' backward. An expert's
        share of a pair (``held``: ids of such parameters) has its whole gradient on its own shard: not summed."""
        root = torch.stack(trained).sum() if trained else hidden.sum() * 0.0
        inputs = learning + probes
        grads = list(torch.autograd.grad(root, inputs, allow_unused=True))[: len(learning)]
        if self.shards.world > 1:  # every shard sums the same list, a gradient it has none of as zeros
            grads = [g if g is not None else torch.zeros_like(p) for p, g in zip(learning, grads, strict=True)]
            self.shards.sum_all([g for p, g in zip(learning, grads, strict=True) if id(p) not in held])
        with torch.no_grad():
            for param, grad in zip(learning, grads, strict=True):
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad.contiguous()
                else:
                    param.grad += grad


def _failed(request: StepRequest, exc: Exception) -> UserError | Exception:
    """What a request that failed on its own gets: a user error when its custom loss (the client's code) failed
    outside the interpreter's checks, in backward for instance; otherwise the failure itself, a server error."""
    if isinstance(exc, UserError):
        return exc
    if request.custom_loss is not None:
        return UserError(f"custom loss {request.custom_loss.name!r} failed: {type(exc).__name__}: {exc}")
    return RuntimeError(f"{type(exc).__name__}: {exc}")
