"""The ``model`` values the OpenAI- and Anthropic-compatible routes take, in hosted Tinker's three forms:

- a base model, optionally with hosted Tinker's context suffix: ``Qwen/Qwen3-8B`` or ``Qwen/Qwen3-8B:peft:32768``;
- a sampler checkpoint's path, which runs on the base model it was trained on: ``tinker://…/sampler_weights/000080``;
- both, ``<base model>;<checkpoint path>``: the checkpoint on that base (which must be the one it was trained on),
  at that context.

Parsing only; which names exist, and whether the caller may use them, is the sampling service's to check.
"""

from __future__ import annotations

import re
from collections.abc import Container
from dataclasses import dataclass

CHECKPOINT_SCHEME = "tinker://"
_CONTEXT_SUFFIX = re.compile(r"(?P<base>.+):peft:(?P<context>[1-9][0-9]{0,11})")


@dataclass(frozen=True)
class ModelId:
    base: str | None
    """The base model's name as this server serves it (its context suffix removed), or None (a bare path)."""
    context: int | None = None
    """The context the ``:peft:<n>`` suffix asked for, or None."""
    path: str | None = None
    """The sampler checkpoint's ``tinker://`` path, or None (a base model alone)."""


def parse_model_id(model: str, served: Container[str]) -> ModelId:
    """``model`` in its parts. A name this server serves as it is (an operator may name a base model anything,
    colons included) is never split; otherwise a trailing ``:peft:<n>`` on the base part is the context asked for."""
    base, separator, path = model.rpartition(";")
    if not path.startswith(CHECKPOINT_SCHEME):
        base, path = model, None
    elif not separator or not base:
        return ModelId(None, None, path)
    if base in served:
        return ModelId(base, None, path)
    suffix = _CONTEXT_SUFFIX.fullmatch(base)
    if suffix is None:
        return ModelId(base, None, path)
    return ModelId(suffix["base"], int(suffix["context"]), path)
