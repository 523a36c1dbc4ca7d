"""Both sampler backends implement ``SamplerBackend``, the interface the pool knows them by: each subclasses it, and
each public method of the interface has the same signature (and is a coroutine in the same places) on both. Only the
classes are inspected: no model is loaded and no vLLM engine started (vLLM itself need not be installed)."""

from __future__ import annotations

import inspect

import pytest

from adapters.samplers.hf.sampler import TransformersSampler
from adapters.samplers.interface import SamplerBackend
from adapters.samplers.vllm.sampler import VLLMSampler

INTERFACE_METHODS = sorted(name for name, member in vars(SamplerBackend).items()
                           if inspect.isfunction(member) and not name.startswith("_"))


def test_the_interface_declares_what_the_replica_calls():
    assert INTERFACE_METHODS == ["close", "facts", "resident", "sample", "stats", "torch_threads"]
    assert "dead" in SamplerBackend.__annotations__


@pytest.mark.parametrize("backend", [TransformersSampler, VLLMSampler], ids=lambda cls: cls.__name__)
def test_each_backend_implements_the_sampler_interface(backend):
    assert SamplerBackend in backend.__mro__  # declared, not just structurally alike
    for name in INTERFACE_METHODS:
        declared, implemented = getattr(SamplerBackend, name), getattr(backend, name)
        assert implemented is not declared, f"{backend.__name__}.{name} is not implemented"
        assert inspect.signature(implemented) == inspect.signature(declared), f"{backend.__name__}.{name}"
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared), name
