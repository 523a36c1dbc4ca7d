"""Whether a training pass may keep its decoder layers' activations, decided by the memory it would take.

Activation checkpointing (``adapters.trainer.recompute``) bounds a long batch's memory at the price of one more
forward of every layer in backward: about a third more arithmetic per step. That price is worth paying only when the
activations would not fit. A fixed token count cannot say when that is: 4,096 tokens of a 4-layer, 768-wide model
keep about half a GiB, of a 48-layer MoE several GiB. So by default the trainer measures what its own model keeps per
token, once, when it starts (``kept_per_token``: two short probe passes through a temporary adapter, counting the
tensors autograd saves for backward), and a pass keeps its activations when they would take at most
``KEEP_SHARE`` of the memory free on its device at that moment, else checkpoints (``ActivationBudget``).
``--activation-checkpointing-tokens N`` replaces the decision by a fixed count (0: never checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

from adapters.cpu_memory import heap_free_bytes
from shims.errors import UserError

KEEP_SHARE = 1 / 3
"""The share of the device's free memory a pass's kept activations may take. The rest is headroom for what backward
allocates beside them (gradients of each layer's activations, the head's logits chunk) and for the other processes
that share the device (samplers, other trainers), which may allocate while the pass runs."""

PROBE_TOKENS = 128
"""Tokens of the shorter probe pass; the longer has twice as many. The difference between the two is what each
further token keeps, whatever the passes keep that does not grow with the tokens (weights saved for backward)."""


def available_bytes(device: torch.device) -> int:
    """Memory a pass on ``device`` may still allocate: a GPU's free memory plus what torch's allocator holds unused;
    on the CPU what the system calls available, within this process's cgroup limit (``docker run --memory``), plus
    what this process's allocator holds free (``adapters.cpu_memory``: a CPU trainer keeps what its passes free)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    available = psutil.virtual_memory().available
    left = cgroup_memory_left()
    return int(available if left is None else min(available, left)) + heap_free_bytes()


def cgroup_memory_left(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's cgroup may still use (v2 ``memory.max`` − ``memory.current``, or v1's limit − usage), or
    None when unlimited or unknown."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


class SavedBytes:
    """Bytes of the tensor storages autograd saved for backward within a ``counting_saved`` block, each once."""

    def __init__(self) -> None:
        self.total = 0
        self._seen: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.total += storage.nbytes()
        return tensor


@contextmanager
def counting_saved() -> Iterator[SavedBytes]:
    """Within this block, count what autograd saves for backward (the tensors themselves are saved as usual)."""
    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        yield saved


def kept_per_token(forward: Callable[[int], object]) -> float:
    """Bytes a training pass keeps for backward per token: ``forward(n)`` runs a pass over ``n`` tokens (with
    gradients), at ``PROBE_TOKENS`` and twice that; the difference of what each kept, per token of difference."""
    kept = []
    for tokens in (PROBE_TOKENS, 2 * PROBE_TOKENS):
        with torch.enable_grad(), counting_saved() as saved:
            forward(tokens)
        kept.append(saved.total)
    return max(kept[1] - kept[0], 0) / PROBE_TOKENS


class DoesNotFit(UserError):
    """A training pass whose activations would not fit in the memory free for it (``ActivationBudget.shortfall``).
    Every shard of a sharded trainer raises it at the same point, before the pass's first collective of the model
    (``adapters.trainer.passes``), so the group goes on: the requests of the batch run again one by one, and only one
    that does not fit alone fails (``adapters.trainer.forward``)."""


class ActivationBudget:
    """Decides, pass by pass, whether a pass's activations fit (see the module docstring), and whether they fit at
    all: a pass that would not fit even checkpointed is refused before it runs rather than failing inside it, where
    an out-of-memory on the CPU is the process killed, and on one shard of a sharded trainer the group lost."""

    def __init__(self, per_token: float, layer_input: float, layers: int, device: torch.device,
                 cap: int | None = None) -> None:
        self.per_token = per_token
        """Bytes a pass keeps per token (``kept_per_token``)."""
        self.checkpointed_per_token = layers * layer_input + per_token / max(layers, 1)
        """Bytes a checkpointed pass holds per token at its peak: every decoder layer's input (what a checkpointed
        layer keeps), and in backward one layer's activations, recomputed."""
        self.device = device
        self.cap = cap
        """Most bytes a pass may use whatever is free (``--activation-memory-mib``), or None."""

    def free(self) -> int:
        """Bytes free for a pass on this device now: read once per pass (``adapters.trainer.passes``) and handed
        to the decisions below, which all see the same figure."""
        return available_bytes(self.device)

    def usable(self, free: int | None = None) -> int:
        """What a pass counts on, of ``free`` (None: read now): all of it, or the cap when lower."""
        free = self.free() if free is None else free
        return free if self.cap is None else min(free, self.cap)

    def fits(self, tokens: int, free: int | None = None) -> bool:
        """Whether a pass over ``tokens`` may keep its activations."""
        return tokens * self.per_token <= self.room(free)

    def needed(self, tokens: int, checkpointed: bool) -> float:
        """Bytes a pass over ``tokens`` holds for backward, checkpointed or not (``KEEP_SHARE`` of the memory
        available is what it may take: the rest is what backward allocates beside them)."""
        return tokens * (self.checkpointed_per_token if checkpointed else self.per_token)

    def room(self, free: int | None = None) -> float:
        """Bytes a pass's activations may take: ``KEEP_SHARE`` of the memory usable."""
        return KEEP_SHARE * self.usable(free)

    def shortfall(self, tokens: int, checkpointed: bool, free: int | None = None) -> str | None:
        """Why a training pass over ``tokens`` tokens cannot run, or None when it can."""
        free = self.free() if free is None else free
        needed, usable = self.needed(tokens, checkpointed), self.usable(free)
        if needed <= KEEP_SHARE * usable:
            return None
        how = ("with every decoder layer recomputed in backward" if checkpointed else
               "keeping its activations (passes that checkpoint: --activation-checkpointing-tokens)")
        limit = " (--activation-memory-mib)" if usable < free else ""
        return (f"a training pass of {tokens} tokens would hold about {needed / 2**20:.0f} MiB of activations "
                f"{how}, more than a third of the {usable / 2**20:.0f} MiB available on {self.device}{limit}; "
                f"send fewer tokens per call")

    def tokens_now(self) -> int:
        """The most tokens a pass may hold now and keep its activations (for the trainer's ready line)."""
        return math.floor(self.room() / max(self.per_token, 1.0))
