"""Which adapter each row of a batch goes through: the routing every LoRA module of one model reads.

The trainer and the transformers sampler sort a batch's rows by adapter, so each adapter's rows are one contiguous
slice; a LoRA module then adds each slice's delta to its slice of the base output (``adapters.lora.linear``,
``adapters.lora.experts``): a few small matmuls per adapter present, no per-row gather or scatter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Which adapter each row of the current batch uses: ``(name or None, first row, end row)`` slices in row order,
    covering the batch (None: the base model)."""

    groups: tuple[tuple[str | None, int, int], ...]

    @staticmethod
    def of(names: list[str | None]) -> Routing:
        """The slices of consecutive equal names (the caller sorts rows by adapter so each has one slice)."""
        groups: list[tuple[str | None, int, int]] = []
        for row, name in enumerate(names):
            if groups and groups[-1][0] == name:
                groups[-1] = (name, groups[-1][1], row + 1)
            else:
                groups.append((name, row, row + 1))
        return Routing(tuple(groups))

    @staticmethod
    def spans(names: list[str | None], sizes: list[int]) -> Routing:
        """The routing of a packed sequence: datum ``i`` is ``sizes[i]`` consecutive tokens through ``names[i]``, and
        each token counts as a row (``adapters.trainer.packing``). Rows are sorted by adapter as for ``of``."""
        groups: list[tuple[str | None, int, int]] = []
        end = 0
        for name, size in zip(names, sizes, strict=True):
            if groups and groups[-1][0] == name:
                groups[-1] = (name, groups[-1][1], end + size)
            else:
                groups.append((name, end, end + size))
            end += size
        return Routing(tuple(groups))

    @property
    def rows(self) -> int:
        return self.groups[-1][2]

    def sizes(self, tokens: int) -> list[int]:
        """Each group's share of ``tokens`` positions, the batch flattened row by row (a row: ``tokens // rows``)."""
        per_row = tokens // self.rows
        return [(hi - lo) * per_row for _, lo, hi in self.groups]


class Router:
    """The routing of the forward pass being run, shared by every LoRA module of one model."""

    def __init__(self) -> None:
        self.current: Routing | None = None
        self._row_groups: tuple[tuple, torch.Tensor] | None = None

    def row_groups(self, routing: Routing, device: torch.device) -> torch.Tensor:
        """``[rows, groups]``: True where a row belongs to a group; made once per routing for every layer."""
        key = (routing.groups, device)
        if self._row_groups is None or self._row_groups[0] != key:
            table = torch.zeros((routing.rows, len(routing.groups)), device=device, dtype=torch.bool)
            for i, (_, lo, hi) in enumerate(routing.groups):
                table[lo:hi, i] = True
            self._row_groups = (key, table)
        return self._row_groups[1]

    def routing(self, names: list[str | None] | None, sizes: list[int] | None = None):
        """A context in which rows go through ``names`` (None: every row through the base model); with ``sizes``, a
        packed sequence whose datum ``i`` is ``sizes[i]`` tokens (``Routing.spans``)."""
        if not names:
            return self.restored(None)
        return self.restored(Routing.of(names) if sizes is None else Routing.spans(names, sizes))

    @contextmanager
    def restored(self, routing: Routing | None) -> Iterator[None]:
        """A context in which ``routing`` is current again (a layer recomputed in backward: ``adapters.trainer.recompute``)."""
        previous, self.current = self.current, routing
        try:
            yield
        finally:
            self.current = previous

    def active(self, present: dict) -> Routing | None:
        """The current routing if any of its adapters is in ``present`` (a module's adapters), else None: the
        module then computes the base output alone."""
        routing = self.current
        if routing is None or not any(name in present for name, _, _ in routing.groups):
            return None
        return routing
