"""OpenTelemetry: the server runs in this process (uvicorn in a thread, real Ray actors) with the OpenTelemetry SDK's
in-memory exporters installed, and is driven by the real tinker and openai SDKs. The recorded spans must form one
trace per request (HTTP span → queue wait → the job → trainer / sampler call and records I/O) carrying the session,
model and request ids; the recorded metrics must count what was done."""

from __future__ import annotations

import threading
import time

import numpy as np
import openai
import pytest
import tinker
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tinker import types

from tests.helpers import BASE_MODEL, make_datum, train
from tests.server import free_port


@pytest.fixture(scope="module")
def otel_server(model_cache, tmp_path_factory):
    import ray
    import uvicorn

    from compat_server.app import create_app
    from compat_server.cli.main import build_parser, config_from_args

    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    port = free_port()
    config = config_from_args(build_parser().parse_args([
        "serve", "--port", str(port), "--data-dir", str(tmp_path_factory.mktemp("otel-data")),
        "--poll-hold-seconds", "2"]))
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, lifespan="on",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}", spans, reader
    server.should_exit = True
    thread.join(30)
    if ray.is_initialized():
        ray.shutdown()


def _metric_points(reader) -> dict[str, list]:
    points: dict[str, list] = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)
    return points


def test_each_request_is_one_trace_with_queue_work_and_records_spans(otel_server):
    url, spans, reader = otel_server
    service = tinker.ServiceClient(base_url=url, api_key="tml-test-otel")
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=1).result()
    datum = make_datum([3, 4, 5], [6, 7])
    train(client, datum, 2)
    client.save_state("traced").result()
    sampler = client.save_weights_and_get_sampling_client().result()  # its adapter becomes resident
    sampler.sample(types.ModelInput.from_ints([3, 4]), 2, types.SamplingParams(max_tokens=5, stop=[])).result()
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="tml-test-otel")
    reply = chat.chat.completions.create(model=BASE_MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    resident_while_open = sum(p.value for p in _metric_points(reader)["compat_server.adapters.resident"])
    service.close("success").result()  # closing the session unloads its training run from the trainer

    deadline = time.monotonic() + 10  # an HTTP span ends just after its answer is sent: the client may be faster
    while not any(s.name.startswith("POST /v1/chat/completions") and s.parent is None
                  for s in spans.get_finished_spans()):
        assert time.monotonic() < deadline, "the chat request's HTTP span never ended"
        time.sleep(0.05)
    finished = spans.get_finished_spans()
    by_id = {span.context.span_id: span for span in finished}

    def ancestors(span) -> list[str]:
        names = []
        while span.parent is not None and span.parent.span_id in by_id:
            span = by_id[span.parent.span_id]
            names.append(span.name)
        return names

    jobs = [s for s in finished if s.name == "forward_backward"]
    assert len(jobs) == 2
    for job in jobs:
        (http,) = [by_id[job.parent.span_id]]
        assert http.name.startswith("POST /api/v1/forward_backward"), http.name
        attributes = job.attributes
        assert attributes["compat_server.model_id"] == client.model_id
        assert attributes["compat_server.session_id"] == client.model_id.split(":")[0]
        assert attributes["compat_server.request_id"].startswith("req-") and attributes["compat_server.seq_id"] >= 1
        trace_spans = [s.name for s in finished if s.context.trace_id == job.context.trace_id]
        assert {"queue", "trainer.forward_backward", "records.add_step", "records.finish_future"} <= set(trace_spans)
        queue = next(s for s in finished if s.name == "queue" and s.context.trace_id == job.context.trace_id)
        assert queue.end_time <= job.start_time + 1_000_000  # the wait ends as the work starts
    trainer_call = next(s for s in finished if s.name == "trainer.forward_backward")
    assert ancestors(trainer_call)[0] == "forward_backward"
    assert any(s.name == "trainer.save_state" and "save_weights" in ancestors(s) for s in finished)
    assert any(s.name == "sampler.sample" and ancestors(s)[0] == "sample" for s in finished)
    openai_sample = [s for s in finished if s.name == "sampler.sample" and "POST /v1/chat/completions" in " ".join(
        ancestors(s))]
    assert openai_sample and reply.choices[0].message.content is not None

    points = _metric_points(reader)
    finished_futures = {(p.attributes["kind"], p.attributes["state"]): p.value
                        for p in points["compat_server.futures.finished"]}
    assert finished_futures[("forward_backward", "complete")] == 2
    assert finished_futures[("optim_step", "complete")] == 2 and finished_futures[("sample", "complete")] == 1
    durations = {p.attributes["kind"]: p for p in points["compat_server.future.duration"]}
    assert durations["forward_backward"].count == 2 and durations["forward_backward"].sum > 0
    trained = sum(p.value for p in points["compat_server.tokens.trained"])
    assert trained == 2 * len(datum.model_input.to_ints())
    assert sum(p.value for p in points["compat_server.tokens.sampled"]) == 2 * 5 + reply.usage.completion_tokens
    assert resident_while_open == 1
    assert sum(p.value for p in points["compat_server.adapters.resident"]) == 0
    assert [(p.attributes["base_model"], p.value) for p in points["compat_server.sampler.adapters.resident"]] == [
        (BASE_MODEL, 1)]
    assert {p.attributes["state"] for p in points["compat_server.futures"]} == {"pending"}
    assert "compat_server.queue.depth" in points
    http = [name for name in points if name.startswith("http.server")]
    assert http, sorted(points)  # request counts and latencies from the HTTP instrumentation
    assert np.isfinite([p.sum for p in points["compat_server.future.duration"]]).all()


@pytest.fixture(scope="module")
def observed_run(model_cache, tmp_path_factory) -> dict:
    """One real server process, observed as an operator would: ``--log-format json`` set through its environment
    variable, and ``--otlp-endpoint`` pointing at a small OTLP/HTTP receiver standing in for a collector. A client
    trains a step, saves a state, samples from its weights; what the collector received while the server ran, and
    the whole log once it stopped, are what the tests below read."""
    import gzip
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.server import start_server

    received: dict[str, list[bytes]] = {"/v1/traces": [], "/v1/metrics": []}

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            received.setdefault(self.path, []).append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    collector = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    # The standard OTEL_* intervals, shortened: spans are batched for 0.5 s, metrics exported every second.
    server = start_server(tmp_path_factory.mktemp("observed-data"), "--otlp-endpoint",
                          f"http://127.0.0.1:{collector.server_port}",
                          env={"COMPAT_SERVER_LOG_FORMAT": "json", "OTEL_BSP_SCHEDULE_DELAY": "500",
                               "OTEL_METRIC_EXPORT_INTERVAL": "1000"})
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test-observed")
        client = service.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
        train(client, make_datum([3, 4], [5, 6]), 1)
        path = client.save_state("logged").result().path
        sampler = client.save_weights_and_get_sampling_client().result()
        sampler.sample(types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=2)).result()
        service.close("success").result()
        # Exported while the server runs, not only when it exits; and the sampler actor's log line, which Ray
        # forwards a moment later, reaches the log before the server stops.
        deadline = time.monotonic() + 60
        while True:
            exported = _exported(received)
            if (OTLP_SPANS <= exported["spans"] and OTLP_METRICS <= exported["metrics"]
                    and '"adapter_loaded"' in server.log() or time.monotonic() > deadline):
                break
            time.sleep(0.5)
    finally:
        server.stop()
        collector.shutdown()
    return {"server": server, "model_id": client.model_id, "path": path, "exported": exported}


