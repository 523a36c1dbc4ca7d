"""How large a client's custom loss may be, apart from the graph compiler: the config reads these limits without
importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CustomLossLimits:
    """How large a custom loss may be (``--custom-loss-max-*``)."""

    max_nodes: int = 1000
    """Nodes in the graph, placeholders and output included."""
    max_nesting: int = 8
    """Depth of an argument's lists, tuples, dicts and slices."""
    max_constants: int = 4096
    """Scalars, strings and references in all the graph's arguments together; also the longest tuple or list a step
    may make, and the most Python values an index may hold."""
    max_elements: int = 2**26
    """Tensor elements one datum's loss may compute, all its steps together (2**26 float32 values: 256 MiB)."""
    max_seconds: float = 10.0
    """Time one datum's loss may take, all its steps together; checked after each step (each step is bounded by
    ``max_elements``, so one step cannot run long)."""

    def encoded_bytes(self) -> int:
        """A bound on the encoded size of a graph within these limits (each node's fixed fields, each constant at
        its longest): the most a ``create_custom_loss`` body needs, so a larger one is refused before it is read."""
        return 4096 + self.max_nodes * 1024 + self.max_constants * 320
