"""How many torch threads each trainer and sampler actor runs, and how idle threads wait.

Ray starts an actor with ``OMP_NUM_THREADS`` set to the CPUs it reserves (``--trainer-cpus``, ``--sampler-cpus``:
1 by default), so left alone the trainer runs torch on one core of the machine it has to itself: measured through
the SDK on 2 cores, 0.56× plain PEFT (issue 34). Reservations are Ray's bookkeeping for placement; threads are what
does the work. So by default every actor runs as many torch threads as the CPUs its process may use on its node
(``usable_cpus``: its affinity mask, within its container's CPU quota), and the CPUs are shared in time, not split:

- **One busy actor gets the whole machine.** An RL loop samples, then trains; a supervised run only trains. Split
  evenly, each phase would run on half the cores.
- **A transformers sampler's idle threads sleep** (``OMP_WAIT_POLICY=PASSIVE``, set in its actor's environment before
  torch loads, unless the operator set it; vLLM's workers keep vLLM's settings). OpenMP threads spin for a while after
  each parallel region; decoding runs thousands of tiny regions, so a decoder's threads spin almost all the time, on
  the cores the trainer needs. Measured on 2 cores, a trainer step loop and a decode loop running at once, 2 threads
  each: decode fell from 139 tokens/s (1 thread each, cores split) to 12 with both spinning, and ran at 93-99 with the
  decoder's threads sleeping (the trainer at 186, 317-327; 291 split). The trainer's regions are long matmuls, its
  threads seldom wait, and whether they spin changed nothing there (317 spinning, 327 sleeping), while sleeping cost
  the trainer about 3% through the server alone, so the trainer keeps OpenMP's default.
- **Processes that are always busy together divide the cores**: the shards of one sharded trainer on one machine
  run every pass in lockstep, so each takes its share (``peers`` below); a vLLM engine's CPU workers get their own
  cores (vLLM's binding, ``adapters.samplers.vllm.parallel``). Several sampler replicas of one model on one machine
  (``--samplers N``) each take every CPU: under load they are busy together, and ``--sampler-threads`` splits them.

- **A trainer pass too small to split runs on one thread** (``PassThreads``): below a few million multiply-adds per
  matmul, OpenMP's threads cost more in waking and waiting than they save, and on a machine whose cores the server
  and its clients share, a second thread spinning between the small regions takes the core they need.

``--trainer-threads`` and ``--sampler-threads`` override the count (for example to split the cores between a trainer
and samplers that are busy at the same time). Each actor reports the count torch actually runs with, read inside the
actor (``/api/v1/metrics``, the ready line).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

WAIT_POLICY = "OMP_WAIT_POLICY"


def sampler_environment(backend: str) -> dict[str, str]:
    """Environment variables for a sampler actor's ``runtime_env``: a transformers sampler's idle OpenMP threads
    sleep, unless the operator chose a policy in the server's environment (then theirs, which the actor inherits
    anyway). vLLM's CPU workers are left as vLLM runs them, bound to their own cores."""
    return {} if backend == "vllm" or WAIT_POLICY in os.environ else {WAIT_POLICY: "PASSIVE"}


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, within its cgroup's CPU quota (``docker run --cpus 4``
    leaves all of the host's cores in the mask but lets the container use 4 of them)."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time this process's cgroup may use (cgroup v2 ``cpu.max``, or v1's CFS quota), or None when
    unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def default_threads(usable: int, peers: int = 1) -> int:
    """Threads for one of ``peers`` processes that share ``usable`` CPUs and are always busy together (the shards
    of one trainer on one node): an even share, at least one."""
    return max(1, usable // max(peers, 1))


def set_torch_threads(configured: int | None, peers: int = 1) -> int:
    """Set this process's torch threads (``configured``, else ``default_threads`` of its usable CPUs) and return the
    count torch reports back."""
    import torch

    torch.set_num_threads(configured or default_threads(usable_cpus(), peers))
    return torch.get_num_threads()


SPLIT_WORK = 2**24
"""Multiply-adds in a layer's largest matmul (tokens × the layer's largest weight) below which a trainer pass runs on
one thread. Measured through the server on 2 cores (``bench/RESULTS.md``, issue 44), a forward_backward + optim_step
with 1 and with 2 threads: the tiny model (largest weight 256 × 512) at 32 tokens 24 against 31 ms and at 128 tokens
(2**24) 36 against 36–44 ms; cpu-768 (768 × 2,048) at 16 tokens (2**24.6) 114–121 ms either way, at 32 tokens 162
against 134 ms. In one process alone, 2 threads gained nothing below this either."""


class PassThreads:
    """The torch threads of each trainer pass: all of ``most`` for a pass whose matmuls are worth splitting, one for a
    smaller pass (``SPLIT_WORK``); always ``most`` when the operator fixed the count (``--trainer-threads``)."""

    def __init__(self, most: int, per_token: int, fixed: bool) -> None:
        """``per_token``: multiply-adds per token of a decoder layer's largest matmul (its largest weight)."""
        self.most, self.per_token, self.fixed = most, per_token, fixed

    def count(self, tokens: int) -> int:
        return self.most if self.fixed or tokens * self.per_token >= SPLIT_WORK else 1

    def set_for(self, tokens: int) -> None:
        """Set this thread's torch threads for a pass over ``tokens`` tokens."""
        import torch

        wanted = self.count(tokens)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
