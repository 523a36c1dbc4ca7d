"""Property-based fuzz run against a real server: every route of the app's own OpenAPI document through schemathesis
(valid and deliberately invalid requests), and hypothesis-generated ``ForwardBackwardRequest`` protobuf bodies built
from the SDK's own descriptor.

What must hold for every request: never a 5xx, always the calling SDK's error shape, a future that ends (never a
``server`` error), the server still serving afterwards, and nothing already stored changed. The run is bounded by
example counts (about a minute and a half on 2 cores).

The inputs are the same on every run (hypothesis's ``derandomize``), so CI passes or fails on the code, not on a
draw. ``COMPAT_SERVER_FUZZ=random`` explores new inputs each run instead; do that when changing a route, and turn what
it finds into a fix and a unit test.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import numpy as np
import psutil
import pytest
import schemathesis
import tinker
import zstandard
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from shims.losses import LOSSES
from shims.openai.wire import ChatRequest, CompletionRequest
from tests.helpers import BASE_MODEL, forward_logprobs, make_datum, poll_future, train, tree_digest
from tests.server import start_server

pytestmark = pytest.mark.soak

KEY = "tml-test-fuzz"
HEADERS = {"X-API-Key": KEY}
SETTINGS = settings(deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                    print_blob=True, derandomize=os.environ.get("COMPAT_SERVER_FUZZ") != "random")


@pytest.fixture(scope="module")
def fuzz_server(model_cache, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("fuzz-data"), "--max-num-samples", "4", "--max-body-mb", "1",
                          "--max-logprobs-k", "4")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stored(fuzz_server):
    """A trained run with a saved checkpoint, owned by the fuzzing key: the fuzz run must not change any of it."""
    service = tinker.ServiceClient(base_url=fuzz_server.base_url, api_key=KEY)
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    datum = make_datum([11, 42, 77], [250, 3])
    train(client, datum, 2)
    client.save_state("before-fuzz").result()
    client.save_weights_for_sampler("before-fuzz").result()
    yield client, datum
    service.close("success")


def _snapshot(server, stored) -> dict:
    """What is stored: checkpoint files (hashed), listings, and the run's current weights (as logprobs)."""
    client, datum = stored
    files = tree_digest(server.data_dir / "checkpoints")
    listing = httpx.get(f"{server.base_url}/api/v1/checkpoints", headers=HEADERS).json()
    runs = httpx.get(f"{server.base_url}/api/v1/training_runs", headers=HEADERS).json()["training_runs"]
    for run in runs:
        run.pop("last_request_time")  # reading the run for the snapshot is a request
    return {"files": files, "checkpoints": listing["checkpoints"], "runs": runs,
            "logprobs": forward_logprobs(client, datum)}


def _assert_unchanged_and_serving(server, stored, before: dict) -> None:
    after = _snapshot(server, stored)
    assert after["files"] == before["files"]
    assert after["checkpoints"] == before["checkpoints"]
    assert after["runs"][:len(before["runs"])] == before["runs"]  # (the protobuf run adds one model of its own)
    np.testing.assert_array_equal(after["logprobs"], before["logprobs"])
    assert server.alive()
    client, datum = stored
    train(client, datum, 1)  # and the stored run still trains


def _check_error_shape(path: str, response: httpx.Response | object) -> None:
    """A 4xx carries the shape its SDK parses: OpenAI's ``{"error": {...}}`` on /v1 and vLLM's routes beside it,
    Anthropic's on /v1/messages, and the same under hosted Tinker's paths (/oai/api/v1, /anthropic/api), Tinker's flat
    one elsewhere."""
    status = response.status_code
    assert status < 500, f"{path} answered {status}: {response.text[:500]}"
    if status < 400:
        return
    body = response.json()
    if path.startswith(("/v1/messages", "/anthropic/api/")):  # the Anthropic routes answer in Anthropic's shape
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"} and body["error"]["message"], body
    elif path.startswith(("/v1/", "/oai/api/v1/")) or path in ("/tokenize", "/detokenize", "/tokenizer_info", "/metrics"):
        assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["message"], body
    else:
        assert body["category"] == "user" and body["error"], body


