"""Runs a checked ``CustomLoss`` (see ``shims.custom_loss.graph``) on one datum's tensors, as the SDK's client-side
path does: ``(logprobs, *inputs) → (scalar loss, metrics)`` per datum, losses summed, ``:mean`` metrics averaged
over the datums and ``:sum`` metrics summed (``run_loss_handle`` in ``tinker/lib/public_interfaces/custom_loss.py``).

Each step's output size is bounded before it runs and counted after, against the loss's ``max_elements``; whatever
a step raises is a ``UserError`` naming it. Nothing here calls a name that is not in ``shims.custom_loss.ops``.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from shims.custom_loss import ops
from shims.custom_loss.graph import MAX_INT, MAX_STRING, CustomLoss, Ref, RunDevice, SliceArg, Step
from shims.errors import UserError

_SEQUENCES = (str, bytes, list, tuple)
_VALUES = (torch.Tensor, bool, int, float, str, type(None), torch.dtype)


def _as_rank(value: Any, rank: int, n: int) -> Any:
    """The input at its declared rank, or None. The wire cannot tell a scalar from a one-element ``[T]`` with no
    stated shape, so when ``T = 1`` either reads as the rank declared."""
    if value.ndim == rank:
        return value
    if rank == 0 and tuple(value.shape) == (1,) and n == 1:
        return value.reshape(())
    if rank == 1 and value.ndim == 0 and n == 1:
        return value.reshape(1)
    return None


def check_custom_datum(loss: CustomLoss, index: int, tokens: np.ndarray, inputs: Mapping[str, np.ndarray], *,
                       vocab_size: int, max_context: int) -> None:
    """What ``shims.losses.check_datum`` checks for a built-in loss, for a custom one: the tokens, ``target_tokens``,
    and each input the loss reads at its declared rank. Inputs it does not read are ignored, as client-side."""
    where, n = f"datum {index}", tokens.size
    if n == 0 or n > max_context:
        raise UserError(f"{where}: model_input has {n} tokens; it needs 1 to {max_context}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise UserError(f"{where}: model_input token ids must lie in [0, {vocab_size})")
    targets = inputs.get("target_tokens")
    if targets is None or targets.dtype.kind != "i" or targets.shape[:1] != (n,) or targets.ndim > 2:
        raise UserError(f"{where}: a custom loss needs int64 target_tokens of shape [{n}] or [{n}, K]")
    if targets.min() < 0 or targets.max() >= vocab_size:
        raise UserError(f"{where}: target_tokens ids must lie in [0, {vocab_size})")
    if targets.ndim != loss.inputs[0][1]:
        raise UserError(f"{where}: target_tokens has rank {targets.ndim}, but loss {loss.name!r} declared logprobs "
                        f"with rank {loss.inputs[0][1]}")
    for name, rank in loss.inputs[1:]:
        if name not in inputs:
            raise UserError(f"{where} has no loss_fn_inputs[{name!r}], which loss {loss.name!r} takes")
        if _as_rank(inputs[name], rank, n) is None:
            raise UserError(f"{where}: loss_fn_inputs[{name!r}] has rank {inputs[name].ndim}, but loss "
                            f"{loss.name!r} declared {name} with rank {rank}")


def _resolve(arg: Any, values: list, device: torch.device) -> Any:
    if isinstance(arg, Ref):
        return values[arg.index]
    if isinstance(arg, RunDevice):
        return device
    if isinstance(arg, SliceArg):
        return slice(*(_resolve(a, values, device) for a in (arg.start, arg.stop, arg.step)))
    if isinstance(arg, list):
        return [_resolve(a, values, device) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_resolve(a, values, device) for a in arg)
    return arg


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def _parts(value: Any) -> Any:
    """The values a container holds, or None for a leaf."""
    if isinstance(value, (list, tuple)):
        return value
    if isinstance(value, dict):
        return value.values()
    if isinstance(value, slice):
        return (value.start, value.stop, value.step)
    return None


class _Datum:
    """What one datum's loss has cost so far — tensor elements made, time taken — against its limits, and the checks
    on every value a step makes.

    A value may hold the same part many times over (``t = (t,) + (t,)`` doubles a tuple at every step, 2**K leaves
    from K steps), so each distinct container is looked at once: sizing and checking cost what the values really
    are, not what they would be written out."""

    def __init__(self, loss: CustomLoss, device: torch.device, deadline: float) -> None:
        self.loss, self.limits, self.device = loss, loss.limits, device
        self.used = 0
        self.deadline = deadline
        """When the request's custom-loss time runs out (``device_time``; ``CustomLossBatch``)."""
        self._sizes: dict[int, tuple[Any, int, int]] = {}
        """id → (the container, kept so its id stays its own; Python values in it; tensor elements in it)."""
        self._counted: dict[int, Any] = {}
        """The tensors (and containers) already counted in ``used``, by id, each kept alive for the same reason."""
        self._checked: dict[int, Any] = {}
        self._heights: dict[int, tuple[Any, int]] = {}

    def size(self, value: Any) -> tuple[int, int]:
        """``(Python values, tensor elements)`` in ``value`` as if every shared part were written out: what a step
        that copies it (``torch.tensor``, ``cat``) would make."""
        if isinstance(value, torch.Tensor):
            return 0, value.numel()
        parts = _parts(value)
        if parts is None:
            return 1, 0
        known = self._sizes.get(id(value))
        if known is None:
            scalars = elements = 0
            for part in parts:
                s, e = self.size(part)
                scalars, elements = scalars + s, elements + e
            known = self._sizes[id(value)] = (value, scalars, elements)
        return known[1], known[2]

    def _over(self, where: str, elements: int) -> UserError:
        return UserError(f"custom loss {self.loss.name!r}: {where} would bring the tensors one datum's loss makes to "
                         f"{elements} elements; this server allows {self.limits.max_elements} "
                         "(--custom-loss-max-elements)")

    def before(self, where: str, fn: Any, args: tuple, kwargs: dict) -> None:
        """Refuse a step whose output could exceed what the datum may still make, before it runs."""
        scalars, elements = self.size((args, kwargs))
        estimate = scalars + elements
        direct = [v.shape for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        if direct:
            try:
                estimate = max(estimate, math.prod(torch.broadcast_shapes(*direct)))
            except RuntimeError:
                pass
        if fn is operator.getitem and isinstance(args[0], torch.Tensor):
            estimate = self._indexed(where, args[0], args[1])
        if self.used + estimate > self.limits.max_elements:
            raise self._over(where, self.used + estimate)

    def _indexed(self, where: str, tensor: torch.Tensor, index: Any) -> int:
        """Indexing by integers (a tensor or a Python list of them) makes as many rows as the index holds: sized on
        meta tensors. A boolean mask selects at most every element; where meta tensors cannot say, the product of
        every index's size bounds it."""
        scalars, elements = self.size(index)
        if scalars > self.limits.max_constants:
            raise UserError(f"custom loss {self.loss.name!r}: {where} indexes with {scalars} Python values; at most "
                            f"{self.limits.max_constants} (--custom-loss-max-constants)")
        tensors = [v for v in (index if isinstance(index, tuple) else (index,)) if isinstance(v, torch.Tensor)]
        if tensors and all(t.dtype == torch.bool for t in tensors) and not any(
                isinstance(v, list) for v in (index if isinstance(index, tuple) else (index,))):
            return tensor.numel()
        try:
            return _meta(tensor)[_meta(index)].numel()
        except Exception:  # noqa: BLE001 - the bound below holds whatever the index is
            return tensor.numel() * max(1, scalars) * max(1, elements)

    def after(self, where: str, result: Any) -> None:
        """Count the tensors a step made (each once, however often the result holds it) and the time taken."""
        self.used += self._new_elements(result)
        if self.used > self.limits.max_elements:
            raise self._over(where, self.used)
        if device_time(self.device) > self.deadline:
            raise over_time(self.loss, where)

    def _new_elements(self, value: Any) -> int:
        if id(value) in self._counted:
            return 0
        self._counted[id(value)] = value
        if isinstance(value, torch.Tensor):
            return value.numel()
        parts = _parts(value)
        return 0 if parts is None else sum(self._new_elements(part) for part in parts)

    def check(self, where: str, value: Any) -> None:
        """Only plain values on the loss's device flow between steps, none that grows without bound."""
        problem = self._problem(value)
        if problem:
            raise UserError(f"custom loss {self.loss.name!r}: {where} made {problem}, which a custom loss may not")

    def _problem(self, value: Any) -> str | None:
        if isinstance(value, torch.Tensor):
            if value.device != self.device:
                return f"a tensor on device {value.device} (its tensors stay on {self.device}, where it runs)"
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_INT:
            return "an integer beyond 64 bits"
        elif isinstance(value, str) and len(value) > MAX_STRING:
            return f"a string longer than {MAX_STRING} characters"
        elif isinstance(value, (list, tuple)):
            return self._sequence_problem(value)
        elif not isinstance(value, _VALUES):
            return f"a value of type {type(value).__name__}"
        return None

    def _sequence_problem(self, value: list | tuple) -> str | None:
        if id(value) in self._checked:
            return None
        if len(value) > self.limits.max_constants:
            return f"a sequence of more than {self.limits.max_constants} items (--custom-loss-max-constants)"
        if self._height(value) > self.limits.max_nesting:
            return f"a value nested deeper than {self.limits.max_nesting} levels (--custom-loss-max-nesting)"
        for item in value:
            if problem := self._problem(item):
                return problem
        self._checked[id(value)] = value
        return None

    def _height(self, value: Any) -> int:
        """How deeply ``value``'s sequences nest (0 for a leaf), each distinct one measured once; values were
        checked as they were made, so only the outermost levels are new."""
        if not isinstance(value, (list, tuple)):
            return 0
        known = self._heights.get(id(value))
        if known is None:
            known = self._heights[id(value)] = (value, 1 + max((self._height(v) for v in value), default=0))
        return known[1]


def _call(step: Step, args: tuple, kwargs: dict, device: torch.device) -> tuple[Any, Any]:
    """The function a step runs, with its final arguments; refuses what the allow-list does not admit for them."""
    if step.kind == "method":
        receiver = args[0]
        if step.target not in ops.METHODS or not isinstance(receiver, torch.Tensor):
            raise UserError(f"method {step.target!r} can only be called on a tensor here")
        return getattr(receiver, step.target), (args[1:], kwargs)
    fn = ops.FUNCTIONS.get(step.target)
    if fn is None:
        raise UserError(f"{step.target!r} is not an allowed function")
    if fn is getattr:
        obj, name = args
        on_tensor = isinstance(obj, torch.Tensor) and name in ops.TENSOR_ATTRIBUTES
        on_result = type(obj).__module__ == "torch.return_types" and name in ops.RESULT_ATTRIBUTES
        if not (on_tensor or on_result):
            raise UserError(f"attribute {name!r} cannot be read from a {type(obj).__name__}")
    elif fn in ops.OPERATORS:
        if fn not in ops.SEQUENCE_OPERATORS and any(isinstance(a, _SEQUENCES) for a in args):
            raise UserError(f"{step.target} does not take tuples, lists or strings here")
        if fn is operator.pow and not any(isinstance(a, torch.Tensor) for a in args) \
                and isinstance(args[0], int) and isinstance(args[1], int) and abs(args[1]) > 64 \
                and args[0] not in (0, 1, -1):
            raise UserError("a Python integer power's exponent may be at most 64")
    elif fn in (torch.tensor, torch.as_tensor):
        kwargs = {**kwargs, "device": device}
    return fn, (args, kwargs)


def over_time(loss: CustomLoss, where: str) -> UserError:
    """The error of a request whose custom loss ran out of its time (``--custom-loss-max-seconds``)."""
    return UserError(f"custom loss {loss.name!r}: the request's custom loss ran longer than {loss.limits.max_seconds} "
                     f"s, forward and backward of all its datums together (at {where}; --custom-loss-max-seconds)")


def device_time(device: torch.device) -> float:
    """``time.monotonic()`` once ``device`` has done the work queued on it. A GPU runs kernels after the calls that
    launch them return: read without waiting, the clock would count a loss's launches, not its work, and a loss of
    slow kernels would run on far past ``--custom-loss-max-seconds``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic()


def run_datum(loss: CustomLoss, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
              deadline: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One datum's ``(loss, metrics)``; ``inputs`` passed ``check_custom_datum``. ``deadline``: when the request's
    custom-loss time runs out (``device_time``; default: ``max_seconds`` from now)."""
    device, n = logprobs.device, logprobs.shape[0]
    values: list[Any] = [logprobs, *(_as_rank(inputs[name], rank, n) for name, rank in loss.inputs[1:])]
    budget = _Datum(loss, device, device_time(device) + loss.limits.max_seconds if deadline is None else deadline)
    for step in loss.steps:
        where = f"node {step.name!r} ({step.target})"
        args = tuple(_resolve(a, values, device) for a in step.args)
        kwargs = {key: _resolve(v, values, device) for key, v in step.kwargs.items()}
        try:
            fn, (call_args, call_kwargs) = _call(step, args, kwargs, device)
            budget.before(where, fn, call_args if step.kind == "function" else args, call_kwargs)
            result = fn(*call_args, **call_kwargs)
        except UserError as exc:
            message = str(exc)
            raise (exc if message.startswith("custom loss") else
                   UserError(f"custom loss {loss.name!r}: {where}: {message}")) from None
        except Exception as exc:  # noqa: BLE001 - whatever the loss's own arithmetic raises is the user's to fix
            raise UserError(f"custom loss {loss.name!r}: {where} failed: {type(exc).__name__}: {exc}") from None
        budget.check(where, result)
        budget.after(where, result)
        values.append(result)
    total = values[loss.loss.index]
    if not isinstance(total, torch.Tensor) or total.ndim != 0 or not total.is_floating_point():
        shown = tuple(total.shape) if isinstance(total, torch.Tensor) else type(total).__name__
        raise UserError(f"loss {loss.name!r} must return a scalar floating-point loss, got {shown}")
    metrics = {}
    for key, ref in loss.metrics:
        value = values[ref.index]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.detach().item()
        if not isinstance(value, (bool, int, float)):
            raise UserError(f"loss {loss.name!r} metric {key!r} must be a one-element tensor or a number")
        metrics[key] = float(value)
    return total, metrics
