"""The routes vLLM's OpenAI server has beside ``/v1``, which tools probe: ``/health``, ``/metrics`` (Prometheus
text), ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``. HTTP only; errors in OpenAI's shape. Tokenizing and
decoding run in the completions service's workers, never on the event loop; ``/tokenize`` refuses a text longer than
``--max-prompt-chars`` (by default, longer than the model's context can be) before tokenizing it, where vLLM's
tokenizes any length."""

from __future__ import annotations

from litestar import Request, Response, Router, get, post
from litestar.di import NamedDependency
from litestar.exceptions import NotAuthorizedException
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from compat_server.routes.v1.answers import ERROR_CLASSES, openai_error
from compat_server.services import Services
from shims.openai.text import Vocabulary
from shims.openai.tokenize_wire import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info
from shims.openai.wire import parse_request
from shims.sampling.job import SamplingLimits


@get("/health")
async def health() -> Response:
    """200 with an empty body once the server serves (it listens only after its samplers and trainers are up), as
    vLLM's."""
    return Response(b"", media_type="text/plain")


async def _owner_vocab(services: Services, owner: str, model: str | None) -> tuple[Vocabulary, SamplingLimits]:
    """The model's vocabulary and limits (its context as the model id asked, ``:peft:<n>``)."""
    completions = services.completions
    target = completions.sampling.weights.for_model(owner, completions.model_name(model))
    return await completions.vocabulary(target.base_model), completions.limits_of(target)


@post("/tokenize", status_code=200)
async def tokenize_route(request: Request, owner: NamedDependency[str], services: NamedDependency[Services]) -> dict:
    req = parse_request(TokenizeRequest, await request.json())
    vocab, limits = await _owner_vocab(services, owner, req.model)
    return await services.completions.workers.run(tokenize, vocab, req, limits.max_context)


@post("/detokenize", status_code=200)
async def detokenize_route(request: Request, owner: NamedDependency[str],
                           services: NamedDependency[Services]) -> dict:
    req = parse_request(DetokenizeRequest, await request.json())
    vocab, limits = await _owner_vocab(services, owner, req.model)
    return await services.completions.workers.run(detokenize, vocab, req, limits.vocab_size)


@get("/tokenizer_info")
async def tokenizer_info_route(owner: NamedDependency[str], services: NamedDependency[Services],
                               model: str | None = None) -> dict:
    vocab, limits = await _owner_vocab(services, owner, model)
    return tokenizer_info(vocab, limits.max_context)


def _gauges(prefix: str, labels: dict[str, str], values: dict, out: dict[str, GaugeMetricFamily]) -> None:
    """Every number in a metrics dict (nested keys joined by ``_``) as one gauge per name, labelled."""
    for key, value in values.items():
        name = f"{prefix}_{key}".replace(".", "_").replace("-", "_")
        if isinstance(value, dict):
            _gauges(name, labels, value, out)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            family = out.setdefault(name, GaugeMetricFamily(name, f"compat-server {key}", labels=list(labels)))
            family.add_metric(list(labels.values()), float(value))


@get("/metrics")
async def prometheus_metrics(owner: NamedDependency[str], services: NamedDependency[Services]) -> Response:
    """Server-wide figures (those ``/api/v1/metrics`` shows an operator) in Prometheus' text format. With ``--auth
    keys`` they are an operator's (``keys create --admin``; Prometheus sends it as a bearer token); an open server
    shows them to anyone who can reach it, as vLLM's does."""
    if services.config.auth_mode == "keys" and not services.records.tenants.is_admin(owner):
        raise NotAuthorizedException("/metrics shows server-wide figures: it needs an operator key "
                                     "(compat-server keys create --admin)")
    families: dict[str, GaugeMetricFamily] = {}
    for base, figures in (await services.sampling.metrics(None)).items():
        _gauges("compat_server_sampling", {"base_model": base}, figures, families)
    for base, figures in services.training.metrics().items():
        _gauges("compat_server_training", {"base_model": base}, figures, families)
    _gauges("compat_server_futures", {}, services.hub.latency(None), families)

    class Snapshot:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


SERVING_ROUTER = Router(
    path="/", route_handlers=[health, tokenize_route, detokenize_route, tokenizer_info_route, prometheus_metrics],
    exception_handlers={cls: openai_error for cls in ERROR_CLASSES},
)
