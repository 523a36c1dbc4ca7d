"""A compute component's boundary: the ``typing.Protocol`` the server knows it by, and the Ray actor class serving it.

Each component the server calls in another process — one base model's trainer, one sampler replica — is declared as
a Protocol in a torch-free interface module (``adapters.trainer.interface``, ``adapters.samplers.interface``). Its
methods are ``async def`` (every call crosses to another process and is awaited), or a plain ``def`` returning an
``AsyncIterator`` for one whose items come back as they are made (Ray's streaming generators). Callers hold a typed
proxy (``adapters.actors``): the type checker sees the Protocol's signatures, and a call names its method as an
attribute.

The class that does the work (``MultiLoRATrainer``, ``SamplerActor``) is named by its import path and imported only
in its actor's process. Ray needs a class object to create an actor, and reads from it, in the caller's process,
which methods the actor has, which are coroutines and which stream; ``actor_class`` makes that class from the
Protocol alone: one method per Protocol method, each handing the call to the implementation its ``__init__`` built
(one more Python call per actor call, ``bench/boundary_overhead.py``). So the server never loads model code, and an
implementation that does not match its Protocol fails its actor's start, naming the difference.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, get_origin

F = TypeVar("F", bound=Callable[..., Any])

RANK_ZERO = "on_rank_zero"
"""The attribute ``on_rank_zero`` sets on a Protocol method."""


def on_rank_zero(method: F) -> F:
    """Marks a Protocol method that one process of a group runs alone (rank 0 of a sharded trainer:
    ``adapters.trainer.group``): one that reads what every process holds alike and changes nothing, with no
    collective (writing a checkpoint). The others need not wait for it, and its failure (a full disk) is that call's
    own, not a disagreement between them."""
    setattr(method, RANK_ZERO, True)
    return method


BY_REFERENCE = "by_reference"
"""The attribute ``by_reference`` sets on a Protocol method."""


def by_reference(method: F) -> F:
    """Marks a Protocol method that returns ``(receipt, value)`` where the value is large and goes on elsewhere
    unread (an adapter's weights, from the trainer to the samplers): the caller gets the receipt (something small:
    the value's size) and a Ray reference to the value, which stays in Ray's object store where the actor put it,
    owned by the caller's process (it outlives the actor), never copied into the caller. The call's error, if any, is
    the receipt's."""
    setattr(method, BY_REFERENCE, True)
    return method


@dataclass(frozen=True)
class Method:
    """One method of a component's Protocol, as a call to an actor carries it."""

    name: str
    function: Callable
    """The Protocol's own function (``Trainer.save_state``)."""
    signature: inspect.Signature
    """Its parameters after ``self``, and what it returns."""
    streams: bool
    """Its items come back one by one as the actor yields them (Ray's ``num_returns="streaming"``)."""
    rank_zero: bool
    by_reference: bool = False
    """Its value comes back as a reference, its receipt apart (``by_reference``)."""

    def submit(self, handle: Any, args: tuple, kwargs: dict) -> Any:
        """Start this call on the actor behind the Ray ``handle``: an ``ObjectRef`` (an ``ObjectRefGenerator`` for a
        streaming method; the receipt's and the value's for one ``by_reference``). The one place a Protocol method
        becomes the actor method Ray dispatches by its name."""
        remote = getattr(handle, self.name)
        if self.streams:
            remote = remote.options(num_returns="streaming")
        elif self.by_reference:
            remote = remote.options(num_returns=2)
        return remote.remote(*args, **kwargs)


@functools.cache
def methods(protocol: type) -> dict[str, Method]:
    """The Protocol's methods, in the order it declares them."""
    found = {}
    for name, function in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(function):
            continue
        signature = inspect.signature(function, eval_str=True)
        streams = not inspect.iscoroutinefunction(function)
        if streams and get_origin(signature.return_annotation) is not AsyncIterator:
            raise TypeError(f"{protocol.__qualname__}.{name} must be an async def, or a def returning AsyncIterator")
        parameters = list(signature.parameters.values())[1:]
        found[name] = Method(name, function, signature.replace(parameters=parameters), streams,
                             getattr(function, RANK_ZERO, False), getattr(function, BY_REFERENCE, False))
    return found


def method_of(protocol: type, function: Callable) -> Method:
    """The ``Method`` of ``function``, one of ``protocol``'s own (``method_of(Trainer, Trainer.model_facts)``)."""
    return next(method for method in methods(protocol).values() if method.function is function)


def mismatches(implementation: type, protocol: type, concurrent: bool) -> list[str]:
    """How ``implementation`` differs from ``protocol``: a missing method, other parameters or return annotation, or
    a method of the wrong kind (``concurrent``: coroutines and async generators; otherwise plain functions)."""
    problems = []
    for method in methods(protocol).values():
        own = inspect.getattr_static(implementation, method.name, None)
        if not inspect.isfunction(own):
            problems.append(f"{method.name} is missing")
            continue
        kind = ("an async generator" if method.streams else "a coroutine" if concurrent else "a plain function")
        is_kind = (inspect.isasyncgenfunction(own) if method.streams else
                   inspect.iscoroutinefunction(own) if concurrent else
                   not (inspect.iscoroutinefunction(own) or inspect.isasyncgenfunction(own)))
        if not is_kind:
            problems.append(f"{method.name} must be {kind}")
        declared = inspect.signature(method.function)
        signature = inspect.signature(own)
        if list(signature.parameters.values())[1:] != list(declared.parameters.values())[1:] \
                or signature.return_annotation != declared.return_annotation:
            shown = [str(s).replace("'", "") for s in (signature, declared)]  # annotations as written, not as strings
            problems.append(f"{method.name}{shown[0]} is not {method.name}{shown[1]}")
    return problems


def actor_class(protocol: type, implementation: str, *, concurrent: bool) -> type:
    """The class Ray makes the actor of ``protocol`` from, whose ``__init__`` imports ``implementation``
    (``"package.module:Class"``) in the actor's process, checks it against ``protocol`` and builds it with the actor's
    arguments. ``concurrent``: the implementation's methods are coroutines that Ray runs concurrently on the actor's
    event loop (a sampler batching requests); otherwise plain functions, run one at a time in the order each caller
    made them (a trainer: Ray keeps call order only for such an actor). Named after the implementation's class, as
    Ray shows the actor's process."""
    return _actor_class(protocol, implementation, concurrent)


@functools.cache
def _actor_class(protocol: type, implementation: str, concurrent: bool) -> type:
    module, _, name = implementation.partition(":")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = getattr(importlib.import_module(module), name)
        if problems := mismatches(cls, protocol, concurrent):
            raise TypeError(f"{implementation} does not implement {protocol.__qualname__}: {'; '.join(problems)}")
        built = cls(*args, **kwargs)
        self._calls = {method: getattr(built, method) for method in methods(protocol)}

    namespace: dict[str, Any] = {"__init__": __init__, "__doc__": f"{protocol.__qualname__}, served by "
                                                                   f"{implementation} (``adapters.boundary``)."}
    for method in methods(protocol).values():
        namespace[method.name] = _delegate(method, concurrent)
    return type(name, (), namespace)


def _delegate(method: Method, concurrent: bool) -> Callable:
    """The actor class's method for ``method``: the implementation's, called with the same arguments. It declares the
    Protocol's parameters, which Ray checks a call against before sending it."""
    key = method.name
    call: Any = _streaming(key) if method.streams else _awaiting(key) if concurrent else _plain(key)
    call.__name__ = call.__qualname__ = key
    call.__doc__ = method.function.__doc__
    call.__signature__ = inspect.signature(method.function)
    return call


def _streaming(key: str) -> Callable[..., AsyncIterator[Any]]:
    async def call(self, *args, **kwargs):
        items = self._calls[key](*args, **kwargs)
        try:
            async for item in items:
                yield item
        finally:  # a consumer that went away (Ray cancels the stream) stops the implementation's generator too
            await items.aclose()
    return call


def _awaiting(key: str) -> Callable[..., Any]:
    async def call(self, *args, **kwargs):
        return await self._calls[key](*args, **kwargs)
    return call


def _plain(key: str) -> Callable[..., Any]:
    def call(self, *args, **kwargs):
        return self._calls[key](*args, **kwargs)
    return call
