"""One base model's trainer in the Ray cluster: N actors (``--trainer-shards N``; 1: the whole model in one actor),
started together, called together and restarted together.

The group is called as one ``Trainer`` (``calls``: a proxy whose methods are the Protocol's). Shards are a
``torch.distributed`` group (``adapters.trainer.shards``): every call goes to every shard, in the same order on each
(all calls are submitted before any is awaited, and Ray runs one caller's calls to an actor in order), and rank 0's
outcome is the answer. Shards of one group are placed by one Ray placement group, one bundle each, packed
on as few nodes as hold them; rank 0 listens for the others on a port of its node.

A group whose shard dies cannot go on: the others wait for it in a collective. So any shard's death (or shards that
disagree: one fails a call the others ran) kills every shard, and the group starts again, empty; ``on_restart`` then
reloads its runs from their checkpoints. Calls in flight fail with the error of a crashed trainer; calls made while
it restarts are refused at once, saying so. A single trainer is restarted the same way.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from adapters.actors import ActorRestarting, ActorUnavailable, Around, actor_proxy, await_call, proxy
from adapters.boundary import Method, actor_class, method_of
from adapters.trainer.interface import SEE_ALL_GPUS, TRAINER_CLASS, ModelFacts, ShardSpec, Trainer
from adapters.trainer.options import TrainerOptions
from shims.errors import ConfigurationRefused

log = logging.getLogger("compat_server.trainer")

DISAGREEMENT_WAIT_SECONDS = 60.0
"""How long the other shards may still run once one shard failed a call: longer, and they wait in a collective for
the one that gave up, and the group restarts."""
RESTART_RETRY_SECONDS = 5.0


def _died(failure: BaseException | None) -> bool:
    """Whether a call failed because its actor's process is gone (not because the actor was briefly out of reach:
    Ray's ``ActorUnavailableError``, which a later call may not meet)."""
    return isinstance(failure, ActorUnavailable) and not isinstance(failure, ActorRestarting)


