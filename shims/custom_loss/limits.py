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
    """Scalars and strings in all the graph's arguments together; also the longest tuple or list a step may make."""
    max_elements: int = 2**26
    """Tensor elements one datum's loss may compute, all its steps together (2**26 float32 values: 256 MiB)."""
