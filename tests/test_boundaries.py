"""The typed boundaries between the server and its compute (``adapters.boundary``, ``adapters.actors``): each
component's Protocol is what its Ray-side class implements (a renamed or re-shaped method fails here, and its actor's
start, rather than a request at run time); the actor class Ray creates is made from the Protocol alone and hands each
call to the implementation; and a call through a proxy is one call of the actor method of its name, on every shard of
a sharded trainer (a checkpoint's writing on rank 0 alone), traced as ``trainer.<operation>``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import pytest

from adapters.actors import ActorUnavailable
from adapters.boundary import actor_class, methods, mismatches
from adapters.samplers.interface import SAMPLER_REPLICA_CLASS, AdapterRef, SamplerFacts, SamplerReplica
from adapters.trainer.group import TrainerGroup
from adapters.trainer.interface import TRAINER_CLASS, LoraSpec, ModelFacts, Trainer
from adapters.trainer.pool import TrainerOptions, TrainerPool
from shims.sampling.job import SampleJob, SampleResult, TokenEvent


def _implementation(path: str) -> type:
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(("protocol", "path", "concurrent"), [(Trainer, TRAINER_CLASS, False),
                                                               (SamplerReplica, SAMPLER_REPLICA_CLASS, True)])
def test_each_ray_side_class_implements_its_protocol(protocol, path, concurrent):
    assert mismatches(_implementation(path), protocol, concurrent) == []


def test_the_protocols_say_which_calls_stream_and_which_run_on_rank_zero_alone():
    assert [m.name for m in methods(Trainer).values() if m.rank_zero] == ["import_adapter"]
    assert [m.name for m in methods(SamplerReplica).values() if m.streams] == ["stream"]
    assert not any(m.streams for m in methods(Trainer).values())


class Replica:
    """A ``SamplerReplica`` without a backend, for the actor class made from the Protocol."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.closed = False

    async def facts(self) -> SamplerFacts:
        return self.answer

    async def ready(self) -> None:
        return None

    async def stats(self) -> dict:
        return {"answer": self.answer}

    async def sample(self, adapter: AdapterRef | None, job: SampleJob) -> SampleResult:
        return (adapter, job)

    async def stream(self, adapter: AdapterRef | None,
                     job: SampleJob) -> AsyncIterator[list[TokenEvent] | SampleResult]:
        try:
            for item in range(job):
                yield item
        finally:
            self.closed = True


class Renamed(Replica):
    async def sample(self, adapter: AdapterRef | None, request: SampleJob) -> SampleResult:
        return (adapter, request)

    def ready(self) -> None:
        return None


def test_the_actor_class_is_made_from_the_protocol_and_hands_each_call_to_the_implementation():
    made = actor_class(SamplerReplica, f"{__name__}:Replica", concurrent=True)
    assert made.__name__ == "Replica" and Replica not in made.__mro__  # built in the actor, not inherited
    assert inspect.iscoroutinefunction(made.sample) and inspect.isasyncgenfunction(made.stream)
    assert inspect.signature(made.sample) == inspect.signature(SamplerReplica.sample)  # what Ray checks calls by
    actor = made("hello")
    assert asyncio.run(actor.facts()) == "hello" and asyncio.run(actor.sample(None, 3)) == (None, 3)

    async def first_two() -> list:
        stream = actor.stream(None, 5)
        items = [await anext(stream), await anext(stream)]
        await stream.aclose()  # the consumer went away: the implementation's generator is closed too
        return items

    assert asyncio.run(first_two()) == [0, 1]
    assert actor._calls["stream"].__self__.closed
    trainer_class = actor_class(Trainer, TRAINER_CLASS, concurrent=False)
    assert not any(inspect.iscoroutinefunction(f) for f in vars(trainer_class).values())  # calls stay in order


def test_an_implementation_that_differs_from_its_protocol_fails_its_actor_s_start():
    with pytest.raises(TypeError) as refused:
        actor_class(SamplerReplica, f"{__name__}:Renamed", concurrent=True)("hello")
    assert "ready must be a coroutine" in str(refused.value)
    assert "sample(self, adapter: AdapterRef | None, request: SampleJob)" in str(refused.value)