def _openapi_for_fuzzing(url: str) -> dict:
    """The server's own OpenAPI document, plus what it cannot state itself. The OpenAI routes read their bodies
    themselves, so their request schemas are added from the pydantic models that parse them. Model names are pinned
    to the served model and sizes kept small, so that valid requests really reach the trainer and sampler and each
    stays short; invalid requests (negative mode) still go anywhere."""
    raw = httpx.get(f"{url}/schema/openapi.json").json()
    schemas = raw["components"]["schemas"]
    for route, model in (("/v1/chat/completions", ChatRequest), ("/v1/completions", CompletionRequest)):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        raw["paths"][route]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        for name in ("max_tokens", "max_completion_tokens"):
            if name in schema["properties"]:
                schema["properties"][name] = {"type": "integer", "minimum": 1, "maximum": 8}
        schema["properties"]["model"] = {"enum": [BASE_MODEL]}
        schema["properties"]["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
    schemas["SampleRequest"]["properties"]["base_model"] = {"enum": [BASE_MODEL]}
    schemas["SampleRequest"]["properties"]["num_samples"] = {"type": "integer", "minimum": 1, "maximum": 2}
    schemas["SamplingParams"]["properties"]["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 8}
    schemas["EncodedTextChunk"]["properties"]["tokens"] = {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000}, "minItems": 1, "maxItems": 8}
    return raw


@pytest.mark.timeout(900)
def test_schemathesis_over_every_route_gets_no_server_error_and_changes_nothing(fuzz_server, stored):
    url = fuzz_server.base_url
    before = _snapshot(fuzz_server, stored)
    schema = schemathesis.openapi.from_dict(_openapi_for_fuzzing(url))
    seen: dict[int, int] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 35  # every route the app serves is in its document
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(SETTINGS, max_examples=20)  # × 2 modes × ~55 operations
            def call(case) -> None:
                response = case.call(base_url=url, headers=HEADERS, timeout=120)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                _check_error_shape(case.operation.path, response)

            try:
                call()
            except Unsatisfiable:
                pass  # no invalid value exists for this operation's parameters (e.g. one free-text path segment)
    print(f"schemathesis: {sum(seen.values())} requests, by status {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) > 100 and sum(n for s, n in seen.items() if 400 <= s < 500) > 500
    _assert_unchanged_and_serving(fuzz_server, stored, before)


# ---- protobuf bodies ---------------------------------------------------------------------------------------------
_INTS = {
    FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-2**31, 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-2**63, 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalars(field: FieldDescriptor, words: list[str]) -> st.SearchStrategy:
    """Values for one scalar field: mostly small and plausible (so requests get deep), sometimes extreme."""
    kind = field.type
    if kind in _INTS:
        low, high = _INTS[kind]
        return st.one_of(st.integers(max(low, -3), min(high, 64)), st.integers(low, high))
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 99))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.binary(min_size=4, max_size=4).map(lambda b: b * 4))
    return st.one_of(st.sampled_from(words), st.text(max_size=16))


@st.composite
def _message(draw, descriptor: Descriptor, words: list[str], depth: int = 0):
    """A message of ``descriptor``'s type with any subset of its fields set, recursively (maps and repeated fields
    included), to a bounded depth."""
    message = GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        nested = field.message_type
        target = getattr(message, field.name)
        if nested is not None and nested.GetOptions().map_entry:
            key, value = nested.fields_by_name["key"], nested.fields_by_name["value"]
            for _ in range(draw(st.integers(0, 3))):
                k = draw(_scalars(key, words))
                if value.message_type is not None:
                    target[k].CopyFrom(draw(_message(value.message_type, words, depth + 1)))
                else:
                    target[k] = draw(_scalars(value, words))
        elif field.is_repeated:
            for _ in range(draw(st.integers(0, 4 if depth < 3 else 0))):
                if nested is not None:
                    target.add().CopyFrom(draw(_message(nested, words, depth + 1)))
                else:
                    target.append(draw(_scalars(field, words)))
        elif nested is not None:
            if depth < 4:
                target.CopyFrom(draw(_message(nested, words, depth + 1)))
        else:
            setattr(message, field.name, draw(_scalars(field, words)))
    return message


