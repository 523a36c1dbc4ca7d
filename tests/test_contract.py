"""The wire contract pinned from the tinker and openai SDKs: no change on the wire, every pinned route served, live
responses conform."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from contract.generate import PINNED, VERSION_KEY, differences, generate, main, render, version_changes
from tests.helpers import BASE_MODEL, make_datum

ROUTES = json.loads((PINNED / "tinker_routes.json").read_text())["routes"]
SCHEMAS = json.loads((PINNED / "tinker_schemas.json").read_text())["schemas"]


@pytest.fixture(scope="module")
def generated() -> dict[str, dict]:
    """The contract as the installed SDKs give it now."""
    return generate()


def test_pinned_contract_matches_installed_sdks(generated):
    changed = differences(generated)
    assert not changed, ("\n\n".join(changed.values()) + "\n\nThe installed SDKs changed the wire contract: adapt the "
                         "server to the diff above, then run `python -m contract.generate`.")


def pinned_copy(directory: Path, contract: dict[str, dict], edit=lambda name, content: None) -> Path:
    """The contract written as pinned files, each first changed in place by ``edit(name, content)``."""
    for name, content in copy.deepcopy(contract).items():
        edit(name, content)
        (directory / name).write_text(render(content))
    return directory


def added_lines(diff: str) -> list[str]:
    """The lines a unified diff adds, without their indentation."""
    return [line[1:].strip() for line in diff.splitlines()[2:] if line.startswith("+")]


def test_an_sdk_version_that_changes_nothing_on_the_wire_passes(generated, tmp_path):
    """A pinned file records the SDK version it was made from; another version with the same wire is no drift."""
    pinned = pinned_copy(tmp_path, generated, lambda name, content: content.update({VERSION_KEY: "0.0.1"}))
    assert differences(generated, pinned) == {}
    assert version_changes(generated, pinned) == {name: ("0.0.1", content[VERSION_KEY])
                                                  for name, content in generated.items()}
    assert version_changes(generated, pinned_copy(tmp_path, generated)) == {}


def test_a_changed_schema_or_message_fails_with_the_diff(generated, tmp_path):
    """An SDK that adds a response field and renames a protobuf field: both files are named, each diff shows the
    change against the SDK versions on both sides; the files it left alone are not listed."""
    def older(name: str, content: dict) -> None:
        if name == "openai_schemas.json":
            del content["schemas"]["ChatCompletion"]["properties"]["system_fingerprint"]
            content[VERSION_KEY] = "3.0.0"
        if name == "tinker_protobuf.json":
            content["descriptor"]["message_type"][0]["field"][0]["name"] = "old_sequences"

    changed = differences(generated, pinned_copy(tmp_path, generated, older))
    assert sorted(changed) == ["openai_schemas.json", "tinker_protobuf.json"]
    openai_diff = changed["openai_schemas.json"].splitlines()
    assert openai_diff[0] == "--- openai_schemas.json as pinned (openai 3.0.0)"
    installed = generated["openai_schemas.json"][VERSION_KEY]
    assert openai_diff[1] == f"+++ openai_schemas.json from the installed openai {installed}"
    assert '"system_fingerprint": {' in added_lines(changed["openai_schemas.json"])
    assert not any(line[0] == "-" for line in openai_diff[2:])
    proto_diff = [line[0] + line[1:].strip() for line in changed["tinker_protobuf.json"].splitlines()[2:]
                  if line[0] in "+-"]
    assert proto_diff == ['-"name": "old_sequences",', '+"name": "sequences",']


def test_reworded_documentation_is_no_drift_but_a_field_named_title_is_wire(generated, tmp_path):
    """Titles and descriptions document a schema; an SDK release that rewords them changes nothing on the wire. A
    field that happens to be named ``title`` (a URL citation's) is part of the wire all the same."""
    def reworded(name: str, content: dict) -> None:
        for schema in content.get("schemas", {}).values():
            schema.update(title="Renamed", description="Reworded.")
            for field in schema.get("properties", {}).values():
                field["description"] = "A new docstring, with a [link](https://example.com)."

    assert differences(generated, pinned_copy(tmp_path, generated, reworded)) == {}

    def without_title_field(name: str, content: dict) -> None:
        if name == "openai_schemas.json":
            del content["schemas"]["ChatCompletion"]["$defs"]["AnnotationURLCitation"]["properties"]["title"]

    changed = differences(generated, pinned_copy(tmp_path, generated, without_title_field))
    assert list(changed) == ["openai_schemas.json"]
    assert added_lines(changed["openai_schemas.json"]) == ['},', '"title": {', '"type": "string"']


def test_check_says_a_version_changed_and_fails_only_on_a_wire_change(generated, tmp_path, capsys):
    """``python -m contract.generate --check``: a new openai version alone is reported and passes; with a schema
    change it prints the diff and exits 1."""
    installed = generated["openai_schemas.json"][VERSION_KEY]

    def new_version(name: str, content: dict) -> None:
        if name == "openai_schemas.json":
            content[VERSION_KEY] = "3.0.0"

    main(["--check", "--pinned", str(pinned_copy(tmp_path, generated, new_version))])
    assert capsys.readouterr().out.splitlines() == [
        (f"openai_schemas.json: generated from openai 3.0.0, installed openai {installed}: the wire is unchanged "
         "(regenerate to record the new version)"),
        "the wire contract matches the installed SDKs"]

    def new_field(name: str, content: dict) -> None:
        new_version(name, content)
        if name == "openai_schemas.json":
            del content["schemas"]["Completion"]["properties"]["system_fingerprint"]

    with pytest.raises(SystemExit) as exited:
        main(["--check", "--pinned", str(pinned_copy(tmp_path, generated, new_field))])
    out = capsys.readouterr().out.splitlines()
    assert exited.value.code == 1
    assert out[0] == f"openai_schemas.json: generated from openai 3.0.0, installed openai {installed}"
    assert out[1:3] == ["--- openai_schemas.json as pinned (openai 3.0.0)",
                        f"+++ openai_schemas.json from the installed openai {installed}"]
    assert out[-1] == "the wire contract differs from the installed SDKs: openai_schemas.json"


def test_a_missing_pinned_file_is_a_difference(generated, tmp_path):
    pinned = pinned_copy(tmp_path, generated)
    (pinned / "tinker_routes.json").unlink()
    assert list(differences(generated, pinned)) == ["tinker_routes.json"]


def test_every_pinned_route_is_served(tmp_path: Path):
    from compat_server.app import create_app
    from compat_server.config import ServerConfig

    app = create_app(ServerConfig(data_dir=tmp_path))  # built, not started: only the route table is read
    served = {(method, re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path))
              for route in app.routes for method in route.methods}
    missing = [(r["method"], r["path"]) for r in ROUTES if (r["method"], r["path"]) not in served]
    assert missing == []
    from contract import documented
    from contract.routes import DOCUMENTED_ROUTES

    assert [(r.method, r.path) for r in DOCUMENTED_ROUTES if (r.method, r.path) not in served] == []
    assert all(hasattr(documented, name) for r in DOCUMENTED_ROUTES for name in (r.request, r.response) if name)