OTLP_SPANS = {"forward_backward", "queue", "trainer.forward_backward", "records.add_step"}
OTLP_METRICS = {"compat_server.tokens.trained", "compat_server.futures.finished", "compat_server.queue.depth"}


def _exported(received: dict[str, list[bytes]]) -> dict[str, set[str]]:
    """Span names, service names and metric names in what the collector received so far."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans, resources = set(), set()
    for body in list(received["/v1/traces"]):
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            resources.update(a.value.string_value for a in resource_spans.resource.attributes
                             if a.key == "service.name")
            spans.update(s.name for scope in resource_spans.scope_spans for s in scope.spans)
    names = {metric.name for body in list(received["/v1/metrics"])
             for resource_metrics in ExportMetricsServiceRequest.FromString(body).resource_metrics
             for scope in resource_metrics.scope_metrics for metric in scope.metrics}
    return {"spans": spans, "resources": resources, "metrics": names}


def test_json_logs_carry_each_lifecycle_event_with_its_facts(observed_run):
    """Every line the server printed is a JSON object (its own, uvicorn's, Ray's, and its actors' as Ray forwards
    them), and the lifecycle events (ready, model created, step done with loss and tokens/s, checkpoint saved, adapter
    loaded in a sampler actor) have their own fields."""
    import json

    server, model_id = observed_run["server"], observed_run["model_id"]
    entries = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    events = {}
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= set(entry)
        events.setdefault(entry.get("event"), entry)
    assert events["ready"]["url"] == server.base_url
    assert events["model_created"]["model_id"] == model_id and events["model_created"]["lora_rank"] == 2
    step = events["forward_backward_done"]
    assert step["model_id"] == model_id and np.isfinite(step["metrics"]["loss:sum"])
    assert step["tokens"] == 3 and step["tokens_per_s"] > 0
    assert events["optim_step_done"]["step"] == 1
    assert events["checkpoint_saved"]["path"] == observed_run["path"] and events["checkpoint_saved"]["bytes"] > 0
    loaded = events["adapter_loaded"]  # logged in the sampler actor, forwarded by Ray
    assert loaded["pid"] != events["ready"]["pid"] and loaded["adapter"].startswith(model_id)


def test_with_an_otlp_endpoint_the_server_exports_traces_and_metrics_over_http(observed_run):
    """The spans and metrics reached the collector over OTLP/HTTP while the server ran, under its service name."""
    exported = observed_run["exported"]
    assert exported["resources"] == {"compat-server"}
    assert OTLP_SPANS <= exported["spans"]
    assert any(name.startswith("POST /api/v1/forward_backward") for name in exported["spans"])
    assert OTLP_METRICS <= exported["metrics"]