def _raw_model(url: str) -> str:
    """A model driven over raw HTTP, so the fuzz run controls its ``seq_id``s (an out-of-turn one would wait)."""
    session = httpx.post(f"{url}/api/v1/create_session", headers=HEADERS, json={
        "tags": [], "user_metadata": None, "sdk_version": tinker.__version__, "type": "create_session"}).json()
    created = httpx.post(f"{url}/api/v1/create_model", headers=HEADERS, json={
        "session_id": session["session_id"], "model_seq_id": 0, "base_model": BASE_MODEL,
        "lora_config": {"rank": 2}}).json()
    return poll_future(url, created["request_id"], KEY)["model_id"]


@pytest.mark.timeout(900)
def test_hypothesis_protobuf_bodies_are_refused_or_run_never_a_server_error(fuzz_server, stored):
    url = fuzz_server.base_url
    before = _snapshot(fuzz_server, stored)
    model_id = _raw_model(url)
    words = [model_id, "", *LOSSES, "target_tokens", "weights", "logprobs", "advantages", "mask", "clip_low_threshold",
             "clip_high_threshold", "../../etc/passwd", "\x00", "tinker://x/weights/y"]
    next_seq = iter(range(1, 10**6))
    pending_seq = [next(next_seq)]
    outcomes: dict[str, int] = {}
    proto_messages = _message(pb.ForwardBackwardRequest.DESCRIPTOR, words)

    def post(body: bytes, compressed: bool) -> int:
        headers = {**HEADERS, "Content-Type": "application/x-protobuf"}
        if compressed:
            headers["Content-Encoding"] = "zstd"
            body = zstandard.ZstdCompressor().compress(body)
        response = httpx.post(f"{url}/api/v1/forward_backward", headers=headers, content=body, timeout=60)
        _check_error_shape("/api/v1/forward_backward", response)
        if response.status_code != 200:
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            return response.status_code
        result = poll_future(url, response.json()["request_id"], KEY)
        if isinstance(result, bytes):
            outcomes["ran"] = outcomes.get("ran", 0) + 1
        else:
            assert result["category"] == "user", result  # never a server error
            outcomes["user error"] = outcomes.get("user error", 0) + 1
        return response.status_code

    valid = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[make_datum([1, 2, 3], [4, 5]), make_datum([7], [8, 9, 10])], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=0))

    @given(message=proto_messages, own_model=st.booleans(), from_valid=st.sampled_from(["no", "as is", "mutated"]),
           compressed=st.booleans())
    @settings(SETTINGS, max_examples=250)
    def structured(message, own_model: bool, from_valid: str, compressed: bool) -> None:
        if from_valid != "no":  # a valid request, or one with random fields overwritten or appended
            mutated = pb.ForwardBackwardRequest()
            mutated.CopyFrom(valid)
            if from_valid == "mutated":
                mutated.MergeFrom(message)
            message = mutated
        if own_model:
            message.model_id = model_id
        mine = message.model_id == model_id
        if mine:  # in its turn, so that it reaches the trainer (a turn out of order would wait for the gap)
            message.seq_id = pending_seq[0]
        if post(message.SerializeToString(), compressed) == 200 and mine:  # the route ordered this seq_id
            pending_seq[0] = next(next_seq)

    @given(body=st.binary(max_size=256), compressed=st.booleans())
    @settings(SETTINGS, max_examples=100)
    def raw_bytes(body: bytes, compressed: bool) -> None:
        post(body, compressed)

    structured()
    raw_bytes()
    print(f"protobuf fuzz outcomes: {outcomes}")
    assert outcomes.get("refused", 0) > 50 and outcomes.get("user error", 0) > 20 and outcomes.get("ran", 0) > 5

    # A zstd bomb and a body over --max-body-mb are refused, not inflated.
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (8 * 1024 * 1024))
    response = httpx.post(f"{url}/api/v1/forward_backward", content=bomb, headers={
        **HEADERS, "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
    assert response.status_code == 400 and "--max-body-mb 1" in response.json()["error"]
    for path in ("/api/v1/forward_backward", "/api/v1/asample", "/v1/chat/completions"):
        response = httpx.post(f"{url}{path}", content=b"{" * (2 * 1024 * 1024), headers={
            **HEADERS, "Content-Type": "application/json"})
        assert response.status_code == 413, (path, response.text)
        _check_error_shape(path, response)
    _assert_unchanged_and_serving(fuzz_server, stored, before)



def _sparse_datums(model_id: str, seq_id: int, columns: int, count: int = 3) -> bytes:
    """A ~100-byte-per-datum ForwardBackwardRequest whose sparse ``weights`` state the shape [1, columns]."""
    weights = pb.Tensor(sparse_csr=pb.SparseCsr(values=b"", crow_indices=np.zeros(2, np.int64).tobytes(),
                                                col_indices=b""), dtype=pb.DTYPE_FLOAT32, shape=[1, columns])
    targets = pb.Tensor(dense=np.ones(1, np.int64).tobytes(), dtype=pb.DTYPE_INT64, shape=[1])
    datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=np.ones(1, np.int32).tobytes()))],
                     loss_fn_inputs={"weights": weights, "target_tokens": targets})
    return pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy",
                                     data=[datum] * count).SerializeToString()