SDK_CALLS = json.loads((PINNED / "tinker_sdk_calls.json").read_text())["calls"]


def _served_instances(app) -> list[tuple[str, str]]:
    """(method, path) of every served route with each path parameter filled in by a sample value."""
    return [(method, re.sub(r"\{[^}]+\}", "x", route.path)) for route in app.routes for method in route.methods]


def _sdk_pattern(path: str) -> re.Pattern:
    """A route the SDK calls as a pattern: an interpolated value is one path segment, except a checkpoint id, which
    is ``kind/name``."""
    parts = re.split(r"(\{[^}]+\})", path)
    return re.compile("^" + "".join(
        ("[^/]+/[^/]+" if part.endswith("checkpoint_id}") else "[^/]+") if part.startswith("{") else re.escape(part)
        for part in parts) + "$")


def test_every_route_the_sdk_calls_is_served(tmp_path: Path):
    """Read from the SDK's own source (``contract/sdk_calls.py``, pinned in tinker_sdk_calls.json): a route the SDK
    can call that this app does not serve fails here."""
    from compat_server.app import create_app
    from compat_server.config import ServerConfig

    served = _served_instances(create_app(ServerConfig(data_dir=tmp_path)))
    missing = {(call["method"], call["path"]) for call in SDK_CALLS
               if not any(method == call["method"] and _sdk_pattern(call["path"]).match(path)
                          for method, path in served)}
    assert missing == set()


def conforms(name: str, body: dict) -> dict:
    jsonschema.validate(body, SCHEMAS[name])
    return body


