"""A sampling request as every sampler backend receives it (:class:`SampleJob`), and what a backend gives back.

Plain values only: the Tinker route (``shims.tinker.sampling_wire``) and the OpenAI routes (``shims.openai.params``)
build jobs, and the backends (``adapters``) run them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class OutputConstraint:
    """What a constrained sequence must be: JSON matching ``json_schema`` (JSON Schema text), or, when it is None,
    any JSON object (OpenAI's ``json_object`` mode; vLLM's ``json_object``). Backends compile it with xgrammar, the
    grammar engine vLLM itself uses, so both backends accept exactly the same texts."""

    json_schema: str | None = None


@dataclass(frozen=True)
class SamplingLimits:
    """What one base model accepts. ``max_num_samples`` and ``max_logprobs_k`` are server options."""

    vocab_size: int
    max_context: int
    max_num_samples: int
    max_logprobs_k: int


@dataclass(frozen=True)
class TargetIds:
    """``target_prompt_logprobs`` as a dense ``[len(prompt) - 1, K]`` int64 array (``-1`` = nothing asked), plus the
    CSR index of a sparse request so the answer goes back in the same layout."""

    ids: np.ndarray
    crow: np.ndarray | None = None
    col: np.ndarray | None = None


GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily, on every backend."""


@dataclass(frozen=True)
class SampleJob:
    """One sampling request, validated, in plain values: what every sampler backend receives."""

    prompt: tuple[int, ...]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    """Below ``GREEDY_TEMPERATURE`` sampling is greedy (see ``greedy``)."""
    top_k: int = 0
    """0 = no top-k filtering (the wire's -1 is normalised to 0)."""
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_at_eos: bool = True
    """The SDK's rule: the model's end-of-sequence token stops sampling, alongside any ``stop`` given, except that
    ``stop=[]`` disables every stop, EOS included, so sampling runs to ``max_tokens``."""
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    target: TargetIds | None = None
    prompt_alt_tokens_k: int = 0
    record_stability_info: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    """OpenAI's penalties (the Tinker wire has none): subtracted from the logits of tokens already sampled in this
    sequence, ``presence`` once and ``frequency`` per occurrence."""
    repetition_penalty: float = 1.0
    """vLLM's extension: logits of tokens in the prompt or already sampled are divided by it where positive and
    multiplied by it where negative (1 = off)."""
    min_p: float = 0.0
    """vLLM's extension: after temperature, tokens whose probability is below ``min_p`` × the top token's are dropped."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's ``logit_bias``: (token id, bias) pairs added to the logits before anything else."""
    constraint: OutputConstraint | None = None
    """Constrained decoding: every sampled sequence is a prefix of (and, unless cut by ``max_tokens``, is) a text the
    constraint accepts."""

    @property
    def needs_prompt_scores(self) -> bool:
        return (self.prompt_logprobs or self.topk_prompt_logprobs > 0 or self.target is not None
                or self.prompt_alt_tokens_k > 0)

    @property
    def first_scored(self) -> int:
        """The first prompt position whose prompt logprobs are reported (position 0 never has any)."""
        if self.prompt_logprobs_last_n is None:
            return 1
        return len(self.prompt) - self.prompt_logprobs_last_n

    @property
    def greedy(self) -> bool:
        """Whether this job takes the argmax. Dividing logits by a temperature this small overflows float32, and the
        distribution it would give is the argmax anyway. vLLM's greedy threshold is the same (``_SAMPLING_EPS``), but
        it first raises any temperature in (0, 0.01) to 0.01, so its backend passes it 0 for a greedy job."""
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class TokenEvent:
    """One token as it is sampled, for streaming: sequence ``index`` of its request, with its logprob and (when the
    job asks for them) its top-k alternatives."""

    index: int
    token: int
    logprob: float
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


@dataclass
class SequenceResult:
    """One generated sequence. ``logprobs`` are the model's own (temperature 1, unfiltered) logprobs of the sampled
    tokens — the numbers a trainer's ``forward`` gives for the same tokens, which RL losses compare against."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


@dataclass
class PromptScores:
    logprobs: np.ndarray | None = None
    """float32 ``[len(prompt)]``, NaN where not scored."""
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    target_logprobs: np.ndarray | None = None
    """float32 ``[len(prompt) - 1, K]``, 0 where the request had -1."""
    alt_tokens: np.ndarray | None = None
    alt_logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None
    """int ``[len(prompt)]``: each prompt token's rank in the distribution that predicted it (1 = the most likely),
    where the backend reports it (for vLLM's ``prompt_logprobs``); position 0 is meaningless."""


@dataclass
class SampleResult:
    sequences: list[SequenceResult]
    prompt: PromptScores = field(default_factory=PromptScores)
    prompt_cache_hit_tokens: int = 0