def test_tiny_bodies_stating_huge_sizes_or_depths_are_refused_without_memory_or_stalls(fuzz_server, stored):
    """Sparse shapes in a few hundred bytes once made the server build the dense array first: [1, 2**28] weights
    took 1 GiB per datum and blocked every tenant for ~7 s; [1, 2**40] answered 500; so did sparse
    target_prompt_logprobs in asample, and JSON nested 200,000 deep on every route. Now each is a user error naming
    the limit, the server's memory stays flat, and /healthz answers promptly all the while."""
    url = fuzz_server.base_url
    before = _snapshot(fuzz_server, stored)
    model_id = _raw_model(url)
    server_process = psutil.Process(fuzz_server.process.pid)
    rss_before = server_process.memory_info().rss
    slowest, watching = [0.0], threading.Event()

    def watch_health() -> None:
        while not watching.is_set():
            start = time.perf_counter()
            assert httpx.get(f"{url}/api/v1/healthz", timeout=60).status_code == 200
            slowest[0] = max(slowest[0], time.perf_counter() - start)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    try:
        for seq_id, columns in enumerate((2**28, 2**40), start=1):
            body = _sparse_datums(model_id, seq_id, columns)
            assert len(body) < 400
            response = httpx.post(f"{url}/api/v1/forward_backward", content=body, timeout=60,
                                  headers={**HEADERS, "Content-Type": "application/x-protobuf"})
            assert response.status_code == 200, response.text
            failed = poll_future(url, response.json()["request_id"], KEY)
            assert failed["category"] == "user" and "K ≤ 4 (--max-logprobs-k)" in failed["error"], failed
        for columns in (2**27, 2**40):
            response = httpx.post(f"{url}/api/v1/asample", headers=HEADERS, timeout=60, json={
                "num_samples": 1, "base_model": BASE_MODEL, "sampling_params": {"max_tokens": 1},
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                "target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [1, columns],
                                           "sparse_crow_indices": [0, 1], "sparse_col_indices": [0]}})
            assert response.status_code == 200, response.text
            failed = poll_future(url, response.json()["request_id"], KEY)
            assert failed["category"] == "user" and "K may be at most the vocabulary size" in failed["error"], failed
        deep = "[" * 200_000 + "]" * 200_000
        for path in ("/api/v1/asample", "/api/v1/create_model", "/v1/chat/completions", "/v1/completions"):
            response = httpx.post(f"{url}{path}", content=deep, timeout=60, headers={
                **HEADERS, "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            assert response.status_code == 400 and "nested too deeply" in response.text, (path, response.text)
            _check_error_shape(path, response)
    finally:
        watching.set()
        watcher.join()
    grown = server_process.memory_info().rss - rss_before
    print(f"server RSS grew {grown / 2**20:.0f} MiB; slowest /healthz {slowest[0] * 1000:.0f} ms during the attack")
    assert grown < 256 * 2**20  # once: +1 GiB per datum
    assert slowest[0] < 5.0  # once: the event loop blocked ~7 s per datum
    _assert_unchanged_and_serving(fuzz_server, stored, before)
