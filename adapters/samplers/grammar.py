"""Constrained decoding (``OutputConstraint``) for the sampler that computes logits itself, with xgrammar: the grammar
engine the vLLM backend runs with, compiled the way vLLM compiles it, so both backends accept exactly the same texts.

A JSON Schema is compiled once per tokenizer (``JsonGrammars``, which keeps the latest ``GRAMMAR_CACHE_SIZE``); each
sequence then walks its grammar (``ConstrainedSequence``): before every step its next-token bitmask sends every
token the grammar does not allow to -inf, and the token chosen advances it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable

import torch
import xgrammar as xgr

from shims.errors import UserError
from shims.sampling.job import OutputConstraint, SampleJob
from shims.sampling.json_schema_limits import admits_nothing, unsupported_features

GRAMMAR_CACHE_SIZE = 64
"""Compiled grammars kept per tokenizer (keyed by schema text): an agent sending the same few schemas over and over
compiles each once, and a stream of distinct schemas cannot grow the cache without bound."""

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""What a constraint without a schema compiles to: any JSON object. vLLM compiles its ``json_object`` option from this
same schema, so the two backends agree on it too."""


def schema_of(constraint: OutputConstraint) -> str:
    """The JSON Schema text a constraint compiles from."""
    return JSON_OBJECT_SCHEMA if constraint.json_schema is None else constraint.json_schema


def check_constraint(constraint: OutputConstraint | None) -> None:
    """Raise ``UserError`` when xgrammar cannot turn the constraint's schema into a grammar. Both backends check here
    as a request arrives: an invalid schema gets the same answer from each, and fails its own request alone rather
    than a batch it would have joined."""
    if constraint is not None:
        _check_schema(schema_of(constraint))


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _check_schema(schema: str) -> None:
    _convert(schema, xgr.Grammar.from_json_schema)


def _convert(schema: str, convert, any_whitespace: bool = True):
    """``convert(schema, any_whitespace=…, strict_mode=True)`` (vLLM's settings), its failure a ``UserError``."""
    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise UserError(f"the JSON schema of the output constraint is not valid JSON: {exc}") from None
    try:
        converted = convert(schema, any_whitespace=any_whitespace, strict_mode=True)
    except RuntimeError as exc:  # xgrammar's C++ errors, prefixed with a timestamp and a source location
        reason = re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?", "", str(exc).strip()).splitlines()[0]
        raise UserError(f"the JSON schema of the output constraint cannot be used: {reason}") from None
    if unsupported := unsupported_features(parsed):
        raise UserError(f"the JSON schema of the output constraint uses what constrained decoding cannot enforce: "
                        f"{'; '.join(unsupported)}")
    if empty := admits_nothing(parsed):
        raise UserError(f"the JSON schema of the output constraint {empty}")
    return converted


def no_next_token(written: int) -> UserError:
    """The error of a sequence whose grammar allows no token after the ``written`` tokens it has: a schema that no
    text satisfies (an impossible ``pattern``, a recursion with no base case that the checks before sampling could
    not see) or none the model's vocabulary can spell. The request fails alone: sampling from a row of logits that
    are all -inf would mean NaN probabilities."""
    return UserError(f"the output constraint admits no next token after {written} tokens: no text the model can "
                     f"write from there satisfies its JSON schema")


class ConstrainedSequence:
    """One sequence's place in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: Iterable[int], vocab_size: int) -> None:
        """``stop_ids``: the tokens that end the text once the grammar is complete (vLLM's: the end-of-sequence
        tokens and the request's stop token ids)."""
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(set(stop_ids)))
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._accepted = 0

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of one row of (finite) logits in which every token the grammar does not allow next is
        -inf; ``no_next_token`` raised when it allows none. xgrammar applies its bitmask on the logits' own device
        (a CPU or a CUDA kernel), so the bitmask, filled on the host, goes there first."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        out = logits.to(torch.float32, copy=True).unsqueeze(0)
        xgr.apply_token_bitmask_inplace(out, self._bitmask.to(out.device))
        if not bool(torch.isfinite(out).any()):
            raise no_next_token(self._accepted)
        return out[0]

    def accept(self, token: int) -> None:
        """Advance past ``token``, a token ``masked`` allowed."""
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"the output constraint's grammar rejected token {token}, which its mask allowed")
        self._accepted += 1

    @property
    def terminated(self) -> bool:
        """Whether the text is complete: the grammar has accepted one of its stop tokens."""
        return self._matcher.is_terminated()


class JsonGrammars:
    """xgrammar's compiler for one tokenizer, and the grammars it compiled. The compiler is made on first use: it
    reads the whole vocabulary, which a server that never sees a constraint need not pay for."""

    def __init__(self, tokenizer, vocab_size: int, disable_any_whitespace: bool) -> None:
        """``vocab_size``: the width of the model's logits (its config's ``vocab_size``), which may exceed the
        tokenizer's vocabulary; the ids beyond it are never allowed. ``disable_any_whitespace``: JSON without the
        optional whitespace between tokens, compiled as vLLM compiles it for its setting of that name."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compact = disable_any_whitespace
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile)

    def for_job(self, job: SampleJob, eos_ids: Iterable[int]) -> ConstrainedSequence | None:
        """A new sequence under the job's constraint (None for a job without one; ``UserError`` if its schema cannot
        be compiled). As in vLLM, the text may end, once complete, with the model's (``eos_ids``) or the tokenizer's
        end-of-sequence token or any of the job's stop tokens."""
        if job.constraint is None:
            return None
        stop_ids = {*eos_ids, *job.stop_token_ids}
        if self._tokenizer.eos_token_id is not None:
            stop_ids.add(self._tokenizer.eos_token_id)
        return ConstrainedSequence(self._compiled(schema_of(job.constraint)), stop_ids, self.vocab_size)

    def _compile(self, schema: str) -> xgr.CompiledGrammar:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # the lru_cache above is the cache
        if not self._compact:
            return _convert(schema, self._compiler.compile_json_schema)
        return _convert(schema, functools.partial(self._compiler.compile_json_schema, separators=(",", ":")),
                        any_whitespace=False)
