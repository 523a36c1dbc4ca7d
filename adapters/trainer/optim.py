"""The trainer's optimizer steps: several runs' ``optim_step`` in one call, and AdamW over all of their parameters
at once.

Each run keeps its own optimizer (its state, step count and hyperparameters are its own, and are what a checkpoint
saves). When several AdamW runs step together with the same hyperparameters, their parameters go through torch's
AdamW in one foreach (fused on CUDA) call instead of one call per run: on a GPU a small run's step is a few hundred
kernel launches, the same for 1 run or 64. Element by element it is the same arithmetic, so each run's result equals
its own ``optimizer.step()`` exactly (``tests/test_trainer_optim.py``).

On a sharded trainer each shard's optimizers step only its share of each run's parameters (``Adapter.owned``), so a
run's moments are held once across the shards; ``share`` then hands every shard the stepped weights.
"""

from __future__ import annotations

import math
from dataclasses import astuple

import torch
from torch.optim.adam import adam

from adapters.trainer.interface import OPTIMIZERS, AdamHyper, DimuonHyper, OptimRequest
from adapters.trainer.shards import Shards
from adapters.trainer.table import Adapter, AdapterTable
from shims.errors import UserError


class Optimizers:
    """The optimizer steps of the table's runs, for ``MultiLoRATrainer``."""

    def __init__(self, table: AdapterTable, shards: Shards) -> None:
        """``shards``: the trainer's (a plain trainer's is alone); a sharded trainer's shards each step their share
        of a run's parameters (``Adapter.owned``) and then share the stepped weights (``share``)."""
        self.table = table
        self.shards = shards

    def optim_step(self, model_id: str, hyper: AdamHyper | DimuonHyper) -> dict[str, float]:
        """Apply the accumulated gradient with the run's optimizer (AdamW with decoupled weight decay, or Dimuon),
        then clear it."""
        outcome = self.optim_steps([OptimRequest(model_id, hyper)])[0]
        if isinstance(outcome, UserError):
            raise outcome
        return outcome

    def optim_steps(self, requests: list[OptimRequest]) -> list[dict[str, float] | Exception]:
        """Several runs' optim steps (each run at most once); one outcome per request, in order: its metrics, or the
        ``UserError`` that request alone gets (the others still step). On a sharded trainer the user errors are the
        same on every shard (their gradients are), and any other failure of a shard's own step ends the group, as a
        failed shared pass does (``Shards.fatal``): the shards would otherwise share weights some did not step."""
        try:
            return self._steps(requests)
        except Exception as exc:
            if self.shards.world > 1:
                self.shards.fatal(exc)
            raise

    def _steps(self, requests: list[OptimRequest]) -> list[dict[str, float] | Exception]:
        outcomes: list[dict[str, float] | Exception] = []
        together: dict[tuple, list[Adapter]] = {}
        stepped: dict[str, tuple[Adapter, dict[str, float]]] = {}
        for request in requests:
            try:
                if request.model_id in stepped:  # the scheduler sends one request per run at a time; never step twice
                    raise UserError(f"model {request.model_id} already steps in this batch")
                adapter, grad_norm = self._clipped(request)
            except UserError as exc:
                outcomes.append(exc)
                continue
            hyper = request.hyper
            if isinstance(hyper, AdamHyper):  # ``_clipped`` checked that the run's optimizer is AdamW
                together.setdefault(astuple(hyper), []).append(adapter)
            else:
                for group in adapter.optimizer.param_groups:
                    group.update(lr=hyper.learning_rate, beta1=hyper.beta1)
                adapter.optimizer.step()
            metrics = {"grad_norm": grad_norm, "learning_rate": hyper.learning_rate}
            stepped[request.model_id] = (adapter, metrics)
            outcomes.append(metrics)
        sharded = self.shards.world > 1
        for hyper_fields, adapters in together.items():
            try:
                adamw_together([a.optimizer for a in adapters], AdamHyper(*hyper_fields))
            except Exception as exc:
                if sharded:
                    raise
                failed = {id(a) for a in adapters}  # those runs alone did not step; the others' steps stand
                for model_id, (adapter, _) in list(stepped.items()):
                    if id(adapter) in failed:
                        del stepped[model_id]
                        outcomes[[r.model_id for r in requests].index(model_id)] = RuntimeError(
                            f"the optimizer step failed and was not counted: {type(exc).__name__}: {exc}")
        self.share([adapter for adapter, _ in stepped.values()])
        for adapter, metrics in stepped.values():
            clear_grads(adapter)
            adapter.step += 1
            metrics["step"] = float(adapter.step)
        return outcomes

    def share(self, adapters: list[Adapter]) -> None:
        """On a sharded trainer, after each shard stepped its share of these runs' parameters: every shard gets every
        stepped weight — one sum over the shards, each weight counted by its owner alone (the others add zeros)."""
        if self.shards.world == 1 or not adapters:
            return
        with torch.no_grad():
            weights = []
            for adapter in adapters:
                owned = set(adapter.owned or ())
                for index in adapter.whole():  # an expert's share (``held``) is its shard's alone
                    param = adapter.params[index]
                    if index not in owned:
                        param.zero_()
                    weights.append(param)
            self.shards.sum_all(weights)

    def _clipped(self, request: OptimRequest) -> tuple[Adapter, float]:
        """The run, after checking the request and clipping its gradient; and the gradient's norm before clipping.
        A non-finite gradient is discarded."""
        hyper = request.hyper
        hyper.validate()
        adapter = self.table.get_run(request.model_id)
        if not isinstance(hyper, OPTIMIZERS[adapter.spec.optimizer]):
            raise UserError(f"this training run uses the {adapter.spec.optimizer} optimizer (chosen when it was "
                            f"created): send {'AdamParams' if adapter.spec.optimizer == 'adamw' else 'DimuonParams'}")
        trained = [p for p in adapter.params if p.grad is not None]
        grad_norm = self._norm(adapter)
        if not math.isfinite(grad_norm):
            clear_grads(adapter)
            raise UserError(f"the accumulated gradient is not finite (norm {grad_norm}); it was discarded and the "
                            "weights were not changed")
        if hyper.grad_clip_norm > 0 and trained:  # scales each parameter's ``.grad`` in place
            torch.nn.utils.clip_grads_with_norm_(trained, hyper.grad_clip_norm,
                                                 torch.tensor(grad_norm, device=trained[0].device))
        return adapter, grad_norm

    def _norm(self, adapter: Adapter) -> float:
        """The norm of the run's whole gradient: on a sharded trainer whose experts are split (``Adapter.held``),
        of every shard's experts' gradients too (a collective: every shard asks for the same runs in turn)."""
        if not adapter.held:
            grads = [p.grad for p in adapter.params if p.grad is not None]
            return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        whole = [adapter.params[i].grad for i in adapter.whole() if adapter.params[i].grad is not None]
        held = [adapter.params[i].grad for i in adapter.held if adapter.params[i].grad is not None]
        squares = torch.zeros(2, dtype=torch.float64, device=self.shards.device)
        if held:
            squares[0] = torch.nn.utils.get_total_norm(held).double() ** 2
        squares = self.shards.sum(squares)
        if whole:  # the same on every shard
            squares[1] = torch.nn.utils.get_total_norm(whole).double() ** 2
        return float(squares.sum().sqrt())


def clear_grads(adapter: Adapter) -> None:
    """Drop every accumulated gradient of the run (its optimizer's ``zero_grad`` reaches only the parameters it
    steps)."""
    for param in adapter.params:
        param.grad = None


@torch.no_grad()
def adamw_together(optimizers: list[torch.optim.AdamW], hyper: AdamHyper) -> None:
    """``optimizer.step()`` of every optimizer in one call of torch's AdamW over all their parameters, with
    ``hyper`` set on each (so each one's state and hyperparameters are exactly what its own step would leave).
    All are foreach, or all fused (the trainer makes them so per device)."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
    has_complex = False
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group.update(lr=hyper.learning_rate, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                         weight_decay=hyper.weight_decay)
            has_complex |= optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                                 steps)
    if not params:
        return
    group = optimizers[0].param_groups[0]
    adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
         has_complex=has_complex, beta1=hyper.beta1, beta2=hyper.beta2, lr=hyper.learning_rate,
         weight_decay=hyper.weight_decay, eps=hyper.eps, maximize=group["maximize"], foreach=group["foreach"],
         capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
         grad_scale=None, found_inf=None, decoupled_weight_decay=group["decoupled_weight_decay"])
