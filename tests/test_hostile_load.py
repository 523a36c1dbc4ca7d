"""Issue 31's mixed load: 15 honest clients — over Tinker (training and sampling), OpenAI chat, Anthropic messages,
Responses and /tokenize, each its own tenant — and one hostile tenant that cycles through the attacks of the
issue's table, for ``COMPAT_SERVER_HOSTILE_LOAD_SECONDS`` (default 25) against the shared server.

What must hold: no honest call fails (the figure ``docs/reliability.md`` reports), every hostile call is refused as
the caller's own error (a 4xx, or a Tinker future failed with category ``user``), and the server still serves
afterwards. Nothing here asserts on time; the counts are printed."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.helpers import ADAM, BASE_MODEL, create_doubled, make_datum

pytestmark = pytest.mark.soak

SECONDS = float(os.environ.get("COMPAT_SERVER_HOSTILE_LOAD_SECONDS", "25"))
HONEST = ("tinker-train", "tinker-sample", "openai", "anthropic", "responses", "tokenize")


def honest_calls(server, index: int, opened: list) -> Callable[[], None]:
    """One honest client's call, repeated until the time is up; each checks its own answer. Tinker service clients
    go into ``opened``, to be closed at the end."""
    kind = HONEST[index % len(HONEST)]
    key = f"tml-load-honest-{index}"
    if kind.startswith("tinker"):
        service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
        opened.append(service)
        training = service.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=index)
        datum = make_datum([3 + index, 4, 5], [6, 7, 8])
        if kind == "tinker-train":
            def call() -> None:
                result = training.forward_backward([datum], "cross_entropy").result()
                assert result.metrics["loss:sum"] > 0
                assert training.optim_step(ADAM).result() is not None
            return call
        sampler = training.save_weights_and_get_sampling_client()

        def call() -> None:
            answer = sampler.sample(types.ModelInput.from_ints([3, 4, 5]), 1,
                                    types.SamplingParams(max_tokens=8, temperature=1.0)).result()
            assert len(answer.sequences[0].tokens) >= 1
        return call
    if kind == "openai":
        chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
        return lambda: chat.chat.completions.create(model=BASE_MODEL, max_tokens=8,
                                                    messages=[{"role": "user", "content": "hello"}])
    if kind == "anthropic":
        claude = anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)
        return lambda: claude.messages.create(model=BASE_MODEL, max_tokens=8,
                                              messages=[{"role": "user", "content": "hello"}])
    if kind == "responses":
        oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
        return lambda: oai.responses.create(model=BASE_MODEL, input="hello", max_output_tokens=8)

    def tokenize() -> None:
        answer = httpx.post(f"{server.base_url}/tokenize", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                            json={"model": BASE_MODEL, "prompt": "hello there"})
        assert answer.status_code == 200 and answer.json()["tokens"], answer.text
    return tokenize


def fails_as_user_error(call: Callable[[], object]) -> bool:
    """Whether a Tinker call's future failed as the caller's own error."""
    try:
        call()
    except tinker.RequestFailedError as failure:
        return failure.category == tinker.types.RequestErrorCategory.User
    return False


def hostile_calls(server, opened: list) -> list[Callable[[], bool]]:
    """The attacks, each returning whether it was refused as the caller's own error."""
    key = "tml-load-hostile"
    headers = {"Authorization": f"Bearer {key}"}
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    opened.append(service)
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=99)
    on_meta = service.create_custom_loss(lambda logprobs: (logprobs.to("meta").sum(), {}), {"logprobs": 1}).result()
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    recursive = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#"}}}

    def broken_loss() -> bool:
        return fails_as_user_error(
            lambda: training.forward_backward_custom([make_datum([3, 4], [5, 6])], on_meta).result())

    def listed(logprobs):
        square = (logprobs.unsqueeze(0) * logprobs.unsqueeze(1)).unsqueeze(0)
        return square[[0] * 1024].sum(), {}

    list_index = service.create_custom_loss(listed, {"logprobs": 1}).result()
    long = make_datum(list(range(1, 200)), list(range(2, 102)))

    def index_by_a_list() -> bool:
        return fails_as_user_error(lambda: training.forward_backward_custom([long], list_index).result())

    def million_references() -> bool:
        nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs"},
                 {"op": "call_function", "name": "s", "target": "torch.add", "args": [{"ref": "logprobs"}] * 10**6}]
        answer = httpx.post(f"{server.base_url}/api/v1/create_custom_loss", headers=headers, timeout=120,
                            json={"session_id": service.holder.get_session_id(), "custom_loss_seq_id": 8000,
                                  "name": "huge", "inputs": [{"name": "logprobs", "rank": 1}],
                                  "graph": {"nodes": nodes}})
        return answer.status_code == 400

    def schema_that_admits_nothing() -> bool:
        try:
            chat.chat.completions.create(model=BASE_MODEL, max_tokens=8, response_format=recursive,
                                         messages=[{"role": "user", "content": "hi"}])
        except openai.BadRequestError:
            return True
        return False

    def huge_prompt() -> bool:
        answer = httpx.post(f"{server.base_url}/tokenize", headers=headers, timeout=120,
                            json={"model": BASE_MODEL, "prompt": "a" * (16 << 20)})
        return answer.status_code == 400

    def date_out_of_range() -> bool:
        answer = httpx.get(f"{server.base_url}/api/v1/audit", headers=headers, timeout=60,
                           params={"day": "9999-12-31"})
        return 400 <= answer.status_code < 500

    def huge_session() -> bool:
        answer = httpx.post(f"{server.base_url}/api/v1/create_session", headers=headers, timeout=60,
                            json={"tags": ["x" * (8 << 20)], "user_metadata": {}, "sdk_version": "0"})
        return answer.status_code == 400

    doubled = create_doubled(server, service.holder.get_session_id(), key)

    def doubling_loss() -> bool:
        return fails_as_user_error(
            lambda: training.forward_backward([make_datum([3, 4], [5, 6])], "custom", {"loss_id": doubled}).result())

    def token_for_token() -> bool:
        token = httpx.post(f"{server.base_url}/api/v1/auth/token", headers=headers, timeout=60).json()["jwt"]
        again = httpx.post(f"{server.base_url}/api/v1/auth/token", headers={"X-API-Key": token}, timeout=60)
        return again.status_code == 403

    return [broken_loss, schema_that_admits_nothing, huge_prompt, doubling_loss, million_references,
            index_by_a_list, date_out_of_range, huge_session, token_for_token]