class _FakeActor:
    """Records ``actor.<method>.remote(*args)`` as Ray would receive it, and answers at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, method: str):
        calls = self.calls

        class Remote:
            returns = 1

            @classmethod
            def options(cls, num_returns):  # a by_reference method: its receipt, then its value's reference
                return type("Remote", (cls,), {"returns": num_returns})

            @classmethod
            def remote(cls, *args, **kwargs):
                calls.append((method, args, kwargs))
                answer = asyncio.get_running_loop().create_future()
                answer.set_result(f"{method} done" if cls.returns == 1 else f"{method} receipt")
                return answer if cls.returns == 1 else [answer, f"{method} done"]

        return Remote


def _pool(shards: int, spans: list | None = None) -> tuple[TrainerPool, TrainerGroup]:
    traced = None
    if spans is not None:
        from contextlib import nullcontext

        def traced(operation, model_id):
            spans.append((f"trainer.{operation}", model_id))
            return nullcontext()

    pool = TrainerPool([], TrainerOptions(shards=shards), traced)
    group = pool.groups["base"] = TrainerGroup("base", "/model", pool.options)
    pool.trainers["base"] = group.calls(pool._around)
    group.actors = [_FakeActor() for _ in range(shards)]
    group.open()
    return pool, group


@pytest.mark.parametrize(("operation", "args", "model_id"), [
    ("create", ("m", LoraSpec(rank=2, seed=1)), "m"),
    ("unload", ("m",), "m"),
    ("save_state", ("m", "/ckpt"), "m"),
    ("load_state", ("m", "/ckpt", True), "m"),
    ("save_for_sampler", ("m", "/ckpt"), "m"),
    ("sampler_tensors", ("m",), "m"),
    ("save_for_export", ("m", "/ckpt"), "m"),
    ("score", (None, [1, 2, 3]), None),
    ("import_adapter", ("/upload", LoraSpec(rank=2, seed=0), "/upload/.sampler"), None),
])
@pytest.mark.parametrize("shards", [1, 2])
def test_each_operation_is_one_traced_call_of_the_actor_method_of_its_name(operation, args, model_id, shards):
    """On every shard of a sharded trainer, once each (an upload's check on rank 0 alone), and rank 0 answers (an
    adapter handed in memory: every shard's part)."""
    spans: list = []
    pool, group = _pool(shards, spans)
    answer = asyncio.run(getattr(pool.trainer("base"), operation)(*args))
    rank_zero = operation == "import_adapter"  # reads files only
    for rank, actor in enumerate(group.actors):
        assert actor.calls == ([] if rank and rank_zero else [(operation, args, {})])
    if operation == "sampler_tensors":  # rank 0's receipt; the value's reference, of every shard when sharded
        done = f"{operation} done"
        assert answer == (f"{operation} receipt", done if shards == 1 else (done,) * shards)
    else:
        assert answer == f"{operation} done"
    assert spans == [(f"trainer.{operation}", model_id)]


def test_a_call_the_protocol_does_not_take_is_refused_before_it_is_sent():
    """By the Protocol's signature, as Ray checks an actor call against the actor class's (the same signature)."""
    pool, group = _pool(1)
    with pytest.raises(TypeError):
        asyncio.run(pool.trainer("base").unload("m", "extra"))  # type: ignore[call-arg]
    assert group.actors[0].calls == []


def test_a_call_in_flight_when_the_trainer_dies_says_which_process_died_whoever_noticed_first(monkeypatch):
    """The pool's question to the trainer meets its death first, and the restart begins; the call in flight, failing
    after, says the same as a call made during the restart: which process of which group died (not Ray's text, nor
    the new process's pid)."""
    from ray.exceptions import RayActorError

    import adapters.trainer.group as group_module
    from adapters.actors import actor_proxy

    answers: dict[str, asyncio.Future] = {}

    class Dying:
        def __getattr__(self, method: str):
            class Remote:
                @staticmethod
                def remote(*args, **kwargs):
                    answers[method] = asyncio.get_running_loop().create_future()
                    return answers[method]
            return Remote

    async def scenario() -> list[str]:
        group = TrainerGroup("base", "/model", TrainerOptions())
        group.actors = [Dying()]
        group.shards = [actor_proxy(group.actors[0], Trainer, group.what, cancel=False)]
        group.facts = [ModelFacts(vocab_size=8, max_context=8, arch="x", device="cpu", pid=7)]
        group._pings = [None]
        group.open()
        restarted = asyncio.Event()

        async def start() -> None:  # the new process: still loading while the old call fails
            group.facts = [ModelFacts(vocab_size=8, max_context=8, arch="x", device="cpu", pid=8)]
            restarted.set()
            await asyncio.sleep(3600)

        monkeypatch.setattr(group, "start", start)
        monkeypatch.setattr(group_module.ray, "kill", lambda *args, **kwargs: None)
        trainer = group.calls()
        in_flight = asyncio.ensure_future(trainer.run_batch([]))
        await asyncio.sleep(0)
        group.check()
        await asyncio.sleep(0)
        answers["model_facts"].set_exception(RayActorError())
        await restarted.wait()
        answers["run_batch"].set_exception(RayActorError())
        said = []
        for call in (in_flight, trainer.run_batch([])):
            with pytest.raises(ActorUnavailable) as failed:
                await call
            said.append(str(failed.value))
        group._restarting.cancel()
        return said

    said = ("trainer for base is not available: its process (pid 7) died; it restarts, and its training runs come back "
            "from their last checkpoints")
    assert asyncio.run(scenario()) == [said, said]
