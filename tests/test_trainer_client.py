"""The server's typed trainer client against the trainer actor: each operation the client offers is a
``MultiLoRATrainer`` method with the same parameters, so a renamed or re-shaped actor method fails here rather than in
a request at run time; and each call reaches the actor method of its name with the arguments it was given."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from adapters.actors import ActorUnavailable
from adapters.trainer.actor import MultiLoRATrainer
from adapters.trainer.group import TrainerGroup
from adapters.trainer.interface import LoraSpec
from adapters.trainer.pool import TrainerPlacement, TrainerPool
from compat_server.jobs.trainer_client import TrainerClient

POOL_ONLY = {"model_facts", "run_batch", "forward_backward_batch", "optim_steps"}
"""Actor methods the pool calls itself (start-up and restart checks, batched steps) or only in-process code does."""


def _public(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


def _parameters(cls: type, name: str) -> list[tuple[str, object, object]]:
    """The method's own parameters. ``ray.remote`` with tracing on (an in-process server test that enabled
    OpenTelemetry ran first) adds ``_ray_trace_ctx`` to the actor class's methods in place: Ray's, not the trainer's."""
    signature = inspect.signature(getattr(cls, name))
    return [(p.name, p.annotation, p.default) for p in signature.parameters.values()
            if p.name != "self" and not p.name.startswith("_ray_")]


def test_the_client_offers_the_trainer_s_operations_with_the_actor_s_parameters():
    client, actor = _public(TrainerClient), _public(MultiLoRATrainer)
    assert client <= actor, f"the client calls methods the trainer does not have: {client - actor}"
    assert actor - client == POOL_ONLY
    for name in client - {"forward_backward"}:  # forward_backward sends one StepRequest, batched by the pool
        assert _parameters(TrainerClient, name) == _parameters(MultiLoRATrainer, name), name
        assert (inspect.signature(getattr(TrainerClient, name)).return_annotation
                == inspect.signature(getattr(MultiLoRATrainer, name)).return_annotation), name


class _FakeActor:
    """Records ``actor.<method>.remote(*args)`` as Ray would receive it, and answers at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, method: str):
        calls = self.calls

        class Remote:
            @staticmethod
            def remote(*args, **kwargs):
                calls.append((method, args, kwargs))
                answer = asyncio.get_running_loop().create_future()
                answer.set_result(f"{method} done")
                return answer

        return Remote


@pytest.mark.parametrize(("operation", "args"), [
    ("create", ("m", LoraSpec(rank=2, seed=1))),
    ("unload", ("m",)),
    ("save_state", ("m", "/ckpt")),
    ("load_state", ("m", "/ckpt", True)),
    ("save_for_sampler", ("m", "/ckpt")),
    ("save_for_export", ("m", "/ckpt")),
    ("score", (None, [1, 2, 3])),
])
@pytest.mark.parametrize("shards", [1, 2])
def test_each_operation_is_one_call_of_the_actor_method_of_its_name(operation, args, shards):
    """On every shard of a sharded trainer, once each (a checkpoint's writing on rank 0 alone), and rank 0
    answers."""
    pool = TrainerPool([], TrainerPlacement(shards=shards))
    group = pool.groups["base"] = TrainerGroup("base", "/model", pool.placement)
    group.actors = [_FakeActor() for _ in range(shards)]
    group.open()
    answer = asyncio.run(getattr(TrainerClient(pool, "base"), operation)(*args))
    rank_zero = getattr(MultiLoRATrainer, operation).__dict__.get("on_rank_zero", False)
    assert rank_zero == operation.startswith("save_")  # writing a checkpoint: the adapters are alike on every shard
    for rank, actor in enumerate(group.actors):
        assert actor.calls == ([] if rank and rank_zero else [(operation, args, {})])
    assert answer == (None if operation not in {"load_state", "score"} else f"{operation} done")


def test_a_call_in_flight_when_the_trainer_dies_says_which_process_died_whoever_noticed_first(monkeypatch):
    """The pool's question to the trainer meets its death first, and the restart begins; the call in flight, failing
    after, says the same as a call made during the restart: which process of which group died (not Ray's text, nor
    the new process's pid)."""
    from ray.exceptions import RayActorError

    import adapters.trainer.group as group_module
    from adapters.trainer.interface import ModelFacts

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
        group = TrainerGroup("base", "/model", TrainerPlacement())
        group.actors = [Dying()]
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
        in_flight = asyncio.ensure_future(group.call("run_batch", []))
        await asyncio.sleep(0)
        group.check()
        await asyncio.sleep(0)
        answers["model_facts"].set_exception(RayActorError())
        await restarted.wait()
        answers["run_batch"].set_exception(RayActorError())
        said = []
        for call in (in_flight, group.call("run_batch", [])):
            with pytest.raises(ActorUnavailable) as failed:
                await call
            said.append(str(failed.value))
        group._restarting.cancel()
        return said

    said = ("trainer for base is not available: its process (pid 7) died; it restarts, and its training runs come back "
            "from their last checkpoints")
    assert asyncio.run(scenario()) == [said, said]
