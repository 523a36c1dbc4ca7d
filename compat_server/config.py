"""Server options: one dataclass that the CLI fills and every component reads."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from adapters.models.resolve import SAMPLER_DTYPES
from adapters.models.tiny import TINY_MODEL_NAME
from adapters.samplers.vllm.options import VLLM_LORA_RANKS
from shims.custom_loss.limits import CustomLossLimits


def default_data_dir() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("compat-server"))


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    base_models: list[str] = field(default_factory=lambda: [TINY_MODEL_NAME])
    data_dir: Path = field(default_factory=default_data_dir)
    storage_dir: Path | None = None
    """Where checkpoint and sampler-weight files live (default: the data directory). Trainers write there and
    samplers read there, so on a multi-machine Ray cluster it must be one shared filesystem mounted at the same
    path on every node."""
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    ray_object_store_mb: int = 256
    trainer_cpus: float = 1.0
    trainer_gpus: float | None = None
    trainer_threads: int | None = None
    trainer_resources: dict[str, float] = field(default_factory=dict)
    sampler_resources: dict[str, float] = field(default_factory=dict)
    max_batch_tokens: int = 131072
    max_adapters: int = 64
    max_adapters_per_key: int = 64
    max_pending_per_key: int = 1024
    samplers: int = 1
    sampler_backend: str = "auto"
    sampler_cpus: float = 1.0
    sampler_gpus: float | None = None
    sampler_threads: int | None = None
    sampler_batch: int = 32
    max_resident_adapters: int = 8
    sampler_dtype: str = "auto"
    max_model_len: int | None = None
    max_lora_rank: int = 128
    """The largest LoRA rank a training run may have; the vLLM samplers are started for it (so it must be one of
    the ranks vLLM accepts), so every adapter trained here can be sampled."""
    vllm_max_loras: int = 4
    vllm_gpu_memory_utilization: float | None = None
    vllm_kv_cache_gb: float | None = None
    max_num_samples: int = 128
    max_logprobs_k: int = 64
    max_stop_strings: int | None = None
    """OpenAI routes: most ``stop`` strings in one request (None: no limit, as in vLLM)."""
    max_logprobs: int = 20
    """OpenAI routes: most logprobs per position (``logprobs``, ``top_logprobs``, ``prompt_logprobs``); vLLM's 20."""
    max_temperature: float | None = 2.0
    disable_any_whitespace: bool = False
    """Constrained JSON without optional whitespace (vLLM's ``structured_outputs_config.disable_any_whitespace``)."""
    """OpenAI routes: the highest ``temperature`` accepted (vLLM's 2; None: any, which only the transformers sampler
    can run: vLLM itself refuses more than 2)."""
    custom_loss_server_side: bool = True
    """Custom losses made with ``create_custom_loss`` run in the trainer, in one forward_backward (client/config's
    ``custom_loss_server_side``); off, the SDK runs them client-side (a forward, then a backward)."""
    custom_loss_max_nodes: int = CustomLossLimits.max_nodes
    custom_loss_max_nesting: int = CustomLossLimits.max_nesting
    custom_loss_max_constants: int = CustomLossLimits.max_constants
    custom_loss_max_elements: int = CustomLossLimits.max_elements
    max_custom_losses_per_key: int = 256
    drift_probe_every: int = 50
    ephemeral_keep: int = 8
    stability_ttl: float = 86400.0
    min_checkpoint_ttl: float = 3600.0
    expiry_sweep_seconds: float = 60.0
    session_timeout: float = 600.0
    """A session whose client sent no heartbeat (the SDK sends one every 10 s) for this long ends, and its models
    leave the trainer."""
    download_url_ttl: float = 3600.0
    token_ttl: float = 3600.0
    """Lifetime of the short-lived tokens the SDK exchanges its key for (it refreshes them at half-life)."""
    auth: str | None = None
    """``keys`` (registered keys only) or ``open`` (any ``tml-`` key is its own tenant); unset: ``open`` on a
    loopback address, ``keys`` otherwise."""
    allow_open_auth: bool = False
    poll_hold_seconds: float = 30.0
    """The SDK waits up to 45 s for a retrieve_future answer and logs a warning on every try_again, so polls are
    held long, not answered early."""
    seq_gap_timeout: float = 120.0
    max_body_mb: int = 64
    access_log: bool = False
    log_level: str = "INFO"
    log_format: str = "text"
    otlp_endpoint: str | None = None
    """OpenTelemetry collector (OTLP/HTTP) base URL; unset, the standard OTEL_EXPORTER_OTLP_* variables decide."""

    def validate(self) -> None:
        """Refuse option values the server could not run with, naming the option."""
        problems = [message for ok, message in [
            (self.samplers >= 1, "--samplers must be at least 1"),
            (self.max_batch_tokens >= 1, "--max-batch-tokens must be at least 1"),
            (self.max_adapters >= 1, "--max-adapters must be at least 1"),
            (self.max_adapters_per_key >= 1, "--max-adapters-per-key must be at least 1"),
            (self.max_pending_per_key >= 1, "--max-pending-per-key must be at least 1"),
            (self.sampler_batch >= 1, "--sampler-batch must be at least 1"),
            (self.max_resident_adapters >= 1, "--max-resident-adapters must be at least 1"),
            (self.max_num_samples >= 1, "--max-num-samples must be at least 1"),
            (self.max_logprobs_k >= 0, "--max-logprobs-k must be 0 or more"),
            (self.max_logprobs >= 0, "--max-logprobs must be 0 or more"),
            (self.max_stop_strings is None or self.max_stop_strings >= 0, "--max-stop-strings must be 0 or more"),
            (self.max_temperature is None or self.max_temperature >= 0, "--max-temperature must be 0 or more"),
            (min(self.custom_loss_max_nodes, self.custom_loss_max_nesting, self.custom_loss_max_constants,
                 self.custom_loss_max_elements, self.max_custom_losses_per_key) >= 1,
             ("--custom-loss-max-nodes, -nesting, -constants, -elements and --max-custom-losses-per-key must be at "
              "least 1")),
            (self.drift_probe_every >= 0, "--drift-probe-every must be 0 (off) or more"),
            (self.ephemeral_keep >= 1, "--ephemeral-keep must be at least 1"),
            (self.stability_ttl > 0, "--stability-ttl must be > 0"),
            (self.min_checkpoint_ttl > 0, "--min-checkpoint-ttl must be > 0"),
            (self.expiry_sweep_seconds > 0, "--expiry-sweep-seconds must be > 0"),
            (self.session_timeout > 0, "--session-timeout must be > 0"),
            (self.download_url_ttl > 0, "--download-url-ttl must be > 0"),
            (self.token_ttl >= 120, "--token-ttl must be at least 120 seconds (the SDK refreshes a minute early)"),
            (self.max_lora_rank in VLLM_LORA_RANKS,
             f"--max-lora-rank must be one of {', '.join(map(str, VLLM_LORA_RANKS))} (the ranks vLLM accepts)"),
            (self.sampler_dtype in SAMPLER_DTYPES, f"--sampler-dtype must be one of {', '.join(SAMPLER_DTYPES)}"),
            (self.max_model_len is None or self.max_model_len >= 2, "--max-model-len must be at least 2"),
            (self.vllm_max_loras >= 1, "--vllm-max-loras must be at least 1"),
            (self.vllm_kv_cache_gb is None or self.vllm_kv_cache_gb > 0, "--vllm-kv-cache-gb must be > 0"),
            (self.vllm_gpu_memory_utilization is None or 0 < self.vllm_gpu_memory_utilization <= 1,
             "--vllm-gpu-memory-utilization must be in (0, 1]"),
            (self.trainer_cpus >= 0 and self.sampler_cpus >= 0, "--trainer-cpus and --sampler-cpus must be ≥ 0"),
            (self.poll_hold_seconds >= 0, "--poll-hold-seconds must be ≥ 0"),
            (self.seq_gap_timeout > 0, "--seq-gap-timeout must be > 0"),
            (self.max_body_mb >= 1, "--max-body-mb must be at least 1"),
            (self.auth in (None, "keys", "open"), "--auth must be keys or open"),
            (self.auth != "open" or self.loopback or self.allow_open_auth,
             (f"--auth open on {self.host} would let anyone with network access in with any tml- key; use --auth "
             "keys (and compat-server keys create), or add --allow-open-auth if that is really intended")),
        ] if not ok]
        if problems:
            raise ValueError("; ".join(problems))

    RECORDS_FILE = "records.sqlite3"

    @property
    def records_path(self) -> Path:
        return self.data_dir / self.RECORDS_FILE

    @property
    def custom_loss_limits(self) -> CustomLossLimits:
        return CustomLossLimits(max_nodes=self.custom_loss_max_nodes, max_nesting=self.custom_loss_max_nesting,
                                max_constants=self.custom_loss_max_constants,
                                max_elements=self.custom_loss_max_elements)

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

    @property
    def auth_mode(self) -> str:
        return self.auth or ("open" if self.loopback else "keys")

    @property
    def url_key_path(self) -> Path:
        """The secret that signs download URLs (created at first start)."""
        return self.data_dir / "url_signing.key"

    @property
    def checkpoint_dir(self) -> Path:
        return (self.storage_dir or self.data_dir) / "checkpoints"

    @property
    def ephemeral_dir(self) -> Path:
        """Unnamed sampler saves (save_weights_and_get_sampling_client); emptied at every start."""
        return (self.storage_dir or self.data_dir) / "ephemeral"