def test_honest_tenants_see_no_error_while_one_tenant_attacks(server):
    outcomes: Counter = Counter()
    failures: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + SECONDS
    opened: list[tinker.ServiceClient] = []

    def honest(index: int) -> None:
        call = honest_calls(server, index, opened)
        while time.monotonic() < deadline:
            try:
                call()
                kind = "ok"
            except Exception as exc:  # noqa: BLE001 - every honest failure is counted and shown
                kind = "error"
                with lock:
                    failures.append(f"{HONEST[index % len(HONEST)]}: {type(exc).__name__}: {str(exc)[:300]}")
            with lock:
                outcomes[f"honest {kind}"] += 1

    def hostile() -> None:
        attacks = hostile_calls(server, opened)
        turn = 0
        while time.monotonic() < deadline:
            attack = attacks[turn % len(attacks)]
            try:
                refused = attack()
            except Exception:  # noqa: BLE001 - a server error, or anything else, is not a refusal
                refused = False
            with lock:
                outcomes[f"hostile {'refused' if refused else 'NOT refused'}: {attack.__name__}"] += 1
            turn += 1

    try:
        with ThreadPoolExecutor(16) as pool:
            jobs = [pool.submit(honest, i) for i in range(15)] + [pool.submit(hostile)]
            for job in jobs:
                job.result()
    finally:
        for service in opened:
            service.close("success")
    print(f"\nmixed load, {SECONDS:.0f} s: {dict(sorted(outcomes.items()))}")
    assert not failures, failures[:10]
    assert outcomes["honest ok"] >= 15
    assert not [kind for kind in outcomes if "NOT refused" in kind], outcomes
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