@ray.remote(num_cpus=0)
def _rendezvous_address() -> str:
    """A free TCP port on the node this runs on (rank 0's: it is scheduled into the first shard's bundle)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


class TrainerGroup:
    """The actors of one base model's trainer; ``TrainerPool`` holds one per base model."""

    def __init__(self, name: str, location: str, options: TrainerOptions,
                 on_restart: Callable[[], Awaitable[None]] | None = None) -> None:
        self.name = name
        self.location = location
        self.options = options
        self.on_restart = on_restart
        """Called once the group is back after a restart, empty (the pool reloads its runs)."""
        self.actors: list[ray.actor.ActorHandle] = []
        self.shards: list[Trainer] = []
        """Each shard alone (its questions while the group is idle: ``check``)."""
        self.facts: list[ModelFacts] = []
        """Every shard's facts, by rank (rank 0's answer for the trainer as a whole)."""
        self.restarts = 0
        self._placement_group = None
        self._open = False
        self._restarting: asyncio.Task | None = None
        self._why = ""
        """Why the group is restarting."""
        self._again: str | None = None
        """A fault met while the runs were being reloaded after a restart: restart once more."""
        self._pings: list[asyncio.Task | None] = []

    @property
    def size(self) -> int:
        return self.options.shards

    @property
    def what(self) -> str:
        return f"trainer for {self.name}"

    # ---- starting ---------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the shards and wait until every one has loaded its part of the base model."""
        if self.size > 1 and self._placement_group is None:
            self._placement_group = await self._place()
        address = None
        if self.size > 1:
            address = await _rendezvous_address.options(scheduling_strategy=self._bundle(0)).remote()
        remote_cls = ray.remote(actor_class(Trainer, TRAINER_CLASS, concurrent=False))
        self.actors = [remote_cls.options(**self._actor_options(rank)).remote(
            self.location, self.options, ShardSpec(rank, self.size, address) if address else None)
            for rank in range(self.size)]
        self.shards = [actor_proxy(actor, Trainer, self.what, cancel=False) for actor in self.actors]
        self._pings = [None] * self.size
        self.facts = await self._all(method_of(Trainer, Trainer.model_facts), (), {}, starting=True)

    def calls(self, around: Around | None = None) -> Trainer:
        """The group as one trainer: each call on every shard (``call``), inside ``around`` if given."""
        return proxy(Trainer, self.call, self.what, around)

    def open(self) -> None:
        """Let calls in (after ``start``, and after a restart once the runs are reloaded)."""
        self._open = True

    def _actor_options(self, rank: int) -> dict[str, Any]:
        p = self.options
        # Ray restarts nothing itself: a shard cannot rejoin its group alone (``_restart``).
        options: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
        options |= {"num_cpus": p.cpus, "num_gpus": p.gpus or 0.0, "resources": p.resources or None}
        if self.size == 1:
            return options
        options["scheduling_strategy"] = self._bundle(rank)
        if p.gpus:  # each shard sees its node's GPUs, so that NCCL reaches its peers directly
            options["runtime_env"] = {"env_vars": {SEE_ALL_GPUS: "1"}}
        return options

    def _bundle(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self._placement_group, placement_group_bundle_index=rank)

    async def _place(self):
        """One bundle per shard, packed on as few nodes as hold them; refused, naming what is missing, if the
        cluster cannot hold them within ``--placement-timeout`` seconds."""
        bundle = self.options.bundle()
        group = placement_group([bundle] * self.size, strategy="PACK")
        try:
            await asyncio.wait_for(group.ready(), self.options.placement_timeout)
        except TimeoutError:
            remove_placement_group(group)
            free = {name: ray.available_resources().get(name, 0.0) for name in bundle}
            raise ConfigurationRefused(
                f"the Ray cluster cannot place the {self.size} trainer shards of {self.name} (--trainer-shards "
                f"{self.size}), each needing {bundle}: it has {free} free after {self.options.placement_timeout:g} s "
                "(--placement-timeout); add nodes or devices, or lower --trainer-shards, --trainer-cpus or "
                "--trainer-gpus") from None
        return group

    # ---- calling ----------------------------------------------------------------------------------------------------
    async def call(self, method: Method, args: tuple, kwargs: dict) -> Any:
        """``method`` on every shard (on rank 0 alone for a method marked ``on_rank_zero``); rank 0's result, or its
        error; of a ``by_reference`` method, rank 0's receipt and a tuple of every shard's value's reference. A dead shard, or shards that disagree, restart the group and fail the call as a trainer that
        crashed."""
        if not self._open and asyncio.current_task() is not self._restarting:  # the reload's own calls go through
            raise self._unavailable(self._why)
        answers = await self._all(method, args, kwargs)
        if method.by_reference and len(answers) > 1:  # rank 0's receipt, and every shard's value where it put it
            return answers[0][0], tuple(value for _, value in answers)
        return answers[0]

    def _unavailable(self, why: str) -> ActorUnavailable:
        """What a call the group could not run gets: the same words in flight and while it restarts."""
        return ActorUnavailable(f"{self.what} is not available: {why}; it restarts, and its training runs come back "
                                "from their last checkpoints")

    async def _all(self, method: Method, args: tuple, kwargs: dict, starting: bool = False) -> list:
        """``method`` on the shards (``call``). ``starting``: the group's first call, whose failure is the start's,
        for its caller to report (a shard that cannot load the model says why in its own error)."""
        group = actors = self.actors
        facts = self.facts  # of this group, whatever a restart does meanwhile
        if len(actors) > 1 and method.rank_zero:
            actors = actors[:1]
        refs = [method.submit(actor, args, kwargs) for actor in actors]  # submitted in one go: the same order on each
        # A by_reference call's receipt is awaited, its value left where the shard put it (``adapters.boundary``).
        awaited = [ref[0] for ref in refs] if method.by_reference else refs
        tasks = [asyncio.ensure_future(await_call(ref, self.what, method.name, cancel=len(refs) == 1))
                 for ref in awaited]
        for task in tasks:  # a caller that stops waiting leaves the shards' calls to finish, their errors read
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            if len(tasks) == 1:
                tasks[0].cancel()
            raise
        dead = next((rank for rank, t in enumerate(tasks) if t in done and _died(t.exception())), None)
        if pending and dead is None:  # one shard failed; the others may be waiting for it in a collective
            _, pending = await asyncio.wait(pending, timeout=DISAGREEMENT_WAIT_SECONDS)
        failures = [t.exception() if t.done() else None for t in tasks]
        if dead is not None:
            why = f"{self._process(dead, facts)} died"
        elif pending:
            failed = next(rank for rank, failure in enumerate(failures) if failure is not None)
            why = f"{self._process(failed, facts)} failed {method.name} ({failures[failed]}) while the others went on"
        elif any(failures) and not all(type(f) is type(failures[0]) for f in failures):
            why = f"its shards disagreed on {method.name}: " + "; ".join(
                f"shard {rank}: {failure or 'done'}" for rank, failure in enumerate(failures))
        else:
            if failures[0] is not None:
                raise failures[0]
            if method.by_reference:
                return [(t.result(), ref[1]) for t, ref in zip(tasks, refs, strict=True)]
            return [t.result() for t in tasks]
        if group is not self.actors and self._why:
            # The group was restarted while this call ran: a question found a shard dead first, and the restart
            # killed the others, so the fault's own reason names the process that failed, not one the restart killed.
            why = self._why
        if starting:
            raise next((f for f in failures if f is not None), None) or ActorUnavailable(f"{self.what}: {why}")
        self._fault(why, group)
        raise self._unavailable(why)

    def _process(self, rank: int, facts: list[ModelFacts]) -> str:
        """How a log line names the process of shard ``rank`` (``facts``: its group's)."""
        pid = f"pid {facts[rank].pid}" if rank < len(facts) else "starting"
        return f"its process ({pid})" if self.size == 1 else f"its shard {rank} of {self.size} ({pid})"

    # ---- faults -----------------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Ask every shard who it is, one question at a time each, so that a shard that died while the group was
        idle restarts the group now rather than at its next call."""
        if not self._open:
            return
        for rank, shard in enumerate(self.shards):
            if self._pings[rank] is None or self._pings[rank].done():
                self._pings[rank] = asyncio.ensure_future(self._ping(rank, shard))

    async def _ping(self, rank: int, shard: Trainer) -> None:
        actors, facts = self.actors, self.facts
        try:
            answer = await shard.model_facts()
        except Exception as exc:  # noqa: BLE001 - a question unanswered, for whatever reason, is asked again
            if _died(exc):
                self._fault(f"{self._process(rank, facts)} died", actors)
            return
        if actors is self.actors:
            self.facts[rank] = answer  # what it holds now

    def _fault(self, why: str, actors: list) -> None:
        """The group ``actors`` cannot go on: kill every shard and start again (once, however many calls saw it; a
        fault while the runs are being reloaded after a restart starts it again once the reload is over)."""
        if actors is not self.actors:
            return
        if self._restarting is not None and not self._restarting.done():
            self._again = why
            return
        self._open, self._why = False, why
        log.warning("%s: %s; restarting it", self.what, why, extra={"event": "trainer_failed"})
        self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        while True:
            self._again = None
            self._kill()
            while True:
                try:
                    await self.start()
                    break
                except Exception as exc:  # noqa: BLE001 - keep trying: the cluster may need time to free devices
                    log.warning("%s could not restart (%s); trying again in %.0f s", self.what, exc,
                                RESTART_RETRY_SECONDS)
                    self._kill()
                    await asyncio.sleep(RESTART_RETRY_SECONDS)
            self.restarts += 1
            log.warning("%s restarted (pid %s); reloading its training runs", self.what,
                        ", ".join(str(f.pid) for f in self.facts))
            if self.on_restart is not None:
                try:
                    await self.on_restart()  # its calls go through (``call``)
                except Exception:  # runs that did not come back are marked so by the reload itself
                    log.exception("%s: reloading its training runs failed", self.what)
            if self._again is None:
                break
            self._why = self._again
            log.warning("%s: %s while its runs were reloaded; restarting it again", self.what, self._why)
        self.open()

    def _kill(self) -> None:
        """Kill every process of the group. The group's list of actors is replaced first, so that the calls and
        questions this fails are seen to be the old group's (``_fault``), not a fault of the one that follows."""
        old, self.actors, self.shards = self.actors, [], []
        for actor in old:
            ray.kill(actor, no_restart=True)

    def stop(self) -> None:
        for task in [self._restarting, *self._pings]:
            if task is not None:
                task.cancel()
        self._kill()
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None
