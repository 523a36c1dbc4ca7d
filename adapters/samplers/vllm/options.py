"""The vLLM sampler's settings and the limits the server checks them against, apart from the sampler itself: the
CLI and the config read them without importing vLLM, the grammar engine or torch (``compat-server keys`` and
``--help`` answer at once)."""

from __future__ import annotations

from dataclasses import dataclass

from shims.option import ABOVE_ZERO, Check, at_least, option

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts as ``max_lora_rank``; adapters of any rank up to it load."""

CPU_KV_CACHE_GB = 1.0
"""KV cache of a vLLM engine on CPU when none is configured: vLLM's CPU default (a share of the machine's memory)
is far more than a sampler replica needs beside the trainer and Ray."""


@dataclass(frozen=True)
class VLLMOptions:
    """Settings only the vLLM engine has (server options ``--max-lora-rank`` and ``--vllm-*``); part of
    ``adapters.samplers.options.SamplerOptions``. ``gpu_memory_utilization`` unset is decided at start from the
    samplers' GPU share (``compat_server.services``)."""

    max_lora_rank: int = option(
        128, choices=VLLM_LORA_RANKS,
        help="largest LoRA rank a training run may ask for; the vLLM samplers are started for it, so it is one of "
             "the ranks vLLM accepts, and every adapter trained here can be sampled (default: %(default)s)")
    max_loras: int = option(
        4, flag="--vllm-max-loras", check=at_least(1),
        help="adapters one vLLM engine step may mix (vLLM's max_loras; each reserves GPU memory for a rank "
             "--max-lora-rank adapter); at most --max-resident-adapters (default: %(default)s)")
    gpu_memory_utilization: float | None = option(
        None, flag="--vllm-gpu-memory-utilization", check=Check(lambda v: 0 < v <= 1, "must be in (0, 1]"),
        help="fraction of its GPU each vLLM engine may take (default: 0.85 × its GPU share); not used on CPU")
    kv_cache_gb: float | None = option(
        None, flag="--vllm-kv-cache-gb", check=ABOVE_ZERO,
        help=f"KV cache of each vLLM engine in GiB, shared by its tensor-parallel workers (default: on a GPU, what "
             f"--vllm-gpu-memory-utilization leaves; on CPU, {CPU_KV_CACHE_GB:g})")
