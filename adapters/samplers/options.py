"""How the sampler replicas are placed and what each holds: the pool reads it in the server process, and each
replica's actor gets it, so nothing here imports a backend."""

from __future__ import annotations

from dataclasses import dataclass, field

from adapters.samplers.vllm.options import VLLMOptions


@dataclass(frozen=True)
class SamplerPlacement:
    """How many sampler replicas each base model gets, which backend, the Ray resources each asks for, and the
    settings of the model it holds."""

    count: int = 1
    backend: str = "transformers"
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int | None = None
    max_batch_sequences: int = 32
    max_resident: int = 8
    dtype: str = "auto"
    max_model_len: int | None = None
    disable_any_whitespace: bool = False
    """Constrained JSON without optional whitespace (``--disable-any-whitespace``)."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    resources: dict[str, float] | None = None
