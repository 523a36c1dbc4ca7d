"""Server options: one dataclass that the CLI fills. Each option is declared once, with its default, its ``--help``
text and its check (``shims.option.option``): the server's own here, each component's in its own dataclass, which
``ServerConfig`` nests (``trainer``, ``sampler``, ...) and hands to that component whole, as vLLM's ``EngineArgs``
makes its engine's configs. ``compat_server.cli.options`` makes the flags and their environment variables from the
fields, in this order (a component's options as one group of flags)."""

# ruff: noqa: RUF009 -- option() is dataclasses.field() with the option's metadata; a list or dict default is copied.

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from adapters.models.tiny import TINY_MODEL_NAME
from adapters.samplers.options import SamplerOptions
from adapters.samplers.vllm.parallel import gpus_per_replica_problem
from adapters.trainer.options import TrainerOptions
from compat_server.runs.options import UploadOptions
from compat_server.sampling.options import SamplingOptions
from compat_server.sessions.limits import SessionLimits
from shims.custom_loss.limits import CustomLossLimits
from shims.openai.limits import OpenAILimits
from shims.option import ABOVE_ZERO, OPTION, at_least, nested, option, option_fields, option_flag, option_value


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

    # The Ray cluster.
    ray_address: str | None = option(None, "join an existing Ray cluster at this address (e.g. 10.0.0.5:6379); "
                                           "default: start a private local Ray instance")
    # Trainers write checkpoints and sampler weights there and samplers read them there.
    storage_dir: Path | None = option(
        None, "where checkpoint and sampler-weight files live (default: the data directory); on a multi-machine Ray "
              "cluster, a shared filesystem mounted at the same path on every node")
    ray_num_cpus: int | None = option(None, "CPUs the local Ray instance may use (default: all of this machine's)")
    ray_object_store_mb: int = option(
        1024, "object store size of the local Ray instance in MiB: unnamed sampler saves travel and are held there "
              "(--ephemeral-memory-mb) (default: %(default)s)")
    ray_preallocate_object_store: bool = option(
        True, flag="--no-ray-preallocate-object-store",
        help="leave the local Ray instance's object store to be faulted in as it fills, instead of touching all of "
             "it at start: the store's memory is then not resident until used, but every hand-off of new weights to "
             "the samplers pays for fresh pages (80 MiB: 75 ms instead of 30 here)")

    # The trainers and the samplers: where they run, what each holds.
    trainer: TrainerOptions = nested(TrainerOptions, "trainers")
    sampler: SamplerOptions = nested(SamplerOptions, "samplers")

    # What one key may hold.
    max_adapters_per_key: int = option(
        16, check=at_least(1),
        help="most training runs one API key may have loaded at once, over all base models; unload one (or let its "
             "session end) to create another. Below --max-adapters (64) by default, so that one key cannot take "
             "every training slot and another tenant can always create a run (default: %(default)s)")
    max_custom_losses_per_key: int = option(
        256, "most custom losses one API key may hold; a session's go when it ends (default: %(default)s)",
        check=at_least(1))
    max_pending_per_key: int = option(
        1024, check=at_least(1),
        help="most unfinished requests one API key may have: queued or running Tinker requests and OpenAI "
             "completions together; beyond it requests get 429 with Retry-After, which the tinker and openai SDKs "
             "retry (default: %(default)s)")

    # What one sampling request may ask for, through the Tinker routes and the OpenAI-style ones.
    sampling: SamplingOptions = nested(SamplingOptions, "sampling")
    openai: OpenAILimits = nested(OpenAILimits, "OpenAI-style routes")

    # Tokenizing for the OpenAI-style routes and /tokenize (issue 31: nothing heavy on the event loop).
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
    custom_loss: CustomLossLimits = nested(CustomLossLimits, "custom losses")

    # What is kept, and for how long.
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
    uploads: UploadOptions = nested(UploadOptions, "adapter uploads")
    token_ttl: float = option(
        3600.0, check=at_least(120, "seconds (the SDK refreshes a minute early)"),
        help="seconds a token issued by /api/v1/auth/token stays valid: the tinker SDK exchanges its key for one "
             "and sends it instead (refreshing it at half-life), so RestClient.whoami works; the key is re-checked "
             "at every request (default: %(default)s)")

    # Session fields (account side, issue 31): every search and listing answers them, so they are bounded at creation.
    sessions: SessionLimits = nested(SessionLimits, "session fields")

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
        problems = [f"{option_flag(f)} {must}" for path, f in option_fields(ServerConfig)
                    if (must := f.metadata[OPTION].refuses(option_value(self, path)))]
        if tensor_parallel := gpus_per_replica_problem(self.sampler.tensor_parallel_size, self.sampler.gpus):
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
    def uploads_dir(self) -> Path:
        """Files of adapter uploads not yet finished: beside the checkpoints, which they are linked into."""
        return (self.storage_dir or self.data_dir) / "uploads"

    @property
    def ephemeral_dir(self) -> Path:
        """Unnamed sampler saves (save_weights_and_get_sampling_client); emptied at every start."""
        return (self.storage_dir or self.data_dir) / "ephemeral"
