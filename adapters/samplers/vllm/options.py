"""The vLLM sampler's settings and the limits the server checks them against, apart from the sampler itself: the
CLI and the config read them without importing vLLM, the grammar engine or torch (``compat-server keys`` and
``--help`` answer at once)."""

from __future__ import annotations

from dataclasses import dataclass

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts as ``max_lora_rank``; adapters of any rank up to it load."""

CPU_KV_CACHE_GB = 1.0
"""KV cache of a vLLM engine on CPU when none is configured: vLLM's CPU default (a share of the machine's memory)
is far more than a sampler replica needs beside the trainer and Ray."""


@dataclass(frozen=True)
class VLLMOptions:
    """Settings only the vLLM engine has (server options ``--max-lora-rank`` and ``--vllm-*``)."""

    max_lora_rank: int = 64
    max_loras: int = 4
    """Adapters one engine step may mix (vLLM's ``max_loras``, GPU slots); capped by the resident limit."""
    gpu_memory_utilization: float | None = None
    """Fraction of the GPU the engine may take (unset: vLLM's default). Unused on CPU."""
    kv_cache_gb: float | None = None
    """KV cache size of the engine (all its workers together); unset: from ``gpu_memory_utilization`` on a GPU,
    ``CPU_KV_CACHE_GB`` on CPU."""
    tensor_parallel_size: int = 1
    """Workers the engine splits the model over (vLLM's tensor parallelism; ``adapters.samplers.vllm.parallel``)."""
