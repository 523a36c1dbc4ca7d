"""What another Tinker-compatible server's OpenAI tests expect of hosted Tinker's endpoint (the OpenAI API tests of
TuFT, agentscope-ai/TuFT on GitHub, their expectations re-written here against this server's fixtures), through
``{base}/oai/api/v1`` with plain HTTP as those tests send it: every expectation that is the OpenAI / hosted-Tinker
contract. Left out, as TuFT's own formats: its ``<left>:sample:<right>`` response ids, 403 for a wrong key (OpenAI
answers 401, as here), ``X-API-Key`` on these routes, ``{"detail"}`` error bodies, and 400 for a missing ``model``
(vLLM's rule, kept here: the one served base model)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from tinker import types

from tests.helpers import BASE_MODEL

KEY = "tml-hosted-contract"
AUTH = {"Authorization": f"Bearer {KEY}"}
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]


@pytest.fixture(scope="module")
def base(server) -> str:
    return f"{server.base_url}/oai/api/v1"


@pytest.fixture(scope="module")
def adapter_path(server) -> str:
    import tinker

    client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY).create_lora_training_client(
        base_model=BASE_MODEL, rank=8)
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)})
    client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    return client.save_weights_for_sampler("hosted-contract").result().path


def post(base: str, route: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{base}{route}", json=body, headers=AUTH if headers is None else headers, timeout=120)


def stream(base: str, route: str, body: dict) -> tuple[str, list[str]]:
    with httpx.stream("POST", f"{base}{route}", json={**body, "stream": True}, headers=AUTH, timeout=120) as answer:
        assert answer.status_code == 200
        return answer.headers["content-type"], [line for line in answer.iter_lines() if line.startswith("data:")]


def test_completions_as_hosted_tinkers_clients_read_them(base):
    one = post(base, "/completions", {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 20}).json()
    assert len(one["choices"]) == 1 and one["choices"][0]["text"] and one["model"] == BASE_MODEL
    usage = one["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    three = post(base, "/completions", {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 5, "n": 3,
                                        "temperature": 0.9}).json()
    assert sorted(choice["index"] for choice in three["choices"]) == [0, 1, 2]
    short = post(base, "/completions", {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 3}).json()
    assert short["usage"]["completion_tokens"] <= 3
    stopped = post(base, "/completions", {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 30, "stop": ["\n"]})
    assert "\n" not in stopped.json()["choices"][0]["text"]
    flagged = post(base, "/completions", {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 5, "logprobs": True})
    assert flagged.status_code == 200 and flagged.json()["choices"][0]["logprobs"] is not None
    for knobs in ({"top_p": 0.5}, {"presence_penalty": 0.5, "frequency_penalty": 0.5}):
        assert post(base, "/completions", {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 5, **knobs}
                    ).status_code == 200, knobs
    assert len(post(base, "/completions", {"model": BASE_MODEL, "prompt": ["Hello", "World"], "max_tokens": 5}
                    ).json()["choices"]) >= 2
    ids = {post(base, "/completions", {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 2}).json()["id"]
           for _ in range(3)}
    assert len(ids) == 3


def test_streams_end_with_done_echo_the_model_and_carry_usage_when_asked(base):
    kind, lines = stream(base, "/completions", {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 20})
    chunks = [json.loads(line[5:]) for line in lines[:-1]]
    assert "text/event-stream" in kind and lines[-1].strip() == "data: [DONE]"
    assert chunks and all(chunk["model"] == BASE_MODEL for chunk in chunks)
    _, lines = stream(base, "/completions", {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 20,
                                             "stream_options": {"include_usage": True}})
    assert json.loads(lines[-2][5:])["usage"]["total_tokens"] > 0
    _, lines = stream(base, "/chat/completions", {"model": BASE_MODEL, "messages": TURNS, "max_tokens": 20})
    chunks = [json.loads(line[5:]) for line in lines[:-1]]
    assert all(chunk["choices"] for chunk in chunks), "without include_usage every chunk has a choice"
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)


def test_chat_turns_and_models(base, server):
    reply = post(base, "/chat/completions", {"model": BASE_MODEL, "messages": TURNS, "max_tokens": 10,
                                             "temperature": 0}).json()
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] and reply["model"] == BASE_MODEL
    assert len(post(base, "/chat/completions", {"model": BASE_MODEL, "messages": TURNS, "max_tokens": 5, "n": 2}
                    ).json()["choices"]) == 2
    assert post(base, "/chat/completions", {"model": BASE_MODEL, "messages": TURNS, "max_tokens": 10, "stop": ["D"],
                                            "temperature": 0.7, "top_p": 0.9}).status_code == 200
    assert post(base, "/chat/completions", {"model": "nonexistent/model", "messages": TURNS}).status_code == 404
    listed = httpx.get(f"{base}/models", headers=AUTH, timeout=30).json()
    assert listed["object"] == "list" and BASE_MODEL in [model["id"] for model in listed["data"]]


def test_a_sampler_checkpoint_path_is_a_model_of_its_owner_alone(base, adapter_path):
    reply = post(base, "/chat/completions", {"model": adapter_path, "messages": TURNS, "max_tokens": 30,
                                             "temperature": 0}).json()
    assert reply["model"] == adapter_path and reply["choices"][0]["message"]["content"]
    text = post(base, "/completions", {"model": adapter_path, "prompt": "Hello", "max_tokens": 5, "logprobs": 2}).json()
    assert text["model"] == adapter_path and text["usage"]["total_tokens"] > 0 and text["choices"][0]["logprobs"]
    _, lines = stream(base, "/chat/completions", {"model": adapter_path, "messages": TURNS, "max_tokens": 10})
    assert lines[-1].strip() == "data: [DONE]"
    assert all(json.loads(line[5:])["model"] == adapter_path for line in lines[:-1])
    other = {"Authorization": "Bearer tml-hosted-contract-other"}
    listed = httpx.get(f"{base}/models", headers=other, timeout=30).json()["data"]
    assert not any(model["id"].startswith("tinker://") for model in listed)
    assert post(base, "/chat/completions", {"model": adapter_path, "messages": TURNS, "max_tokens": 5},
                other).status_code == 404


def test_no_key_is_401_on_a_server_with_keys(keyed_server):
    running, _ = keyed_server
    base = f"{running.base_url}/oai/api/v1"
    assert httpx.post(f"{base}/completions", json={"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 5},
                      timeout=30).status_code == 401
    answer = httpx.get(f"{base}/models", timeout=30)
    assert answer.status_code == 401 and answer.json()["error"]["message"]
