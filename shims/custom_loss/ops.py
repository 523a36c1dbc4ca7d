"""The one list of what a custom loss graph may do: functions, tensor methods, attributes and constants.

A graph from the wire (``tinker.types.CustomLossGraph``) names its operations as strings; these tables are the only
way a name becomes something callable. Nothing is looked up by a name from the wire in any module or object
(``getattr`` on a tensor happens only for a name in ``METHODS`` or ``ATTRIBUTES``), nothing is evaluated, and no
in-place operation, tensor factory that takes a size, or way out of torch (``item``, ``numpy``, ``backward``, hooks,
``.grad``, ``.data``) is listed.

Every listed operation makes outputs no larger than its tensor arguments broadcast together or taken together
(elementwise maths, reductions, shape views, ``cat`` / ``stack``, ``gather``, ``*_like``); the one exception, indexing
with an integer tensor, is sized before it runs (see ``shims.custom_loss.run``). That is what lets the interpreter
bound the memory a loss may take before each step runs, not after.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

_OPERATORS = [
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.neg, operator.pos, operator.abs, operator.invert, operator.and_, operator.or_, operator.xor,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.getitem,
]

_ELEMENTWISE = [
    "abs", "neg", "negative", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "square",
    "pow", "sigmoid", "tanh", "sin", "cos", "sign", "relu", "floor", "ceil", "round", "trunc", "reciprocal",
    "clamp", "clip", "clamp_min", "clamp_max", "minimum", "maximum", "fmin", "fmax", "where", "add", "sub",
    "subtract", "mul", "multiply", "div", "divide", "true_divide", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_not", "logical_xor", "isnan", "isinf", "isfinite", "nan_to_num",
    "masked_fill", "lerp", "xlogy", "logaddexp",
]
_REDUCTIONS = [
    "sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp",
    "cumsum", "softmax", "log_softmax", "std", "var", "any", "all", "count_nonzero", "sort", "topk", "dot",
]
_SHAPES = ["squeeze", "unsqueeze", "reshape", "flatten", "transpose", "permute", "t", "flip", "tril", "triu",
           "gather", "clone", "detach"]
_TORCH_ONLY = ["stack", "cat", "concat", "concatenate", "zeros_like", "ones_like", "full_like", "tensor", "as_tensor",
               "cosine_similarity"]
_METHOD_ONLY = ["view", "view_as", "reshape_as", "expand_as", "contiguous", "float", "double", "half", "bfloat16",
                "int", "long", "bool", "to", "type_as", "size", "dim", "numel", "norm"]  # torch.norm takes out=

_FUNCTIONAL = [  # not relu, silu, elu, leaky_relu (an in-place flag) nor normalize (an out argument)
    "logsigmoid", "softplus", "log_softmax", "softmax", "sigmoid", "tanh", "gelu",
    "binary_cross_entropy_with_logits", "binary_cross_entropy", "mse_loss", "l1_loss", "smooth_l1_loss",
    "huber_loss", "kl_div", "cross_entropy", "nll_loss", "cosine_similarity",
]
_SPECIAL = ["expit", "logit", "xlogy", "entr", "log_softmax", "softmax", "log1p", "expm1", "logsumexp", "exp2"]
_MATH = ["sqrt", "log", "log1p", "log2", "log10", "exp", "expm1", "tanh", "floor", "ceil", "fabs", "isfinite",
         "isnan", "isinf"]


def _wire_names(fn, public: str) -> set[str]:
    """The names a client may send for ``fn``: the one torch.fx records on this torch version (as the SDK encodes it,
    ``_operator.x`` as ``operator.x``) and its public name, which other torch versions may record instead."""
    from torch.fx.node import _get_qualified_name  # what the SDK's encode_graph uses

    return {public, _get_qualified_name(fn).replace("_operator.", "operator.", 1)}


def _table() -> dict[str, object]:
    table: dict[str, object] = {}

    def add(fn, public: str) -> None:
        for name in _wire_names(fn, public):
            table[name] = fn

    for fn in _OPERATORS:
        add(fn, f"operator.{fn.__name__}")
    for name in [*_ELEMENTWISE, *_REDUCTIONS, *_SHAPES, *_TORCH_ONLY]:
        add(torch.__dict__[name], f"torch.{name}")
    for name in _FUNCTIONAL:
        add(F.__dict__[name], f"torch.nn.functional.{name}")
    for name in _SPECIAL:
        add(torch.special.__dict__[name], f"torch.special.{name}")
    for name in _MATH:
        add(math.__dict__[name], f"math.{name}")
    # getattr is only ever called on ATTRIBUTES (see shims.custom_loss.run)
    table["getattr"] = table["builtins.getattr"] = getattr
    return table


FUNCTIONS: dict[str, object] = _table()
"""Wire name of a ``call_function`` target → the function it runs."""

METHODS: frozenset[str] = frozenset([*_ELEMENTWISE, *_REDUCTIONS, *_SHAPES, *_METHOD_ONLY])
"""``call_method`` targets: tensor methods, called only on a tensor."""

TENSOR_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T", "mT"})
RESULT_ATTRIBUTES = frozenset({"values", "indices"})
"""``getattr`` targets: on a tensor, and on the (values, indices) results of ``max(dim)``, ``sort``, ``topk``."""
ATTRIBUTES = TENSOR_ATTRIBUTES | RESULT_ATTRIBUTES

REFUSED_KEYWORDS = frozenset({"out", "inplace"})
"""Keyword arguments that would write into an existing tensor (an input, or logprobs)."""

OPERATORS = frozenset(_OPERATORS)

SEQUENCE_OPERATORS = frozenset({operator.add, operator.getitem, operator.eq, operator.ne})
"""The only operators that may take a tuple, list or string (``x.shape[0]``, ``shape + (1,)``); ``shape * 10 ** 9``
and the like are refused."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
LAYOUTS = {"strided": torch.strided}
MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format}
FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
DEVICES = ("cpu", "cuda")
"""Devices a graph may name (``cuda:N`` too); every one means the device the loss runs on."""
