"""OpenTelemetry: a trace per request (the HTTP span from Litestar's plugin, then child spans for the time a job waits
in its queue, the trainer or sampler call, and records I/O) and metrics (futures finished and their duration, queue
depth, tokens trained and sampled, resident adapters, futures by state).

Modules take the tracer and instruments below at import time. They are OpenTelemetry's proxies: until a provider is
installed (``setup``), every span and measurement is a no-op costing a function call, so a server without an OTLP
endpoint pays next to nothing. ``setup`` installs the SDK with OTLP/HTTP exporters when ``--otlp-endpoint`` or the
standard ``OTEL_EXPORTER_OTLP_*ENDPOINT`` variables are set; tests install providers with in-memory exporters instead.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation

log = logging.getLogger("compat_server.telemetry")

tracer = trace.get_tracer("compat_server")
meter = metrics.get_meter("compat_server")

FUTURES_FINISHED = meter.create_counter(
    "compat_server.futures.finished", unit="{future}",
    description="Tinker futures finished, by kind and state (complete, or failed with its category)")
FUTURE_DURATION = meter.create_histogram(
    "compat_server.future.duration", unit="s", description="a Tinker future from submit to result, by kind")
TOKENS_TRAINED = meter.create_counter(
    "compat_server.tokens.trained", unit="{token}", description="tokens through forward / forward_backward")
TOKENS_SAMPLED = meter.create_counter(
    "compat_server.tokens.sampled", unit="{token}", description="tokens sampled, Tinker and OpenAI routes together")
RESIDENT_ADAPTERS = meter.create_up_down_counter(
    "compat_server.adapters.resident", unit="{adapter}", description="training runs loaded in the trainers")
"""Its sampler-side twin, ``compat_server.sampler.adapters.resident``, is an observable gauge (see ``observe``)."""

OTLP_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")


def enabled_by(endpoint: str | None) -> bool:
    return bool(endpoint) or any(os.environ.get(name) for name in OTLP_ENV)


def active() -> bool:
    """Whether a real tracer provider is installed (by ``setup``, or by a test with in-memory exporters)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def setup(endpoint: str | None) -> bool:
    """Install the OpenTelemetry SDK with OTLP/HTTP exporters if an endpoint is configured; False when telemetry
    stays off. ``endpoint`` is the collector's base URL (``http://collector:4318``); the standard ``OTEL_*``
    variables (service name, headers, per-signal endpoints) apply as usual."""
    if active():
        return True
    if not enabled_by(endpoint):
        return False
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "compat-server")})
    base = endpoint.rstrip("/") if endpoint else None
    spans = OTLPSpanExporter(endpoint=f"{base}/v1/traces") if base else OTLPSpanExporter()
    measures = OTLPMetricExporter(endpoint=f"{base}/v1/metrics") if base else OTLPMetricExporter()
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(spans))
    trace.set_tracer_provider(tracer_provider)
    # Export intervals follow the standard OTEL_BSP_SCHEDULE_DELAY and OTEL_METRIC_EXPORT_INTERVAL (5 s and 60 s).
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[
        PeriodicExportingMetricReader(measures)]))
    log.info("OpenTelemetry on: traces and metrics go to %s", endpoint or "the OTEL_EXPORTER_OTLP_* endpoint")
    return True


def litestar_plugin():
    """HTTP server spans and metrics (``http.server.*``) for every request, from the global providers."""
    from litestar.plugins.opentelemetry import OpenTelemetryConfig, OpenTelemetryPlugin

    return OpenTelemetryPlugin(OpenTelemetryConfig(exclude=["/api/v1/healthz"]))


def observe(pending_by_state: Callable[[], dict[str, int]], queue_depth: Callable[[], int],
            sampler_residents: Callable[[], dict[str, int]]) -> None:
    """Gauges read when metrics are collected (in the reader's thread): futures by state and jobs waiting in queues
    (in memory, cheap), and adapters resident in the samplers per base model (asked of the sampler actors)."""

    def futures(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(count, {"state": state}) for state, count in pending_by_state().items()]

    def queued(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(queue_depth())]

    def residents(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(count, {"base_model": base}) for base, count in sampler_residents().items()]

    meter.create_observable_gauge("compat_server.sampler.adapters.resident", callbacks=[residents], unit="{adapter}",
                                  description="LoRA adapters loaded in the samplers, by base model")
    meter.create_observable_gauge("compat_server.futures", callbacks=[futures], unit="{future}",
                                  description="futures not yet finished, by state (queued or running)")
    meter.create_observable_gauge("compat_server.queue.depth", callbacks=[queued], unit="{job}",
                                  description="jobs waiting for their turn or for a trainer / sampler")


def traced(name: str) -> Callable:
    """Decorator: run the function in a child span ``name`` (records I/O and other synchronous steps)."""

    def wrap(function: Callable) -> Callable:
        @functools.wraps(function)
        def run(*args, **kwargs):
            with tracer.start_as_current_span(name):
                return function(*args, **kwargs)

        return run

    return wrap


def ids(model_id: str | None = None, request_id: str | None = None, seq_id: int | None = None,
        kind: str | None = None) -> dict[str, str | int]:
    """Span attributes naming what a span works on; the session id is the first part of a model id."""
    attributes: dict[str, str | int] = {}
    if model_id:
        attributes["compat_server.model_id"] = model_id
        attributes["compat_server.session_id"] = model_id.split(":", 1)[0]
    if request_id:
        attributes["compat_server.request_id"] = request_id
    if seq_id is not None:
        attributes["compat_server.seq_id"] = seq_id
    if kind:
        attributes["compat_server.kind"] = kind
    return attributes


def trainer_span(operation: str, model_id: str | None) -> AbstractContextManager[Any]:
    """The span of one trainer operation (``trainer.save_state``) on the run ``model_id`` (None: no run's), around
    each call the services make to a trainer (``adapters.trainer.pool.TrainerPool``'s ``traced``)."""
    return tracer.start_as_current_span(f"trainer.{operation}", attributes=ids(model_id))
