"""How large a client's custom loss may be, apart from the graph compiler: the server options ``--custom-loss-max-*``,
declared here once, each with its default, help and check (``shims.option``), which the CLI reads without importing
torch. ``compat_server.config.ServerConfig`` holds them as ``custom_loss``."""

from __future__ import annotations

from dataclasses import dataclass

from shims.option import ABOVE_ZERO, at_least, option


@dataclass(frozen=True)
class CustomLossLimits:
    """How large a custom loss may be (``--custom-loss-max-*``)."""

    max_nodes: int = option(1000, "most nodes in an uploaded custom loss graph (default: %(default)s)",
                            flag="--custom-loss-max-nodes", check=at_least(1))
    """Nodes in the graph, placeholders and output included."""
    max_nesting: int = option(
        8, flag="--custom-loss-max-nesting", check=at_least(1),
        help="deepest nesting of lists, tuples and slices in a custom loss graph's arguments (default: %(default)s)")
    """Depth of an argument's lists, tuples, dicts and slices."""
    max_constants: int = option(
        4096, flag="--custom-loss-max-constants", check=at_least(1),
        help="most constants (numbers, strings) in a custom loss graph, and the longest tuple or list it may make "
             "(default: %(default)s)")
    """Scalars, strings and references in all the graph's arguments together; also the longest tuple or list a step
    may make, and the most Python values an index may hold."""
    max_elements: int = option(
        2**26, flag="--custom-loss-max-elements", check=at_least(1),
        help="most tensor elements a custom loss may compute for one datum, all its steps together (default: "
             "%(default)s, 256 MiB of float32)")
    """Tensor elements one datum's loss may compute, all its steps together (2**26 float32 values: 256 MiB)."""
    max_seconds: float = option(
        10.0, flag="--custom-loss-max-seconds", check=ABOVE_ZERO,
        help="most seconds a request's custom loss may take, forward and backward, over all its datums together; "
             "a loss that takes longer fails its own request (default: %(default)s)")
    """Time one request's custom loss may take on a trainer, every datum's steps and the loss's backward together;
    checked after each step and before each backward node (each step is bounded by ``max_elements``, and the
    allowed operations cost about their elements, so no one step runs long)."""

    def encoded_bytes(self) -> int:
        """A bound on the encoded size of a graph within these limits (each node's fixed fields, each constant at
        its longest): the most a ``create_custom_loss`` body needs, so a larger one is refused before it is read."""
        return 4096 + self.max_nodes * 1024 + self.max_constants * 320