class Client:
    """Raw HTTP, exactly as the SDK would send it, so each response can be checked against its pinned schema."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, headers={"X-API-Key": "tml-contract"}, timeout=60)

    def post(self, path: str, body: dict, response: str | None) -> dict:
        answer = self.http.post(f"/api/v1/{path}", json=body)
        assert answer.status_code == 200, answer.text
        return conforms(response, answer.json()) if response else answer.json()

    def result(self, future: dict, result: str | None) -> dict | bytes:
        conforms("UntypedAPIFuture", future)
        while True:
            answer = self.http.post("/api/v1/retrieve_future", json={"request_id": future["request_id"],
                                                                      "allow_metadata_only": True})
            assert answer.status_code == 200
            if answer.headers["content-type"].startswith("application/x-protobuf"):
                return answer.content
            body = answer.json()
            if body.get("type") != "try_again":
                if "error" in body:
                    return conforms("RequestFailedResponse", body)
                return conforms(result, body) if result else body
            conforms("TryAgainResponse", body)


def test_live_responses_validate_against_pinned_schemas(server):
    c = Client(server.base_url)
    c.post("client/config", {"sdk_version": "0.38.0"}, "ClientConfigResponse")
    c.post("client/dynamic_config", {"sdk_version": "0.38.0"}, "ClientDynamicConfigResponse")
    conforms("HealthResponse", c.http.get("/api/v1/healthz").json())
    caps = conforms("GetServerCapabilitiesResponse", c.http.get("/api/v1/get_server_capabilities").json())
    assert BASE_MODEL in [m["model_name"] for m in caps["supported_models"]]
    session = c.post("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"},
                     "CreateSessionResponse")["session_id"]
    c.post("session_heartbeat", {"session_id": session}, "SessionHeartbeatResponse")
    c.post("telemetry", {"events": [], "platform": "linux", "sdk_version": "0.38.0", "session_id": session,
                         "process_uuid": "p"}, "TelemetryResponse")

    created = c.result(c.post("create_model", {
        "session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL, "lora_config": {"rank": 4, "seed": 1},
    }, None), "CreateModelResponse")
    model_id = created["model_id"]
    assert model_id == f"{session}:train:0"
    info = c.post("get_info", {"model_id": model_id}, "GetInfoResponse")
    assert info["model_data"]["tokenizer_id"]

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[make_datum([1, 2, 3], [4, 5])],
                                                          loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1)
    answer = c.http.post("/api/v1/forward_backward", content=forward_backward_request_to_proto(request)
                         .SerializeToString(), headers={"Content-Type": "application/x-protobuf"})
    proto_bytes = c.result(answer.json(), None)
    pb.ForwardBackwardOutput().ParseFromString(proto_bytes)
    output = deserialize_forward_backward_output(proto_bytes)
    assert output.loss_fn_outputs[0]["logprobs"].shape == [4] and "loss:sum" in output.metrics

    c.result(c.post("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}},
                    None), "OptimStepResponse")
    saved = c.result(c.post("save_weights", {"model_id": model_id, "path": "c1", "seq_id": 3}, None),
                     "SaveWeightsResponse")
    c.result(c.post("save_weights_for_sampler", {"model_id": model_id, "path": "c1", "seq_id": 4}, None),
             "SaveWeightsForSamplerResponseInternal")
    refused = c.result(c.post("load_weights", {"model_id": model_id, "seq_id": 5, "path": saved["path"],
                                                "optimizer": True}, None), None)  # only a first request may load
    assert refused["category"] == "user" and "LoadWeights is not permitted with seq_id 5" in refused["error"]
    loaded = c.result(c.post("create_model", {"session_id": session, "model_seq_id": 2, "base_model": BASE_MODEL,
                                              "lora_config": {"rank": 4}}, None), "CreateModelResponse")
    c.result(c.post("load_weights", {"model_id": loaded["model_id"], "seq_id": 1, "path": saved["path"],
                                     "optimizer": True}, None), "LoadWeightsResponse")
    failed = c.result(c.post("save_weights", {"model_id": model_id, "path": "c1", "seq_id": 6}, None), None)
    assert failed["category"] == "user" and "already exists" in failed["error"]
    c.result(c.post("unload_model", {"model_id": model_id}, None), "UnloadModelResponse")
    c.post(f"sessions/{session}/finish", {"reason": {"type": "success"}, "detail": None}, None)

    # A request whose turn has not come (seq 2 of a model with no seq 1) is answered with try_again.
    other = c.result(c.post("create_model", {"session_id": session, "model_seq_id": 1, "base_model": BASE_MODEL,
                                             "lora_config": {"rank": 4}}, None), "CreateModelResponse")
    waiting = c.post("optim_step", {"model_id": other["model_id"], "seq_id": 2, "adam_params": {}}, None)
    answer = c.http.post("/api/v1/retrieve_future", json={"request_id": waiting["request_id"]})
    conforms("TryAgainResponse", answer.json())


@pytest.mark.parametrize("headers, message", [({}, "missing API key"), ({"X-API-Key": "sk-not-tinker"}, "tml-"),
                                              ({"X-API-Key": "tml-never-registered"}, "unknown or revoked")])
def test_requests_without_a_valid_key_are_refused_with_auth_keys(keyed_server, headers, message):
    server, _ = keyed_server
    answer = httpx.post(f"{server.base_url}/api/v1/create_session", headers=headers,
                        json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    assert answer.status_code == 401 and message in answer.json()["error"]


def test_malformed_bodies_are_400_and_unknown_futures_404(server):
    http = httpx.Client(base_url=server.base_url, headers={"X-API-Key": "tml-contract"})
    bad_proto = http.post("/api/v1/forward_backward", content=b"\xff\xff\xff",
                          headers={"Content-Type": "application/x-protobuf"})
    assert bad_proto.status_code == 400 and "ForwardBackwardRequest" in bad_proto.json()["error"]
    bad_json = http.post("/api/v1/create_model", content=b"{not json", headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400
    unknown_field = http.post("/api/v1/optim_step", json={"model_id": "x", "adam_params": {}, "bogus": 1})
    assert unknown_field.status_code == 400
    unknown = http.post("/api/v1/retrieve_future", json={"request_id": "req-nope"})
    assert unknown.status_code == 404
    gone = http.post("/api/v1/session_heartbeat", json={"session_id": "no-such-session"})
    assert gone.status_code == 410 and "unknown session_id" in gone.json()["error"]
    # Unknown model id: the future fails with a user error naming it.
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[make_datum([1, 2], [3])], loss_fn="cross_entropy"),
        model_id="nobody:train:0", seq_id=1)
    future = http.post("/api/v1/forward_backward", headers={"Content-Type": "application/x-protobuf"},
                       content=forward_backward_request_to_proto(request).SerializeToString()).json()
    failed = http.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).json()
    assert failed == {"error": "unknown model_id 'nobody:train:0'", "category": "user"}
    assert http.get("/api/v1/healthz").status_code == 200
    np.testing.assert_equal(server.alive(), True)


OPENAI = json.loads((PINNED / "openai_schemas.json").read_text())


def test_every_openai_route_is_served(tmp_path: Path):
    from compat_server.app import create_app
    from compat_server.config import ServerConfig

    app = create_app(ServerConfig(data_dir=tmp_path))
    served = {method + " " + re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path) for route in app.routes
              for method in route.methods}
    assert [r for r in OPENAI["routes"] if r not in served] == []


def test_live_openai_responses_conform(server):
    """Raw responses (not parsed by the lenient SDK) validate against the openai SDK's pinned response schemas."""
    http = httpx.Client(base_url=f"{server.base_url}/v1", headers={"Authorization": "Bearer tml-contract"},
                        timeout=60)
    schemas = OPENAI["schemas"]
    chat = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 1}
    jsonschema.validate(http.post("/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2}).json(),
                        schemas["ChatCompletion"])
    jsonschema.validate(http.post("/completions", json={"model": BASE_MODEL, "prompt": "a", "max_tokens": 3,
                                                         "logprobs": 1}).json(), schemas["Completion"])
    for model in http.get("/models").json()["data"]:
        jsonschema.validate(model, schemas["Model"])
    with http.stream("POST", "/chat/completions", json={**chat, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        jsonschema.validate(json.loads(event), schemas["ChatCompletionChunk"])
    error = http.post("/chat/completions", json={**chat, "model": "nope"})
    assert error.status_code == 404
    jsonschema.validate(error.json()["error"], schemas["ErrorObject"])


def test_documented_types_are_still_ahead_of_the_installed_sdk():
    """``contract/documented.py`` pins fields hosted Tinker documents for a newer SDK than the one installed. Once the
    installed SDK carries one, its own type is the source of truth: use it and delete the documented one."""
    from importlib.metadata import version

    from contract import documented

    for documented_type, fields in documented.ADDED_FIELDS.items():
        sdk_type = documented_type.__mro__[1]
        carried = [name for name in fields if name in sdk_type.model_fields]
        assert not carried, (f"tinker {version('tinker')} now carries {sdk_type.__name__}.{', '.join(carried)}: answer "
                             f"with its own type and delete contract.documented.{documented_type.__name__}")
        assert all(name in documented_type.model_fields for name in fields)
    from tinker import types

    carried = [name for name in documented.NEW_TYPES if hasattr(types, name)]
    assert not carried, (f"tinker {version('tinker')} now has {', '.join(carried)}: use its own types (and its "
                         "RestClient methods in the tests) and delete them from contract.documented")
