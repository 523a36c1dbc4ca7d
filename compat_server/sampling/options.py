"""The sampling service's options: what one sample request may ask for, how often the drift probe runs, and what is
kept of unnamed sampler saves and stability info. Declared here once, each with its default, help and check
(``shims.option``), apart from the service, so that the CLI reads them without importing the tinker SDK;
``compat_server.config.ServerConfig`` holds them as ``sampling``."""

from __future__ import annotations

from dataclasses import dataclass

from shims.option import ABOVE_ZERO, Check, at_least, option


@dataclass(frozen=True)
class SamplingOptions:
    max_num_samples: int = option(
        128, "largest num_samples one sample request may ask for (default: %(default)s)", check=at_least(1))
    max_logprobs_k: int = option(
        64, "largest top-k of prompt / sample logprobs and prompt_alt_tokens_k (default: %(default)s)",
        check=at_least(0))
    drift_probe_every: int = option(
        50, check=Check(lambda every: every >= 0, "must be 0 (off) or more"),
        help="re-score one sampled sequence with the trainer every N sample requests per base model and report the "
             "logprob gap in /api/v1/metrics; 0 turns it off (default: %(default)s)")
    ephemeral_keep: int = option(
        8, check=at_least(1),
        help="unnamed sampler saves (save_weights_and_get_sampling_client) kept per training model (default: "
             "%(default)s)")
    ephemeral_memory_mb: int = option(
        512, check=at_least(0),
        help="MiB of unnamed sampler saves held in memory for the samplers (Ray's object store: "
             "--ray-object-store-mb), the oldest pushed out first; a save larger than this is written under the data "
             "directory instead; 0: always written (default: %(default)s)")
    stability_ttl: float = option(
        86400.0, check=ABOVE_ZERO,
        help="seconds that stability info recorded at sampling (record_stability_info, for the stable_reinforce "
             "loss) stays usable after its last use (default: %(default)s, a day)")
