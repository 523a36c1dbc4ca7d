"""A custom loss graph from the wire (``tinker.types.CustomLossGraph``) → a checked, plain-data ``CustomLoss``.

The graph is untrusted input. It is read node by node against the allow-list in ``shims.custom_loss.ops`` and the
size limits in ``CustomLossLimits``; whatever else it holds is a ``UserError`` naming the node. The result holds no
callables, only names the allow-list knows, integer references to earlier values and constants, so it can be stored
and shipped to a trainer, where ``shims.custom_loss.run`` interprets it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shims.custom_loss import ops
from shims.custom_loss.limits import CustomLossLimits
from shims.errors import UserError

METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
"""The SDK's rule (``tinker/lib/public_interfaces/custom_loss.py``): the suffix says how a metric combines."""
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_INPUTS = 16
MAX_STRING = 256
MAX_INT = 2**63


@dataclass(frozen=True)
class Ref:
    """An earlier value: the loss's inputs come first (``logprobs`` is 0), then each step's result."""

    index: int


@dataclass(frozen=True)
class SliceArg:
    start: Any
    stop: Any
    step: Any


@dataclass(frozen=True)
class RunDevice:
    """Any device a graph names: the device the loss runs on."""


@dataclass(frozen=True)
class Step:
    kind: str
    """``function`` (``target`` is a key of ``ops.FUNCTIONS``) or ``method`` (a name in ``ops.METHODS``)."""
    name: str
    target: str
    args: tuple
    kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class CustomLoss:
    """A checked custom loss: what ``create_custom_loss`` stores and ``forward_backward`` runs."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    """``(name, rank)`` in the order the loss takes them, ``logprobs`` first."""
    steps: tuple[Step, ...]
    loss: Ref
    metrics: tuple[tuple[str, Ref], ...]
    limits: CustomLossLimits
    """What running it may cost (the server's ``--custom-loss-max-*`` when it was created)."""


def _show(value: Any) -> str:
    """A short, safe rendering of untrusted input: never ``str`` of a container, which may nest arbitrarily deep."""
    return repr(value[:64]) if isinstance(value, str) else repr(value) if isinstance(value, (int, float)) \
        else type(value).__name__


def _fail(loss: str, where: str, message: str) -> UserError:
    return UserError(f"custom loss {loss!r}: {where}: {message}")


class _Decoder:
    """Turns one graph's encoded arguments into plain values, counting constants and checking nesting."""

    def __init__(self, loss: str, limits: CustomLossLimits) -> None:
        self.loss, self.limits = loss, limits
        self.names: dict[str, int] = {}
        self.constants = 0

    def decode(self, where: str, value: Any, depth: int = 0, dicts: bool = False) -> Any:
        if depth > self.limits.max_nesting:
            raise _fail(self.loss, where, f"arguments nest deeper than {self.limits.max_nesting} levels "
                                          "(--custom-loss-max-nesting)")
        if isinstance(value, dict) and "ref" in value and len(value) == 1:
            target = value["ref"]
            if not isinstance(target, str) or target not in self.names:
                raise _fail(self.loss, where, f"refers to {_show(target)}, which is not an earlier node "
                                              "(a graph runs its nodes in order and has no cycles)")
            self._count(where, 1)  # a reference costs what a constant does: a graph cannot hold a million of them
            return Ref(self.names[target])
        if isinstance(value, (bool, int, float, str)) or value is None:
            self._count(where, 1)
            if isinstance(value, str) and len(value) > MAX_STRING:
                raise _fail(self.loss, where, f"a string constant is longer than {MAX_STRING} characters")
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_INT:
                raise _fail(self.loss, where, "an integer constant does not fit in 64 bits")
            return value
        if isinstance(value, list):
            self._count(where, len(value))
            return [self.decode(where, item, depth + 1, dicts) for item in value]
        if not (isinstance(value, dict) and len(value) == 1):
            raise _fail(self.loss, where, f"unreadable argument of type {type(value).__name__}")
        (kind, body), = value.items()
        return self._tagged(where, kind, body, depth, dicts)

    def _tagged(self, where: str, kind: str, body: Any, depth: int, dicts: bool) -> Any:
        if kind == "tuple" and isinstance(body, list):
            self._count(where, len(body))
            return tuple(self.decode(where, item, depth + 1, dicts) for item in body)
        if kind == "dict" and isinstance(body, dict) and dicts:
            self._count(where, len(body))
            return {str(key): self.decode(where, item, depth + 1, dicts) for key, item in body.items()}
        if kind == "slice" and isinstance(body, list) and len(body) == 3:
            return SliceArg(*(self.decode(where, item, depth + 1) for item in body))
        if kind == "ellipsis" and body is True:
            return Ellipsis
        table = {"float": ops.FLOATS, "dtype": ops.DTYPES, "layout": ops.LAYOUTS,
                 "memory_format": ops.MEMORY_FORMATS}.get(kind)
        if table is not None and isinstance(body, str) and body in table:
            return table[body]
        if kind == "device" and isinstance(body, str) and body.split(":")[0] in ops.DEVICES:
            return RunDevice()
        if kind == "dict":
            raise _fail(self.loss, where, "a dict argument is only allowed as the metrics the loss returns")
        raise _fail(self.loss, where, f"argument {{{kind[:32]!r}: {_show(body)}}} is not allowed here")

    def _count(self, where: str, n: int) -> None:
        self.constants += n
        if self.constants > self.limits.max_constants:
            raise _fail(self.loss, where, f"the graph's arguments hold more than {self.limits.max_constants} "
                                          "constants (--custom-loss-max-constants)")


def _inputs(name: str, inputs: Sequence[Any]) -> tuple[tuple[str, int], ...]:
    declared = tuple((str(getattr(i, "name", "")), getattr(i, "rank", None)) for i in inputs)
    if not declared or declared[0][0] != "logprobs":
        raise UserError(f"custom loss {name!r}: its inputs must start with logprobs")
    if len(declared) > MAX_INPUTS:
        raise UserError(f"custom loss {name!r}: takes {len(declared)} inputs; at most {MAX_INPUTS}")
    for input_name, rank in declared:
        if not INPUT_NAME.fullmatch(input_name) or rank not in (0, 1, 2):
            raise UserError(f"custom loss {name!r}: input {input_name[:64]!r} needs a lowercase name and rank 0, 1 "
                            f"or 2, got rank {rank!r}")
    if len({n for n, _ in declared}) != len(declared):
        raise UserError(f"custom loss {name!r}: input names repeat")
    if declared[0][1] == 0:
        raise UserError(f"custom loss {name!r}: logprobs has rank 1 ([T]) or 2 ([T, K])")
    return declared


def compile_custom_loss(name: str, inputs: Sequence[Any], nodes: Sequence[Any],
                        limits: CustomLossLimits) -> CustomLoss:
    """Check a ``CreateCustomLossRequest``'s ``name``, ``inputs`` and ``graph.nodes`` (objects with the wire fields)
    and build the ``CustomLoss``; a ``UserError`` for anything the allow-list or the limits do not admit."""
    if not (isinstance(name, str) and 0 < len(name) <= 128):
        raise UserError("a custom loss needs a name of 1 to 128 characters")
    declared = _inputs(name, inputs)
    if len(nodes) > limits.max_nodes:
        raise UserError(f"custom loss {name!r}: its graph has {len(nodes)} nodes; this server takes at most "
                        f"{limits.max_nodes} (--custom-loss-max-nodes)")
    decoder = _Decoder(name, limits)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if [n.target for n in placeholders] != [n for n, _ in declared] or any(
            n.op != "placeholder" for n in nodes[:len(declared)]):
        raise UserError(f"custom loss {name!r}: the graph's placeholders must be its inputs "
                        f"({', '.join(n for n, _ in declared)}), in order, before any other node")
    steps: list[Step] = []
    output = None
    for position, node in enumerate(nodes):
        where = f"node {str(node.name)[:64]!r} ({node.op} {str(node.target)[:64]!r})"
        if not NODE_NAME.fullmatch(node.name) or node.name in decoder.names:
            raise _fail(name, where, "node names must be unique identifiers")
        if output is not None:
            raise _fail(name, where, "the output node must be the last")
        if node.op == "placeholder":
            if node.args or node.kwargs:
                raise _fail(name, where, "an input cannot have a default")
        elif node.op == "output":
            output = _output(decoder, where, node)
        elif node.op in ("call_function", "call_method"):
            steps.append(_step(decoder, where, node))
        else:
            raise _fail(name, where, f"{node.op} nodes are not allowed: a custom loss may only call torch, math and "
                                     "operator functions and tensor methods on its inputs")
        decoder.names[node.name] = position
    if output is None:
        raise UserError(f"custom loss {name!r}: the graph has no output node")
    loss, metrics = output
    return CustomLoss(name=name, inputs=declared, steps=tuple(steps), loss=loss, metrics=metrics, limits=limits)


def _step(decoder: _Decoder, where: str, node: Any) -> Step:
    if node.op == "call_function":
        kind = "function"
        if node.target not in ops.FUNCTIONS:
            raise _fail(decoder.loss, where, f"{str(node.target)[:64]!r} is not a function this server runs; see "
                                             "the allowed torch, torch.nn.functional, math and operator functions "
                                             "in shims/custom_loss/ops.py")
    else:
        kind = "method"
        if node.target not in ops.METHODS:
            raise _fail(decoder.loss, where, f"tensor method {str(node.target)[:64]!r} is not allowed (in-place "
                                             "methods, item/tolist/numpy and backward never are)")
    args = tuple(decoder.decode(where, arg) for arg in node.args)
    if not isinstance(node.kwargs, Mapping) or not all(isinstance(k, str) and len(k) <= 64 for k in node.kwargs):
        raise _fail(decoder.loss, where, "keyword argument names must be short strings")
    if ops.REFUSED_KEYWORDS & set(node.kwargs):
        raise _fail(decoder.loss, where, "out= and inplace= are not allowed: a custom loss cannot write into tensors")
    kwargs = {key: decoder.decode(where, value) for key, value in node.kwargs.items()}
    if node.target in ("getattr", "builtins.getattr") and (
            len(args) != 2 or kwargs or not isinstance(args[0], Ref) or not isinstance(args[1], str)
            or args[1] not in ops.ATTRIBUTES):
        raise _fail(decoder.loss, where, f"only the attributes {', '.join(sorted(ops.ATTRIBUTES))} may be "
                                         "read, and only from a value of the graph")
    if kind == "method" and (not args or not isinstance(args[0], Ref)):
        raise _fail(decoder.loss, where, "a method must be called on a value of the graph")
    return Step(kind=kind, name=node.name, target=node.target, args=args, kwargs=kwargs)


def _output(decoder: _Decoder, where: str, node: Any) -> tuple[Ref, tuple[tuple[str, Ref], ...]]:
    if len(node.args) != 1 or node.kwargs:
        raise _fail(decoder.loss, where, "the output node returns one value, (loss, metrics)")
    returned = decoder.decode(where, node.args[0], dicts=True)
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2 and isinstance(returned[0], Ref)
            and isinstance(returned[1], dict)):
        raise _fail(decoder.loss, where, "the loss must return (loss, metrics): a tensor and a dict of tensors")
    metrics = []
    for key, value in returned[1].items():
        if not METRIC_KEY.fullmatch(key):
            raise _fail(decoder.loss, where, f"metric {key[:80]!r} must be named custom/<name>:sum or "
                                             "custom/<name>:mean in lowercase")
        if not isinstance(value, Ref):
            raise _fail(decoder.loss, where, f"metric {key!r} must be a value the loss computes")
        metrics.append((key, value))
    return returned[0], tuple(metrics)
