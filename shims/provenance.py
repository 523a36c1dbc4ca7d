"""Provenance: which recorded sampled sequence each token of a training datum came from.

A datum may carry two span lists (``Datum.with_provenance`` in the SDK): ``model_input_spans`` tiling its input
tokens and ``loss_fn_input_spans`` tiling ``target_tokens``. Each span says "these positions are positions
``[offset, offset + length)`` of sequence ``sequence_id``'s request prompt" (``prompt``) or "…of its sampled tokens"
(``sampled``). ``stable_reinforce`` uses them to find the logprobs the sampler recorded for those tokens. Pure
functions: the lookup of recorded sequences is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from shims.errors import UserError


@dataclass(frozen=True)
class Span:
    kind: str
    """``prompt`` or ``sampled``."""
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class RecordedSequence:
    """What the sampler recorded for one sampled sequence (``record_stability_info=True``)."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


def spans_from_proto(spans: Sequence[pb.ProvenanceSpan], field: str) -> list[Span]:
    out = []
    for i, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise UserError(f"{field}[{i}] is neither a prompt nor a sampled span")
        arm = getattr(span, kind)
        if not arm.sequence_id or arm.offset < 0 or arm.length < 0:
            raise UserError(f"{field}[{i}] needs a sequence_id, offset ≥ 0 and length ≥ 0")
        out.append(Span("prompt" if kind == "prompt_tokens" else "sampled", arm.sequence_id, arm.offset, arm.length))
    return out


def check_tiling(spans: list[Span] | None, size: int, field: str, covers: str) -> None:
    """The runs must tile the field exactly, as the SDK's ``Datum.with_provenance`` promises."""
    if spans is not None and sum(s.length for s in spans) != size:
        raise UserError(f"{field} cover {sum(s.length for s in spans)} positions but {covers} has {size}; the spans "
                        "must tile it exactly")


def _recorded_run(span: Span, record: RecordedSequence, where: str) -> tuple[list[int], list[float] | None]:
    source = record.prompt if span.kind == "prompt" else record.tokens
    end = span.offset + span.length
    if end > len(source):
        raise UserError(f"{where}: positions [{span.offset}, {end}) lie beyond the {len(source)} {span.kind} tokens of "
                        f"sequence {span.sequence_id!r}")
    logprobs = record.logprobs[span.offset:end] if span.kind == "sampled" else None
    return source[span.offset:end], logprobs


def recorded_logprobs(tokens: np.ndarray, target_tokens: np.ndarray, model_input_spans: list[Span] | None,
                      loss_fn_input_spans: list[Span] | None, lookup: Callable[[str], RecordedSequence],
                      where: str) -> tuple[np.ndarray, np.ndarray]:
    """(recorded sampler logprobs, mask of the positions that have one), aligned with ``target_tokens``.

    Every span is checked against the record: the datum's input tokens must be the recorded prompt / sampled tokens
    they claim to be, and so must targets under a sampled span. Targets under a prompt span are not compared: the
    SDK's own recipes put placeholder targets (weighted 0) on prompt positions.
    """
    if model_input_spans is None or loss_fn_input_spans is None:
        raise UserError(f"{where}: stable_reinforce needs provenance (model_input_spans and loss_fn_input_spans): "
                        "sample with record_stability_info=True and build the datum with Datum.with_provenance "
                        "from the sequences' sequence_id")
    if target_tokens.ndim != 1:
        raise UserError(f"{where}: stable_reinforce takes target_tokens of shape [N], got {list(target_tokens.shape)}")
    position = 0
    for i, span in enumerate(model_input_spans):
        run, _ = _recorded_run(span, lookup(span.sequence_id), f"{where}: model_input_spans[{i}]")
        if tokens[position:position + span.length].tolist() != run:
            raise UserError(f"{where}: model_input_spans[{i}] claims positions {position}..{position + span.length} "
                            f"are {span.kind} tokens of {span.sequence_id!r}, but the tokens differ")
        position += span.length
    values = np.zeros(target_tokens.shape, dtype=np.float32)
    mask = np.zeros(target_tokens.shape, dtype=np.float32)
    position = 0
    for i, span in enumerate(loss_fn_input_spans):
        run, logprobs = _recorded_run(span, lookup(span.sequence_id), f"{where}: loss_fn_input_spans[{i}]")
        end = position + span.length
        if logprobs is not None:
            if target_tokens[position:end].tolist() != run:
                raise UserError(f"{where}: loss_fn_input_spans[{i}] claims target positions {position}..{end} are "
                                f"sampled tokens of {span.sequence_id!r}, but the tokens differ")
            values[position:end] = logprobs
            mask[position:end] = 1.0
        position = end
    return values, mask
